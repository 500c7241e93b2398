"""Goodput as DistServe defines it, searched: probes sized for steady state, judged against every
SLO pair afterwards, bracketed then bisected to 5 %; against a server of known capacity, in
virtual time (thousands of requests a probe) and for real over gRPC (`baton bench serve --goodput`)."""
from __future__ import annotations

import asyncio
import json
import math

import pytest
from fake_router import CreditRouter, Served

from baton.benchmarks import loadgen
from baton.benchmarks.cli import main as bench_main
from baton.benchmarks.goodput import SLO, Outcome, Probe, Search, probe_plan, slo_pairs

LOOSE, TIGHT = SLO(1.0, 0.025), SLO(1.0, 0.015)


def flat_probe(rate: float, ttft: float = 0.1, tpot: float = 0.01, ok: bool = True, n: int = 100) -> Probe:
    return Probe(rate, [Outcome(ok, ttft, tpot, i / rate) for i in range(n)])


def test_a_probe_is_sized_for_steady_state_from_the_slowest_request_that_could_pass():
    plan = probe_plan([LOOSE, TIGHT], max_output_tokens=32)
    assert plan.tail_s == pytest.approx(1.0 + 31 * 0.025)            # the loosest pair's longest request
    assert plan.warmup_s == plan.tail_s and plan.window_s == 10.0     # 3 lifetimes < the 10 s floor
    assert plan.deadline_s == pytest.approx(plan.tail_s * 1.1 + 0.5)
    assert plan.sizes(20.0) == (36, 200, 36)
    assert plan.sizes(1.0) == (2, 50, 2)                              # at least 50 measured
    long = probe_plan([LOOSE], max_output_tokens=1024)
    assert long.window_s == pytest.approx(3 * long.tail_s)            # several lifetimes of the longest


def test_requests_are_cut_at_the_deadline_and_the_cool_down_ends_with_the_last_measured():
    plan = probe_plan([LOOSE], max_output_tokens=8, min_window_s=1.0, min_requests=4)
    warm, measured, cool = plan.sizes(10.0)
    arrivals = loadgen.segment_arrivals([warm, measured, cool], 10.0, seed=3)
    timeouts = plan.timeouts(arrivals, 10.0)
    end = arrivals[warm + measured - 1] + plan.deadline_s
    assert timeouts[:warm + measured] == [plan.deadline_s] * (warm + measured)
    assert all(t + dt == pytest.approx(end) or dt == 0.1 for t, dt in zip(arrivals[warm + measured:],
                                                                         timeouts[warm + measured:], strict=True))


def test_each_phase_of_a_probe_arrives_at_exactly_the_nominal_rate():
    arrivals = loadgen.segment_arrivals([50, 400, 50], 40.0, seed=0)
    assert arrivals[0] == 0 and arrivals == sorted(arrivals)
    measured = arrivals[50:450]
    assert measured[0] >= 50 / 40 - arrivals[0] - 1.0 and measured[-1] - measured[0] <= 400 / 40
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    assert max(gaps) > 4 * (1 / 40)                     # still bursty (Poisson), not evenly spaced
    with pytest.raises(ValueError, match="finite"):
        loadgen.segment_arrivals([5], math.inf, 0)


def test_errors_refusals_and_a_growing_backlog_are_misses():
    slo = SLO(0.5, 0.05)
    refused = Probe(10, [Outcome(False, None, None, i / 10) for i in range(10)] +
                    [Outcome(True, 0.1, 0.01, 1 + i / 10) for i in range(90)])
    assert refused.attainment(slo) == 0.9 and refused.passes(slo)
    assert not Probe(10, refused.outcomes[:-1] + [Outcome(False, None, None, 10.0)]).passes(slo)   # 89 %
    growing = Probe(10, [Outcome(True, 0.01 + 0.08 * i / 10, 0.01, i / 10) for i in range(50)])   # +8 % a second
    assert growing.attainment(slo) == 1.0 and growing.backlog_growth == pytest.approx(0.08)
    assert not growing.passes(slo)                      # it keeps up with the SLO only for now
    assert flat_probe(10).backlog_growth == pytest.approx(0.0) and flat_probe(10).passes(slo)


