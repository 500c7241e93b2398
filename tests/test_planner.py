"""The planner: a step-cost line fitted to a device profile, a simulation of each topology
checked against queueing theory, the closed-form model checked against the simulation, and
`baton plan` end to end on the CPU (a tiny random-weight model: the embedded one takes ~30 s)."""
from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from cluster import REPO

from baton.benchmarks import datasets, deployment, device_profile, planner, queueing
from baton.benchmarks.cluster_sim import Hardware, Req, Simulation
from baton.benchmarks.goodput import SLO
from baton.benchmarks.schedule_sim import simulate_steps
from baton.benchmarks.step_cost import FEATURES, StepCost, features
from baton.launcher import build_parser as serve_parser
from baton.launcher import set_topology

# an 8B model on an H100, roughly: 7 ms decode steps, 40 us a prompt token, KV for 400k tokens
H100ISH = Hardware(StepCost((0.010, 0.007, 40e-6, 2e-6, 2e-9, 2.5e-8)), budget=4096, max_num_seqs=256,
                   kv_capacity=400_000, weight_bytes=16_000_000_000, kv_bytes_per_token=147_456)


def test_the_step_cost_fit_recovers_the_coefficients_that_made_the_steps():
    truth = StepCost((0.02, 0.008, 3e-5, 1e-5, 4e-9, 6e-8))
    rng = random.Random(0)
    rows = []
    for _ in range(24):
        prompts = [[1] * rng.randint(8, 900) for _ in range(rng.randint(1, 6))]
        steps = simulate_steps(prompts, [rng.randint(1, 40) for _ in prompts], max_num_batched_tokens=512)
        feats = [sum(col) for col in zip(*(features(s) for s in steps), strict=True)]
        rows.append((feats, sum(truth.seconds(s) for s in steps)))
    fitted = StepCost.fit(rows)
    assert max(fitted.relative_errors(rows)) < 1e-6
    assert fitted.coef == pytest.approx(truth.coef, rel=1e-3)
    assert len(FEATURES) == len(fitted.coef)


def test_a_fit_keeps_every_coefficient_non_negative():
    rows = [([1, 0, n, 1, 0, 0], 0.01 + 1e-4 * n) for n in (10, 100, 1000)] + \
           [([0, 1, b, b, 0, 50 * b], 0.005 - 1e-9 * b) for b in (1, 8, 64)]         # decode slightly faster with b
    assert all(c >= 0 for c in StepCost.fit(rows).coef)
    with pytest.raises(ValueError, match="at least"):
        StepCost.fit(rows[:3])


