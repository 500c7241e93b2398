"""`baton elastic`'s decisions (baton/elastic.py): the mix read off the router's counters, the plan's
split for the nearest workload, hysteresis, one cheap move at a time. The loop against a running
deployment is in tests/test_role_switch.py."""
from __future__ import annotations

from prometheus_client import generate_latest

from baton.elastic import Controller, Mix, counters, next_move, split_counts, window_mix
from baton.serving.metrics import Metrics

# the shape `baton plan --output` writes (benchmarks/planner.py), two workloads, one SLO pair
PLAN = {"workloads": {
    "prefill-heavy": {"lengths": {"input": [1000, 2000], "output": [8, 32]},
                      "slos": {"1000/15": {"best": "1p1d"}}},
    "decode-heavy": {"lengths": {"input": [16, 64], "output": [64, 192]},
                     "slos": {"1000/15": {"best": "2colocated"}}}}}
LONG_PROMPTS, LONG_OUTPUTS = Mix(40, 1500, 20), Mix(200, 40, 120)
SPLIT = {"prefill": 1, "decode": 1, "colocated": 0}
REPLICAS = {"prefill": 0, "decode": 0, "colocated": 2}


def test_the_mix_is_read_off_the_routers_own_counters():
    m = Metrics("router")
    m.serving_model("smol")
    before = counters(generate_latest(m.registry).decode())
    for prompt, out in ((100, 10), (300, 30)):
        m.finished(prompt, out, 0)
        m.requests.labels("smol", "stop").inc()
    mix = window_mix(before, counters(generate_latest(m.registry).decode()))
    assert mix == Mix(2, 200, 20)
    assert window_mix(before, before) is None            # nothing finished: no mix, no decision


def test_a_steady_mix_moves_one_worker_after_the_hysteresis_and_a_burst_moves_none():
    ctl = Controller(PLAN, "1000/15", windows=2, cooldown_s=60)
    assert ctl.decide(LONG_PROMPTS, SPLIT, 0) is None             # what it runs is what the plan wants
    assert ctl.decide(LONG_OUTPUTS, SPLIT, 30) is None            # one window of a new mix: wait
    assert ctl.decide(LONG_PROMPTS, SPLIT, 60) is None            # it passed: the streak starts over
    assert ctl.decide(LONG_OUTPUTS, SPLIT, 90) is None
    assert ctl.decide(LONG_OUTPUTS, SPLIT, 120) == ("decode", "colocated")   # keeps its streams: first
    ctl.last_switch = 120
    after = {"prefill": 1, "decode": 0, "colocated": 1}
    assert ctl.decide(LONG_OUTPUTS, after, 150) is None           # the cooldown
    assert ctl.decide(LONG_OUTPUTS, after, 181) == ("prefill", "colocated")
    assert ctl.decide(LONG_OUTPUTS, REPLICAS, 300) is None        # there
    assert "decode-heavy -> 2colocated" in ctl.log[-2]


def test_moves_and_splits_it_cannot_make_are_not_attempted():
    assert next_move(REPLICAS, SPLIT) in {("colocated", "decode"), ("colocated", "prefill")}
    assert next_move(REPLICAS, SPLIT) == ("colocated", "decode")           # the cheap one first
    assert next_move(SPLIT, SPLIT) is None
    assert split_counts("2colocated-tp2") is None                          # tensor parallel: not by role switches
    assert split_counts("2p1d") == {"prefill": 2, "decode": 1, "colocated": 0}
    ctl = Controller(PLAN, "1000/15", windows=1, cooldown_s=0)
    three = {"prefill": 1, "decode": 1, "colocated": 1}                    # a plan for two devices, three workers
    assert ctl.decide(LONG_OUTPUTS, three, 0) is None


def test_a_decode_worker_can_start_in_any_role():
    from baton.serving.worker.worker_config import parse_worker_args
    assert parse_worker_args("decode", ["--role", "prefill"]).role == "prefill"
    assert parse_worker_args("decode", []).role == "decode"
    assert parse_worker_args("decode", ["--colocated"]).role == "colocated"