def test_slo_pairs_are_every_combination_loosest_first():
    assert [s.key for s in slo_pairs([1000, 500], [15, 25])] == ["1000/25", "500/25", "1000/15", "500/15"]


def knee_probe():
    """Probes of a server whose TPOT is 10 ms x rate / 20: the 15 ms pair's knee is at 30 req/s,
    the 25 ms pair's at 50 (a step function per pair: no noise)."""
    calls = []

    async def run(rate: float) -> Probe:
        calls.append(rate)
        return flat_probe(rate, tpot=0.010 * rate / 20)
    return run, calls


def test_the_search_brackets_then_bisects_to_the_tolerance():
    run, calls = knee_probe()
    result = asyncio.run(Search(run, step=2.0).find(LOOSE, start=4.0))
    lo, hi = result.bracket
    assert result.converged and lo <= 50 < hi and hi <= lo * 1.05
    assert 50 / 1.05 <= result.goodput <= 50
    assert calls[:4] == [4.0, 8.0, 32.0, 512.0]         # the factor squares while the knee is not bracketed
    assert len(calls) <= 10


def test_a_second_slo_pair_starts_from_the_probes_that_bracket_it():
    run, calls = knee_probe()
    search = Search(run, step=2.0)
    loose, tight = asyncio.run(search.find_all([LOOSE, TIGHT], {LOOSE.key: 40.0, TIGHT.key: 40.0}))
    assert 50 / 1.05 <= loose.goodput <= 50 and 30 / 1.05 <= tight.goodput <= 30
    assert tight.reused                                 # its first bracket end came from the loose search
    assert 40.0 not in tight.probed                     # nor was the cached prediction probed again
    fresh, fresh_calls = knee_probe()
    asyncio.run(Search(fresh, step=2.0).find(TIGHT, start=40.0))
    assert len(tight.probed) < len(fresh_calls)
    assert len(calls) == len(set(calls))                # no rate probed twice


def test_a_prediction_on_the_open_side_is_tried_before_stepping():
    run, calls = knee_probe()
    search = Search(run, step=1.25)
    search.probes[20.0] = flat_probe(20.0, tpot=0.01)   # passes both
    asyncio.run(search.find(LOOSE, start=48.0))
    assert calls[0] == 48.0


def test_the_search_stops_when_its_budget_is_spent_and_says_so():
    now = [0.0]

    async def run(rate: float) -> Probe:
        now[0] += 30.0
        return flat_probe(rate, tpot=0.010 * rate / 20)
    search = Search(run, step=2.0, duration_s=lambda r: 30.0, deadline=100.0, clock=lambda: now[0])
    result = asyncio.run(search.find(LOOSE, start=4.0))
    assert not result.converged and result.reason == "budget" and len(search.probes) == 3
    assert result.to_json()["bracket"] == [32.0, None]


def test_no_rate_passing_is_reported_as_none_below_the_minimum():
    async def run(rate: float) -> Probe:
        return flat_probe(rate, ok=False)
    result = asyncio.run(Search(run, step=2.0, min_rate=0.5).find(LOOSE, start=4.0))
    assert result.goodput is None and result.reason == "below_min_rate"


def test_bad_search_settings_are_refused_with_the_flag_to_fix():
    with pytest.raises(ValueError, match="--search-tolerance"):
        Search(knee_probe()[0], tolerance=0)
    with pytest.raises(ValueError, match="--search-step"):
        Search(knee_probe()[0], step=1.0)
    with pytest.raises(ValueError, match="--probe-lifetimes"):
        probe_plan([LOOSE], 8, lifetimes=0.5)


def test_a_search_step_or_rate_bound_that_is_not_a_finite_number_is_refused():
    """NaN passed `step <= 1` and an infinite --search-max-rate let a search double without end."""
    with pytest.raises(ValueError, match="--search-step"):
        Search(knee_probe()[0], step=math.nan)
    with pytest.raises(ValueError, match="--search-max-rate"):
        Search(knee_probe()[0], max_rate=math.inf)