def test_the_simulation_queues_prompts_as_an_md1_queue():
    """One worker, prompts that each take one step of fixed length and end after the first
    token: an M/D/1 queue, whose mean wait is rho S / (2 (1 - rho)) (Pollaczek-Khinchine)."""
    service = 0.010
    hw = Hardware(StepCost((service, 0.0, 0.0, 0.0, 0.0, 0.0)), budget=64, max_num_seqs=1, kv_capacity=10**9,
                  weight_bytes=1, kv_bytes_per_token=1)
    rate, n = 70.0, 40_000
    rng = random.Random(1)
    t, reqs = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        reqs.append(Req(t, 64, 1))
    Simulation(deployment.parse("1colocated"), hw).run(reqs, until=float("inf"))
    waits = [r.first - r.arrival - service for r in reqs[n // 10:]]
    rho = rate * service
    assert sum(waits) / len(waits) == pytest.approx(rho * service / (2 * (1 - rho)), rel=0.08)


def test_the_routers_queue_requests_as_an_md1_queue_in_front_of_the_workers():
    """Workers that take no time behind one router of fixed cost: every request's TTFT is its wait
    for the router plus the router's cost, an M/D/1 queue again; two routers halve the load."""
    cost = 0.004
    hw = Hardware(StepCost((0.0,) * 6), budget=64, max_num_seqs=10**6, kv_capacity=10**9, weight_bytes=1,
                  kv_bytes_per_token=1, router_s=cost)
    rate, n = 200.0, 40_000
    assert hw.router_rate == 250 and dataclasses.replace(hw, routers=2).router_rate == 500
    rng = random.Random(3)
    t, arrivals = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        arrivals.append(t)
    for routers in (1, 2):
        reqs = [Req(a, 1, 1) for a in arrivals]
        Simulation(deployment.parse("4colocated"), dataclasses.replace(hw, routers=routers)).run(reqs, float("inf"))
        waits = [r.first - r.arrival - cost for r in reqs[n // 10:]]
        rho = rate * cost
        mean = sum(waits) / len(waits)
        if routers == 1:
            assert mean == pytest.approx(rho * cost / (2 * (1 - rho)), rel=0.08)
        else:                             # M/D/2 at half the load each: far shorter than one router's
            assert mean < 0.15 * rho * cost / (2 * (1 - rho))


def test_the_simulated_decode_batch_obeys_littles_law():
    """Pure decode: the step time the simulation settles at is the fixed point of the queueing
    model, tau = intercept / (1 - rate x steps x per-row cost)."""
    hw = Hardware(StepCost((0.0, 0.005, 1e-4, 0.0, 0.0, 0.0)), budget=4096, max_num_seqs=512, kv_capacity=10**9,
                  weight_bytes=1, kv_bytes_per_token=1, kv_latency=0.0, kv_bandwidth=1e30)
    rate, out = 40.0, 101
    rng = random.Random(2)
    t, reqs = 0.0, []
    for _ in range(4000):
        t += rng.expovariate(rate)
        reqs.append(Req(t, 1, out))
    Simulation(deployment.parse("1p1d"), hw).run(reqs, until=float("inf"))
    tpots = [(r.finish - r.first) / (out - 1) for r in reqs[1000:]]
    tau = 0.005 / (1 - rate * (out - 1) * 1e-4)
    assert sum(tpots) / len(tpots) == pytest.approx(tau, rel=0.05)


CASES = [(H100ISH, SLO(1.0, 0.025), "prefill-heavy", ((1024, 2048), (8, 32)), ["3p1d", "2p2d", "4colocated", "1p2d-ptp2"]),
         (H100ISH, SLO(1.0, 0.025), "mixed", ((32, 4096), (8, 256)), ["2p2d", "3p1d", "2colocated-tp2", "4colocated"]),
         (H100ISH, SLO(1.0, 0.015), "mixed", ((32, 4096), (8, 256)), ["3p1d", "2colocated-tp2", "4colocated"]),
         (H100ISH, SLO(1.0, 0.025), "decode-heavy", ((32, 128), (32, 96)), ["1p3d", "2p2d", "4colocated"]),
         # a prefill worker's per-request hand-off, as measured on H200s: 1P3D's one prefill worker is its limit
         (dataclasses.replace(H100ISH, handoff_s=0.0045), SLO(1.0, 0.015), "decode-heavy", ((32, 128), (64, 192)),
          ["1p3d", "2p2d"]),
         # one router as measured on an H200 host (~280 short requests a second): it, not the devices, holds these
         (dataclasses.replace(H100ISH, router_s=0.0035), SLO(1.0, 0.025), "decode-heavy", ((32, 128), (64, 192)),
          ["4colocated", "2p2d"])]


@pytest.mark.parametrize("hw,slo,dataset,lengths,topologies", CASES)
def test_the_queueing_model_predicts_what_the_simulation_measures(hw, slo, dataset, lengths, topologies):
    """Per topology the closed form lands within 25 % of the simulated search, and the split it
    ranks first reaches >= 90 % of the simulation's best. (On a CPU's profile, where a prompt step
    is ten decode steps, attainment falls so slowly with the rate that both are rougher.)"""
    job = {"cost": hw.cost.to_json(), "hardware": planner._hardware_json(hw), "seed": 0,
           "slos": [(slo.ttft_s, slo.tpot_s)], "max_model_len": 40960, "lifetimes": 3.0, "probe_seconds": 10.0,
           "min_requests": 50, "tolerance": 0.05, "dataset": dataset, "lengths": lengths}
    sim, model = {}, {}
    for name in topologies:
        r = planner.predict_workload(job | {"topology": name})["by_slo"][slo.key]
        sim[name], model[name] = r["goodput"], r["queueing"]
        assert r["converged"]
        assert model[name] == pytest.approx(sim[name], rel=0.25), (name, model[name], sim[name])
    assert sim[max(model, key=model.get)] >= 0.9 * max(sim.values())
    if hw.handoff_s:                      # requests, not tokens, cap the prefill workers
        assert model["1p3d"] < 1 / hw.handoff_s and sim["1p3d"] < 1 / hw.handoff_s
    if hw.router_s:                       # nothing passes the router; 4 colocated's devices could: it holds them
        # (a probe as short as the harness's may pass a few % over: its backlog grows slower than the tolerance)
        assert all(g <= 1.05 * hw.router_rate for g in (*sim.values(), *model.values())), (sim, model)
        assert sim["4colocated"] >= 0.9 * hw.router_rate and model["4colocated"] >= 0.9 * hw.router_rate


def test_the_plan_ranks_topologies_and_names_the_pick_per_workload_and_slo(tmp_path):
    args = planner.resolve(_plan_args(["--devices", "4", "--dataset", "prefill-heavy,decode-heavy",
                                       "--slo-tpot-ms", "25,15"]))
    assert set(deployment.FOUR_DEVICES) <= set(args.candidates)
    done = [{"dataset": ds, "topology": t, "by_slo": {s.key: {"goodput": g, "converged": True, "queueing": g,
                                                              "probes": 3} for s in args.slos}}
            for ds, gs in (("prefill-heavy", {"3p1d": 40.0, "4colocated": 20.0}),
                           ("decode-heavy", {"1p3d": 90.0, "4colocated": 100.0})) for t, g in gs.items()]
    tables = planner._tables(done, args)
    row = tables["prefill-heavy"]["slos"]["1000/25"]
    assert row["best"] == "3p1d" and row["best_over_baseline"] == 2.0 and row["topologies"]["3p1d"]["per_device"] == 10
    assert tables["decode-heavy"]["slos"]["1000/15"]["best"] == "4colocated"
    plan = {"workloads": tables}
    assert planner.picks(plan, ["prefill-heavy", "decode-heavy"], args.slos) == ["3p1d", "4colocated"]
    with pytest.raises(ValueError, match="baton plan"):
        planner.picks(plan, ["mixed"], args.slos)


def test_a_goodput_the_routers_hold_is_marked_and_the_report_says_how_to_lift_it():
    """--router-ms 10: one router takes 100 requests a second; a topology predicted at 95 is the
    router's figure, one at 40 the devices'. The false positive: without a router cost, nothing is."""
    for argv, marked in ((["--router-ms", "10"], {"4colocated"}), (["--router-ms", "0"], set())):
        args = planner.resolve(_plan_args(["--devices", "4", "--dataset", "decode-heavy", "--slo-tpot-ms", "25",
                                           *argv]))
        done = [{"dataset": "decode-heavy", "topology": t, "by_slo": {"1000/25": {"goodput": g, "converged": True,
                                                                                   "queueing": g, "probes": 3}}}
                for t, g in (("4colocated", 95.0), ("3p1d", 40.0))]
        tables = planner._tables(done, args)
        topos = tables["decode-heavy"]["slos"]["1000/25"]["topologies"]
        assert {t for t, r in topos.items() if r["router_bound"]} == marked
        plan = {"on_cpu": False, "devices": 4, "device_name": "H200", "device": "cuda:0", "workloads": tables,
                "profile_path": None, "seconds": {"profile": 1, "profile_cached": False, "profile_this_run": 1,
                                                  "predict": 1}}
        text = "\n".join(planner.report(plan))
        assert ("held by the routers" in text and "--routers 2" in text) == bool(marked), text
    with pytest.raises(ValueError, match="--routers"):
        planner.resolve(_plan_args(["--routers", "0"]))


def test_bad_plan_flags_name_what_to_fix():
    with pytest.raises(ValueError, match="unknown dataset"):
        planner.resolve(_plan_args(["--dataset", "chatty"]))
    with pytest.raises(ValueError, match="--tp-sizes"):
        planner.resolve(_plan_args(["--tp-sizes", "two"]))
    with pytest.raises(ValueError, match="needs 4 devices"):
        planner.resolve(_plan_args(["--devices", "2", "--topologies", "2p2d"]))


def test_a_cached_profile_is_used_only_for_its_model_device_kind_and_engine_settings():
    prof = device_profile.Profile("qwen3-8b", "cuda:0", {"max_num_seqs": 256, "max_num_batched_tokens": 4096}, {},
                                  1, 1)
    assert prof.matches("qwen3-8b", "cuda:3", {"max_num_seqs": 256})
    assert not prof.matches("qwen3-8b", "cpu", {})
    assert not prof.matches("qwen3-0.6b", "cuda:0", {})
    assert not prof.matches("qwen3-8b", "cuda:0", {"max_num_batched_tokens": 8192})
    with pytest.raises(ValueError, match="baton plan --profile"):
        device_profile.Profile.from_json({"schema": "other"})


def test_baton_serve_planner_sets_the_split_it_picked():
    args = serve_parser().parse_args(["--planner"])
    set_topology(args, "1p3d", ["cuda:0", "cuda:1", "cuda:2", "cuda:3"])
    assert (args.prefill_instances, args.decode_instances) == (1, 3) and not args.colocated
    assert (args.prefill_devices, args.decode_devices) == ("cuda:0", "cuda:1,cuda:2,cuda:3")
    set_topology(args, "2colocated", ["cpu", "cpu"])
    assert args.colocated and args.instances == 2


def test_baton_plan_runs_on_the_cpu_and_reads_its_profile_back(tmp_path):
    """Profile a tiny random-weight model on the CPU, predict, recommend; the second run reads
    the cached profile instead of measuring again."""
    profile, out = tmp_path / "profile.json", tmp_path / "plan.json"
    cmd = [sys.executable, "-m", "baton", "plan", "--model", "tiny-qwen3", "--devices", "2", "--device", "cpu",
           "--dataset", "mixed", "--input-len", "16:128", "--output-len", "4:24", "--slo-ttft-ms", "2000",
           "--slo-tpot-ms", "200,100", "--profile", str(profile), "--output", str(out), "--jobs", "1"]
    env = {"OMP_NUM_THREADS": "1"}
    first = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240, env=_env(env))
    assert first.returncode == 0, first.stderr[-3000:]
    plan = json.loads(out.read_text())
    assert plan["on_cpu"] and "profiled on the CPU" in first.stdout and "recommended:" in first.stdout
    assert set(plan["candidates"]) == {"2colocated", "1colocated-tp2", "1p1d"}
    for key in ("2000/200", "2000/100"):
        row = plan["workloads"]["mixed"]["slos"][key]
        assert row["best"] in plan["candidates"] and row["goodput"] > 0
        assert all(t["queueing"] is not None for t in row["topologies"].values())
    assert plan["profile"]["cost"]["decode_step"] > 0 and len(plan["profile"]["rows"]) >= 6
    assert not plan["seconds"]["profile_cached"]
    second = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240, env=_env(env))
    assert second.returncode == 0, second.stderr[-3000:]
    assert json.loads(out.read_text())["seconds"]["profile_cached"]
    bad = subprocess.run([*cmd[:4], "--dataset", "nope"], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env=_env(env))
    assert bad.returncode == 2 and "unknown dataset" in bad.stderr


def _env(extra: dict) -> dict:
    import os
    return dict(os.environ, **extra)


def _plan_args(argv: list[str]):
    import argparse
    p = argparse.ArgumentParser()
    planner.add_arguments(p)
    return p.parse_args(["--device", "cpu", *argv])


def test_the_workload_summary_weights_context_by_the_steps_spent_there():
    w = queueing.Workload(((100, 1), (10, 21)))
    assert w.mean_decode_steps == 10 and w.decode_context == pytest.approx(10 + 21 / 2)
    assert w.mean_prompt == 55
    assert datasets.sample_lengths("random", 3, 0, (5, 5), (2, 2), 64) == [(5, 2)] * 3


def test_bench_serve_auto_measures_the_planners_picks_beside_the_colocated_baseline(tmp_path):
    import argparse

    from baton.benchmarks.serve import _auto_topologies
    args = planner.resolve(_plan_args(["--devices", "4", "--dataset", "prefill-heavy,mixed", "--slo-tpot-ms", "25,15"]))
    done = [{"dataset": ds, "topology": t, "by_slo": {s.key: {"goodput": g * (1 if s.tpot_s > 0.02 else 0.5),
                                                              "converged": True, "queueing": g, "probes": 3}
                                                      for s in args.slos}}
            for ds, gs in (("prefill-heavy", {"3p1d": 40.0, "4colocated": 20.0}),
                           ("mixed", {"2p2d": 30.0, "3p1d": 29.0, "4colocated": 25.0})) for t, g in gs.items()]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"workloads": planner._tables(done, args)}))
    bench = argparse.Namespace(plan=str(path), datasets=args.datasets, slos=args.slos, topologies=["1p3d"],
                               device_pool=["cuda:0", "cuda:1", "cuda:2", "cuda:3"])
    assert _auto_topologies(bench, tmp_path / "out.json") == ["4colocated", "3p1d", "2p2d", "1p3d"]


