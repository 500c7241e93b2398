"""B2's topologies: any XpYd split or N colocated replicas of a host's devices, tensor-parallel
workers among them, and the recommended split per SLO pair, computed from the sweep's own numbers."""
from __future__ import annotations

import pytest

from baton.benchmarks import datasets, deployment
from baton.benchmarks.serve import parse_lengths, parse_slos, recommend


@pytest.mark.parametrize("name,roles", [
    ("1p1d", ["prefill", "decode"]),
    ("1p3d", ["prefill", "decode", "decode", "decode"]),
    ("3p1d", ["prefill", "prefill", "prefill", "decode"]),
    ("4colocated", ["colocated"] * 4),
    ("1p2d-ptp2", ["prefill", "decode", "decode"]),
    ("2colocated-tp2", ["colocated"] * 2),
])
def test_a_topology_names_its_workers(name, roles):
    assert deployment.roles(name) == roles


@pytest.mark.parametrize("bad", ["0p1d", "1p0d", "2p", "colocated", "1p1d2", "0colocated", "p1d", "1p1d-tp2",
                                 "2colocated-ptp2", "1p1d-ptp0", "1p1d-dtp2-ptp2"])
def test_a_malformed_topology_is_refused_with_the_grammar(bad):
    with pytest.raises(ValueError, match="XpYd|at least one|>= 1"):
        deployment.roles(bad)


def test_devices_are_handed_out_prefill_first_from_one_pool():
    pool = ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert deployment.plan("1p3d", pool) == [("prefill", ["cuda:0"]), ("decode", ["cuda:1"]),
                                             ("decode", ["cuda:2"]), ("decode", ["cuda:3"])]
    assert deployment.plan("3p1d", pool)[-1] == ("decode", ["cuda:3"])
    assert deployment.plan("2p2d", ["cpu"]) == [("prefill", ["cpu"]), ("prefill", ["cpu"]), ("decode", ["cpu"]),
                                                ("decode", ["cpu"])]


def test_a_tensor_parallel_worker_takes_its_devices_in_a_row_and_gets_the_tp_flags():
    pool = ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert deployment.plan("1p2d-ptp2", pool) == [("prefill", ["cuda:0", "cuda:1"]), ("decode", ["cuda:2"]),
                                                  ("decode", ["cuda:3"])]
    assert deployment.plan("2colocated-tp2", pool) == [("colocated", ["cuda:0", "cuda:1"]),
                                                       ("colocated", ["cuda:2", "cuda:3"])]
    assert deployment.tp_flags(["cuda:2", "cuda:3"]) == ["--tp-size", "2", "--tp-devices", "cuda:2,cuda:3"]
    assert deployment.tp_flags(["cuda:0"]) == []
    assert all(deployment.parse(t).num_devices == 4 for t in deployment.FOUR_DEVICES)


def test_the_candidates_are_every_topology_of_exactly_the_devices_given():
    four = deployment.candidates(4)
    assert set(deployment.FOUR_DEVICES) <= set(four) and len(four) == len(set(four))
    assert all(deployment.parse(t).num_devices == 4 for t in four)
    assert four[:2] == ["2colocated-tp2", "4colocated"]                # the colocated baselines first
    assert deployment.candidates(2, (1,)) == ["2colocated", "1p1d"]
    assert deployment.candidates(1) == ["1colocated"]


def test_the_mixed_workload_is_long_tailed_and_clipped_to_its_ranges():
    lengths = datasets.sample_lengths("mixed", 4000, 0, (32, 4096), (8, 384), max_model_len=40960)
    prompts = sorted(p for p, _ in lengths)
    outputs = sorted(o for _, o in lengths)
    assert 32 <= prompts[0] and prompts[-1] <= 4096 and 8 <= outputs[0] and outputs[-1] <= 384
    assert 400 <= prompts[2000] <= 650 and prompts[3960] >= 5 * prompts[2000]    # median ~512, p99 >= 5x it
    assert 80 <= outputs[2000] <= 115 and sum(outputs) / len(outputs) > outputs[2000]   # mean above the median
    reqs = datasets.build_requests("mixed", 50, 0, (32, 4096), (8, 384), 40960, 49152)
    assert all(32 <= len(r.prompt_ids) <= 4096 and 8 <= r.max_tokens <= 384 for r in reqs)


