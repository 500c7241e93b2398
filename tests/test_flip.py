"""`baton bench flip` (benchmarks/flip.py): a schedule whose mix flips, run once per held split and
once with `baton elastic` switching roles; judged per request against one SLO pair. The rules on
hand-made cases, then the whole benchmark on the CPU (two workers on the embedded model)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from cluster import REPO

from baton.benchmarks.flip import Phase, judge, parse_phases
from baton.benchmarks.goodput import SLO
from baton.benchmarks.loadgen import RequestResult

SLO_1S_50MS = SLO(1.0, 0.05)


def test_phases_parse_and_bad_ones_say_how_to_write_them():
    assert parse_phases("prefill-heavy:60:90, decode-heavy:380:90") == [
        Phase("prefill-heavy", 60.0, 90.0), Phase("decode-heavy", 380.0, 90.0)]
    assert Phase("decode-heavy", 2.5, 3).count == 8
    for bad, says in (("prefill-heavy:60:90", "at least two"), ("prefill-heavy:60,decode-heavy:1:1", "DATASET:RATE"),
                      ("prefill-heavy:0:9,decode-heavy:1:1", "rate > 0"), ("nope:1:1,decode-heavy:1:1", "unknown dataset"),
                      ("prefill-heavy:inf:9,decode-heavy:1:1", "finite")):
        with pytest.raises(ValueError, match=says):
            parse_phases(bad)


def test_a_runs_goodput_is_what_met_the_slo_per_second_of_the_schedule():
    phases = [Phase("prefill-heavy", 2, 2), Phase("decode-heavy", 2, 2)]
    def done(t, ttft, out=11, e2e=None, status="OK"):
        if e2e is None and ttft is not None:
            e2e = ttft + 0.01 * (out - 1)
        return RequestResult(0, t, status, ttft=ttft, e2e=e2e, output_tokens=out)
    results = [done(0.1, 0.2), done(0.6, 1.5), done(1.2, 0.3), done(1.7, 0.3, e2e=5.0),    # late; slow tokens
               done(2.1, 0.1), done(2.6, None, status="DEADLINE_EXCEEDED"), done(3.1, 0.2), done(3.6, 0.2)]
    out = judge(results, [0, 0, 0, 0, 1, 1, 1, 1], phases, SLO_1S_50MS, bin_s=2.0)
    assert out["met"] == 5 and out["goodput"] == 5 / 4 and out["attainment"] == 5 / 8
    assert [p["attainment"] for p in out["phases"]] == [0.5, 0.75]
    assert [(b["t"], b["attainment"]) for b in out["bins"]] == [(0.0, 0.5), (2.0, 0.75)]
    assert out["errors"] == {"DEADLINE_EXCEEDED": 1}


def test_the_flip_smoke_holds_a_split_and_lets_baton_elastic_switch_roles(tmp_path):
    """Two CPU workers start as 1P1D; the smoke plan wants two colocated replicas for long outputs:
    the elastic run switches both workers while its decode-heavy phase runs, the static run first
    switches them back to 1P1D and holds it. Every request is served."""
    out = tmp_path / "flip.json"
    run = subprocess.run([sys.executable, "-m", "baton", "bench", "flip", "--smoke", "--no-plots", "--output", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())["results"]
    elastic, static = res["runs"]["elastic"], res["runs"]["1p1d"]
    assert {(s["from"], s["to"]) for s in elastic["switches"]} == {("decode", "colocated"), ("prefill", "colocated")}
    first_decode_heavy = min(r["sent_at"] for r in elastic["requests_detail"] if r["phase"] == 1)
    assert all(s["t_end"] > first_decode_heavy for s in elastic["switches"])      # moved by the new mix
    assert elastic["end_roles"] == {"prefill": 0, "decode": 0, "colocated": 2}
    assert static["end_roles"] == {"prefill": 1, "decode": 1, "colocated": 0} and "switches" not in static
    assert [s["to"] for s in static["set_by"]] == ["decode", "prefill"]      # back to 1P1D before its run
    for r in (elastic, static):
        assert r["errors"] == {} and r["requests"] == 32 and r["met"] == 32
    assert res["elastic_over_best_static"]["best_static"] == "1p1d"


def test_every_router_of_the_deployment_is_handed_to_baton_elastic(monkeypatch, tmp_path):
    """--routers defaults as `bench serve`'s (one per accelerator) and reaches the launch; `baton
    elastic` gets each router's own metrics, whose counters it sums."""
    import argparse
    from pathlib import Path

    from baton.benchmarks import deployment, flip
    p = argparse.ArgumentParser()
    flip.add_arguments(p)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(["--devices", "cuda:0,cuda:1,cuda:2,cuda:3", "--plan", __file__])
    flip.resolve(args)
    assert args.routers == 4
    smoke = p.parse_args(["--smoke"])
    flip.resolve(smoke)
    assert smoke.routers == 1
    with pytest.raises(ValueError, match="--routers must be >= 1"):
        flip.resolve(p.parse_args(["--smoke", "--routers", "0"]))
    launched = {}

    def launch(*a, **kw):
        launched.update(kw)
        raise RuntimeError("launched")
    monkeypatch.setattr(deployment, "launch", launch)
    two = p.parse_args(["--smoke", "--routers", "2", "--log-dir", str(tmp_path)])
    two.output = str(tmp_path / "flip.json")
    flip.resolve(two)
    with pytest.raises(RuntimeError, match="launched"):
        flip.run(two, {})
    assert launched["routers"] == 2
    dep = deployment.Deployment("2p2d", "127.0.0.1:5", [], http_url="http://127.0.0.1:8/v1",
                                router_metrics=["http://127.0.0.1:9/metrics", "http://127.0.0.1:10/metrics"])
    cmd = flip.elastic_command(args, Path("plan.json"), dep, "T")
    assert cmd[cmd.index("--metrics-url") + 1] == "http://127.0.0.1:9/metrics,http://127.0.0.1:10/metrics"
    assert cmd[cmd.index("--addr") + 1] == "127.0.0.1:5"


@pytest.mark.parametrize("argv,says", [
    (["--bin-s", "0"], "--bin-s must be > 0"),
    (["--runs", "elastic,9p9d"], "9p9d has 18 workers, 1p1d 2"),
])
def test_bad_flip_flags_are_refused_before_the_deployment_starts(argv, says):
    """Not a traceback once the whole schedule has run, and the split at fault named."""
    import argparse

    from baton.benchmarks import flip
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true")
    flip.add_arguments(p)
    with pytest.raises(ValueError, match=says):
        flip.resolve(p.parse_args(["--smoke", *argv]))