@pytest.mark.parametrize("argv,match", [
    (["--devices", "0"], "--devices must be >= 1"),
    (["--kv-bandwidth-gbs", "0"], "--kv-bandwidth-gbs"),
    (["--kv-latency-ms", "-1"], "--kv-latency-ms"),
    (["--jobs", "0"], "--jobs"),
    (["--devices", "2", "--tp-sizes", "3"], "no topology of 2 devices"),
    (["--search-tolerance", "5"], "--search-tolerance"),
    (["--probe-seconds", "0"], "--probe-seconds"),
])
def test_bad_plan_values_are_refused_before_the_device_is_profiled(argv, match):
    """Not a traceback, nor a profile's minutes spent on a plan that cannot be made, nor a 0 read as unset."""
    with pytest.raises(ValueError, match=match):
        planner.resolve(_plan_args(argv))


def test_the_workers_kv_blocks_bound_the_simulated_kv_not_the_profiled_engines():
    """`--worker-args '--num-kv-blocks N'` (what bench serve --smoke gives its workers, and what
    `--topologies auto` passes on): the simulated workers hold N blocks, not what the profiling
    engine happened to allocate; the plan's assumptions say so."""
    prof = device_profile.Profile("smollm2-135m-instruct", "cpu", {
        "max_num_seqs": 16, "max_num_batched_tokens": 4096, "block_size": 16, "kv_blocks": 729,
        "kv_capacity_tokens": 729 * 16, "max_model_len": 2048}, {}, 46080, 1)
    prof.cost = StepCost((0.0,) * 6)
    assert planner.hardware(prof, planner.resolve(_plan_args([]))).kv_capacity == 729 * 16
    for argv in (["--worker-args", "--num-kv-blocks 128 --max-num-seqs 16"], ["--worker-args=--num-kv-blocks=128"]):
        assert planner.hardware(prof, planner.resolve(_plan_args(argv))).kv_capacity == 128 * 16