def test_lengths_are_given_for_every_dataset_or_by_name():
    assert parse_lengths("128:1024", "mixed", "--input-len") == (128, 1024)
    assert parse_lengths("mixed=8:256,decode-heavy=128:384", "decode-heavy", "--output-len") == (128, 384)
    assert parse_lengths("mixed=8:256", "prefill-heavy", "--output-len") is None
    with pytest.raises(ValueError, match="NAME=MIN:MAX"):
        parse_lengths("mixed=8:256,9:10", "mixed", "--output-len")


def test_the_recommendation_is_the_best_goodput_per_tpot_slo():
    def topo(workers: int, goodput: dict) -> dict:
        return {"deployment": {"workers": [{}] * workers}, "goodput_by_tpot_ms": goodput}
    topologies = {"1p3d": topo(4, {"15": 8.0, "25": 16.0, "50": None}),
                  "3p1d": topo(4, {"15": 4.0, "25": 24.0, "50": 32.0}),
                  "4colocated": topo(4, {"15": None, "25": 24.0, "50": 40.0})}
    rows = {r["tpot_ms"]: r for r in recommend(topologies, parse_slos("15,25,50,5"))}
    assert rows[15.0]["best"] == "1p3d" and rows[15.0]["goodput"] == 8.0
    assert rows[25.0]["best"] == "3p1d"                     # a tie goes to the first listed
    assert rows[50.0]["best"] == "4colocated" and rows[50.0]["by_topology"]["1p3d"] is None
    assert rows[5.0]["best"] is None and rows[5.0]["goodput"] is None


def test_slos_must_be_positive_milliseconds():
    assert parse_slos("10, 25") == [10.0, 25.0]
    with pytest.raises(ValueError, match="> 0"):
        parse_slos("25,0")


def test_the_offline_baseline_runs_a_tensor_parallel_worker_s_engine_across_its_devices():
    from baton.benchmarks import baseline
    from baton.benchmarks.serve import _baseline_tp_flags
    pool = ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert _baseline_tp_flags("1colocated-tp2", pool) == ["--tp-size", "2", "--tp-devices", "cuda:0,cuda:1"]
    assert _baseline_tp_flags("1colocated-tp2@openai", pool) == _baseline_tp_flags("1colocated-tp2", pool)
    assert _baseline_tp_flags("1colocated", pool) == []
    assert _baseline_tp_flags("2colocated-tp2", pool) == []         # several workers: one device's engine
    assert _baseline_tp_flags("1p1d", pool) == []
    flags = baseline.engine_flags("--tp-size 2 --all-reduce symm --enable-expert-parallel --role colocated "
                                  "--max-num-seqs 64", 16)
    assert flags == ["--tp-size", "2", "--all-reduce", "symm", "--enable-expert-parallel", "--max-num-seqs", "16"]