# -- a server of known capacity --------------------------------------------------------------------
def simulated_credit_server(capacity: float, plan, seed: int):
    """The fake router's admission (tests/fake_router.py) fed the arrival times a real probe
    would send, in virtual time: accepted requests meet the SLOs, refused ones miss."""
    async def run(rate: float) -> Probe:
        server = CreditRouter(capacity, idle_reset_s=math.inf)      # a fresh server each probe
        warm, measured, cool = plan.sizes(rate)
        arrivals = loadgen.segment_arrivals([warm, measured, cool], rate, seed + int(rate * 1000))
        outcomes = []
        for i, t in enumerate(arrivals[:warm + measured]):
            ok = server._admit(t)
            if i >= warm:
                outcomes.append(Outcome(ok, 0.01 if ok else None, 0.002 if ok else None, t))
        return Probe(rate, outcomes)
    return run


@pytest.mark.parametrize("capacity,start", [(40.0, 10.0), (40.0, 90.0), (400.0, 380.0), (7.0, 1.0)])
def test_the_search_finds_the_knee_of_a_server_of_known_capacity_within_5_percent(capacity, start):
    """Its goodput is capacity / 0.9 exactly (above capacity it serves capacity / rate of the
    requests); probes of a few thousand requests, as on a GPU, resolve it to the tolerance."""
    knee = capacity / 0.9
    plan = probe_plan([LOOSE], 2, min_window_s=2000 / knee, min_requests=50, min_warmup_s=1.0)
    for seed in range(5):
        result = asyncio.run(Search(simulated_credit_server(capacity, plan, seed), step=1.25).find(LOOSE, start))
        assert result.converged, result
        assert abs(result.goodput / knee - 1) <= 0.05, (seed, result.goodput, knee)


def test_bench_serve_goodput_searches_a_running_router_over_grpc(tmp_path):
    """The whole path: `baton bench serve --addr ... --goodput` against the fake router over gRPC
    (a short probe, so the knee is only as sharp as ~200 requests resolve it)."""
    capacity = 150.0
    out = tmp_path / "goodput.json"
    with Served(CreditRouter(capacity)) as fake:
        bench_main(["serve", "--smoke", "--addr", fake.address, "--goodput", "--dataset", "random",
                    "--input-len", "4:8", "--output-len", "2:2", "--slo-ttft-ms", "200,300",
                    "--slo-tpot-ms", "100", "--probe-seconds", "1.2", "--probe-warmup-s", "0.3",
                    "--probe-min-requests", "20", "--probe-gap-s", "0.3", "--search-start", "200",
                    "--search-step", "1.25", "--devices", "cpu", "--output", str(out)])
        served = fake.servicer
    data = json.loads(out.read_text())
    g = data["results"]["goodput"]
    res = g["workloads"]["random"]["external"]
    knee = capacity / 0.9
    for key in ("300/100", "200/100"):
        s = res["searches"][key]
        assert s["converged"] and s["bracket"][1] <= s["bracket"][0] * 1.05
        assert 0.8 * knee <= s["goodput_req_s"] <= 1.2 * knee, s
        assert s["goodput_per_device"] == s["goodput_req_s"]          # --devices cpu: one device
    assert res["searches"]["200/100"]["rates_reused"]                 # the second pair probed little or nothing
    above = [p for p in res["probes"] if p["rate"] > 1.1 * knee]
    assert above and all(p["summary"]["errors"].get("RESOURCE_EXHAUSTED") for p in above)   # refusals are misses
    for p in res["probes"]:
        z = p["sizes"]
        assert z["measured"] == len(p["requests"]) >= 20 and z["warmup"] >= 1 and z["cooldown"] >= 1
        assert z["window_over_longest"] > 3
    assert served.refused > 0 and served.accepted > 0
    assert g["recommendation"]["random"][0]["best"] == "external"
    assert data["results"]["plots"] and all(p.endswith(".png") for p in data["results"]["plots"])