def test_baton_serve_planner_plans_with_the_workers_kv_blocks(monkeypatch, tmp_path):
    """`baton serve --planner --num-kv-blocks N`: the plan's simulated workers hold the N blocks the
    workers will have, and the split it picks is the one set."""
    import subprocess as sp

    from baton.launcher import apply_plan
    seen = {}

    def fake_run(cmd, **kw):
        seen["cmd"] = cmd
        out = cmd[cmd.index("--output") + 1]
        plan = {"workloads": {"random": {"slos": {"1000/50": {"best": "1p1d", "goodput": 2.0}}}}}
        Path(out).write_text(json.dumps(plan))
        return sp.CompletedProcess(cmd, 0)

    monkeypatch.setattr(sp, "run", fake_run)
    args = serve_parser().parse_args(["--planner", "--num-kv-blocks", "64", "--planner-devices", "cpu,cpu",
                                      "--planner-profile", str(tmp_path / "p.json")])
    assert apply_plan(args) == 0 and (args.prefill_instances, args.decode_instances) == (1, 1)
    cmd = seen["cmd"]
    assert planner.worker_flag(cmd[cmd.index("--worker-args") + 1], "--num-kv-blocks") == "64"


def test_auto_says_no_split_meets_the_targets_rather_than_that_the_plan_lacks_them():
    slo = SLO(1.0, 0.05)
    met_by_none = {"workloads": {"random": {"slos": {slo.key: {"best": None, "topologies": {}}}}}}
    with pytest.raises(ValueError, match="no split meets TTFT <= 1000 ms, TPOT <= 50 ms for random"):
        planner.picks(met_by_none, ["random"], [slo])
    with pytest.raises(ValueError, match="covers none of these workloads"):
        planner.picks(met_by_none, ["mixed"], [slo])