@pytest.mark.parametrize("argv,match", [
    (["--dataset", "nosuch"], "unknown dataset 'nosuch'"),
    (["--dataset", "/nonexistent/requests.jsonl"], "does not exist"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--max-concurrency", "0"], "--max-concurrency"),
    (["--temperature", "-1"], "--temperature"),
    (["--request-timeout", "0"], "--request-timeout"),
    (["--group-size", "0", "--dataset", "shared-prefix"], "--group-size"),
    (["--prefix-len", "-1", "--dataset", "shared-prefix"], "--prefix-len"),
])
def test_bad_load_flags_are_refused_before_anything_is_launched(argv, match):
    """Refused while parsing, so a launched run does not start its workers (minutes on a GPU) first."""
    import argparse

    from baton.benchmarks import serve
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true")
    serve.add_arguments(p)
    with pytest.raises(ValueError, match=match):
        serve.resolve(p.parse_args(["--smoke", "--launch", "1p1d", *argv]))


@pytest.mark.parametrize("made_for,says", [
    ({"model": "tiny-qwen3"}, "for tiny-qwen3"),
    ({"devices": 4}, "for 4 devices"),
    ({"lengths": {"input": [256, 512], "output": [8, 16]}}, "256:512 prompt"),
])
def test_a_plan_made_for_another_deployment_or_workload_is_not_measured_against(tmp_path, made_for, says):
    """--topologies auto --plan: the plan's pick and predictions are judged against what is measured,
    so a plan of another model, device count or workload lengths is refused, with what to plan again."""
    import argparse
    import json

    from baton.benchmarks import serve
    plan = {"model": "smollm2-135m-instruct", "devices": 2, "workloads": {"random": {
        "lengths": {"input": [8, 32], "output": [4, 8]},
        "slos": {"1000/100": {"best": "2colocated", "topologies": {"2colocated": {"goodput": 3.0}}}}}}}
    lengths = made_for.pop("lengths", None)
    plan |= made_for
    if lengths:
        plan["workloads"]["random"]["lengths"] = lengths
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true")
    serve.add_arguments(p)
    argv = ["--smoke", "--goodput", "--topologies", "auto", "--plan", str(path), "--devices", "cpu,cpu"]
    with pytest.raises(ValueError, match=says):
        serve.resolve(p.parse_args(argv))
    path.write_text(json.dumps(plan | {"model": "smollm2-135m-instruct", "devices": 2,
                                       "workloads": {"random": {**plan["workloads"]["random"],
                                                                "lengths": {"input": [8, 32], "output": [4, 8]}}}}))
    serve.resolve(p.parse_args(argv))                   # the same plan made for this run is taken


def test_the_goodput_summary_says_none_and_unconverged_and_the_prediction_not_zero():
    """The closing lines of `bench serve --goodput`: a topology with no goodput found reads "none"
    (not 0 req/s), a search the budget stopped says so, and with a plan each goodput sits beside
    its prediction: how the planner is judged."""
    from baton.benchmarks import serve_goodput
    from baton.benchmarks.goodput import SLO
    slo = SLO(3.0, 0.3)
    by_workload = {"decode-heavy": {
        "2colocated": {"goodput_by_slo": {slo.key: None}, "predicted": {slo.key: 7.842},
                       "searches": {slo.key: {"converged": False, "reason": "budget", "bracket": [None, 6.819]}}},
        "1p1d": {"goodput_by_slo": {slo.key: 1.5}, "predicted": {slo.key: 2.0},
                 "searches": {slo.key: {"converged": True, "reason": "converged", "bracket": [1.5, 1.55]}}}}}
    rec = serve_goodput.recommend(by_workload, [slo], "2colocated")
    [line] = serve_goodput.summary_lines(rec, by_workload)
    assert line.startswith("[bench] decode-heavy, TTFT <= 3000 ms, TPOT <= 300 ms: best 1p1d (1.5 req/s)")
    assert "2colocated none (not converged: budget; predicted 7.84)" in line
    assert "1p1d 1.5 (predicted 2)" in line and " 0 " not in line + " "


def test_the_sweeps_summary_says_none_where_no_rate_met_the_slos():
    from baton.benchmarks.serve import recommendation_lines
    rows = recommend({"1p1d": {"deployment": {"workers": [{}] * 2}, "goodput_by_tpot_ms": {"100": None}},
                      "2colocated": {"deployment": {"workers": [{}] * 2}, "goodput_by_tpot_ms": {"100": 4.0}}},
                     [100.0])
    assert recommendation_lines(rows, 1000.0) == [
        "[bench] TTFT <= 1000 ms, TPOT <= 100 ms: best 2colocated (4 req/s); 1p1d none, 2colocated 4"]
    rows = recommend({"1p1d": {"deployment": {"workers": [{}] * 2}, "goodput_by_tpot_ms": {"100": None}}}, [100.0])
    assert recommendation_lines(rows, 1000.0) == ["[bench] TTFT <= 1000 ms, TPOT <= 100 ms: best none; 1p1d none"]


def test_a_launched_run_on_a_gpu_this_machine_lacks_is_refused_in_a_line(tmp_path, capsys, monkeypatch):
    """`--devices cuda:0,cuda:1` where torch sees no such GPU: the ceilings' first copy raised
    torch's AssertionError with a traceback; now the same line the workers give. (torch is told
    there is no GPU, so a machine that has one checks the same path.)"""
    import torch

    from baton.benchmarks.cli import main as bench_main
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        bench_main(["serve", "--smoke", "--launch", "1p1d", "--devices", "cuda:0,cuda:1", "--no-plots",
                    "--output", str(tmp_path / "x.json")])
    assert exc.value.code == 2 and "torch sees no CUDA GPU" in capsys.readouterr().err


def test_an_output_path_that_cannot_be_written_is_refused_before_the_run(tmp_path, capsys):
    """Not a traceback once the benchmark (or the plan's profile) has run and its results are lost."""
    from baton.benchmarks.cli import main as bench_main
    from baton.benchmarks.planner import main as plan_main
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exc:
        bench_main(["offline", "--smoke", "--output", str(blocker / "x.json")])
    assert exc.value.code == 2 and "--output" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        plan_main(["--device", "cpu", "--output", str(blocker / "plan.json")])
    assert exc.value.code == 2 and "--output" in capsys.readouterr().err