@pytest.mark.parametrize("processes", [1, 2])
def test_the_cool_down_is_cut_once_the_measured_requests_have_ended(processes):
    """Arrivals planned over 30 s end after about 1 s: the first 40 requests done, the rest cut
    (never sent, or cancelled in flight), in one client process or shared by two."""
    reqs = [loadgen.ServeRequest(2, [1, 2, 3]) for _ in range(400)]
    arrivals = [i / 13.3 for i in range(400)]             # 30 s of arrivals at 13 req/s
    with Served(CreditRouter(1000.0, tpot_s=0.01)) as fake:
        results, wall = asyncio.run(loadgen.run_rate(fake.address, reqs, 13.3, 0, None, {}, 5.0, None, processes,
                                                     arrivals, until_done=range(40)))
    assert [r.index for r in results] == list(range(400))
    assert all(r.ok for r in results[:40])
    assert sum(r.status == loadgen.CUT for r in results) >= 350 and wall < 15


def test_a_launched_deployment_gets_a_router_per_accelerator():
    """One router process carries ~280 short requests a second: a launched deployment gets one per
    accelerator, so a run measures the devices, not its router; on the CPU one is plenty."""
    from baton.benchmarks.serve import default_routers
    assert default_routers(["cpu", "cpu"]) == 1 and default_routers(["cuda:0"]) == 1
    assert default_routers([f"cuda:{i}" for i in range(4)]) == 4 and default_routers(["cuda:0", "cuda:0"]) == 1


@pytest.mark.parametrize("mode", [["serve", "--no-plots"], ["serve", "--goodput", "--no-plots"],
                                  ["multiturn", "--smoke"]])
def test_a_benchmark_says_when_no_router_answers_at_addr(tmp_path, capsys, mode):
    """A user who forgot to start the deployment gets one line naming the address and a failing exit,
    not a traceback, nor a result file of refused requests."""
    from baton.serving.processes import free_port
    addr = f"127.0.0.1:{free_port()}"
    with pytest.raises(SystemExit) as exc:
        bench_main([*mode, "--addr", addr, "--output", str(tmp_path / "x.json")])
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert f"no router answers at {addr}" in err and "Traceback" not in err


@pytest.mark.parametrize("processes", [1, 2])
def test_a_long_run_reports_its_progress_however_many_client_processes_send_it(processes, capsys, monkeypatch):
    """A GPU host sends a rate's requests from several client processes: the run still says how far
    it has got while it runs (one process did; several were silent for the whole rate)."""
    monkeypatch.setattr(loadgen, "PROGRESS_EVERY_S", 0.5)
    reqs = [loadgen.ServeRequest(2, [1, 2, 3]) for _ in range(40)]
    arrivals = [i / 20 for i in range(40)]                # 2 s of arrivals
    with Served(CreditRouter(1000.0, tpot_s=0.01)) as fake:
        results, _ = asyncio.run(loadgen.run_rate(fake.address, reqs, 20.0, 0, None, {}, 5.0, None, processes,
                                                  arrivals))
    assert all(r.ok for r in results)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "requests done after" in ln]
    assert lines and all("/40 requests" in ln and ln.startswith("[bench] rate 20:") for ln in lines), lines


@pytest.mark.parametrize("mode", [[], ["--goodput"]])
def test_bench_serve_says_when_no_openai_api_answers_at_http_url(tmp_path, capsys, mode):
    """--api openai against a router whose HTTP API is off (or elsewhere): one line naming the URL."""
    from baton.serving.processes import free_port
    url = f"http://127.0.0.1:{free_port()}/v1"
    with Served(CreditRouter(100.0)) as fake, pytest.raises(SystemExit) as exc:
        bench_main(["serve", "--smoke", "--addr", fake.address, "--api", "openai", "--http-url", url, *mode,
                    "--no-plots", "--output", str(tmp_path / "x.json")])
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert f"no OpenAI API answers at {url}" in err and "Traceback" not in err