def test_a_cpu_profile_runs_on_the_threads_each_planned_worker_will_have(monkeypatch):
    """`bench serve` and `baton serve` give each of N CPU workers cores // N threads: the profile is
    timed on as many (it took every core, and predicted N workers each as fast as the whole CPU)."""
    import os

    import torch
    seen = []

    def fake_measure(*a, **kw):
        seen.append(torch.get_num_threads())
        raise ValueError("stop here")

    monkeypatch.setattr(device_profile, "load_or_measure", fake_measure)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    for devices, threads in (("2", 2), ("4", 1)):
        with pytest.raises(ValueError, match="stop here"):
            planner.make_plan(planner.resolve(_plan_args(["--devices", devices])))
        assert seen[-1] == threads and torch.get_num_threads() == before


def test_the_report_says_a_shared_prefix_is_computed_in_full():
    """The simulation has no prefix cache: a shared-prefix plan prices every prompt's whole prefix,
    which served workers find cached. The report says so under that workload, and only there."""
    row = {"slo": {"ttft_ms": 1000, "tpot_ms": 50}, "topologies": {}, "best": None, "baseline": None,
           "best_over_baseline": None}
    plan = {"on_cpu": False, "devices": 2, "device_name": "H200", "device": "cuda:0", "profile_path": None,
            "seconds": {"profile": 1, "profile_cached": False, "profile_this_run": 1, "predict": 1},
            "workloads": {"shared-prefix": {"slos": {"1000/50": row}}, "random": {"slos": {"1000/50": row}}}}
    notes = [ln for ln in planner.report(plan) if "prefix cache" in ln]
    assert len(notes) == 1 and "pessimistic" in notes[0]
