"""`baton elastic`'s decisions (baton/elastic.py): the mix read off the routers' counters (summed over
several routers, none decided on while one is down), the plan's split for the nearest workload,
hysteresis, one cheap move at a time. The loop against a running deployment is in
tests/test_role_switch.py."""
from __future__ import annotations

import json

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from baton import elastic
from baton.benchmarks.prometheus import merge_routers
from baton.elastic import Controller, Mix, counters, next_move, read_counters, split_counts, window_mix
from baton.router import worker_metrics
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


def router() -> Metrics:
    m = Metrics("router")
    m.serving_model("smol")
    return m


def finish(m: Metrics, *lengths: tuple[int, int]) -> None:
    for prompt, out in lengths:
        m.finished(prompt, out, 0)
        m.requests.labels("smol", "stop").inc()


def families(m: Metrics) -> list:
    return list(text_string_to_metric_families(generate_latest(m.registry).decode()))


def test_the_mix_is_read_off_the_routers_own_counters():
    m = router()
    before = counters([families(m)])
    finish(m, (100, 10), (300, 30))
    mix = window_mix(before, counters([families(m)]))
    assert mix == Mix(2, 200, 20)
    assert window_mix(before, before) is None            # nothing finished: no mix, no decision


class WORKER:
    address, role = "d:1", "decode"


def test_several_routers_counters_add_up_and_the_workers_series_count_once():
    a, b = router(), router()
    finish(a, (100, 10), (300, 30))
    finish(b, (200, 20))
    a.router_running.labels("smol").set(2)
    b.router_running.labels("smol").set(1)
    decode = Metrics("decode")
    decode.serving_model("smol")
    decode.running.set(3)
    decode.kv_transfer_bytes.labels("in").inc(8e6)

    def seen(m):          # a router's merged view (--worker-metrics): the worker's series beside its own
        text = worker_metrics.merge(generate_latest(m.registry), [(WORKER, generate_latest(decode.registry).decode())])
        return list(text_string_to_metric_families(text.decode()))
    both = merge_routers([seen(a), seen(b)])
    assert counters([seen(a), seen(b)]) == {"prompt": 600, "output": 60, "requests": 3}
    assert both[("baton_router_running", (("model", "smol"),))] == 3                 # each router's own: summed
    assert both[("baton_ttft_seconds_count", (("model", "smol"),))] == 0
    worker = (("role", "decode"), ("worker", "d:1"))
    assert both[("baton_running", worker)] == 3                                        # the worker's: once
    assert both[("baton_kv_transfer_bytes_total", (("direction", "in"), *worker))] == 8e6   # a counter too
    apart = merge_routers([seen(a), seen(b)], apart=True)
    assert apart[("baton_requests_total", (("model", "smol"), ("router", "1"), ("status", "stop")))] == 1
    assert merge_routers([seen(a)], apart=True) == merge_routers([seen(a)])            # one router: as before


def test_two_healthy_routers_with_uneven_traffic_give_the_whole_mix(canned_routers):
    busy, idle = router(), router()
    finish(idle, (50, 5))                                  # it served earlier, nothing in this window
    pages = [generate_latest(busy.registry).decode()]
    finish(busy, (100, 10), (300, 30))
    pages.append(generate_latest(busy.registry).decode())
    urls = [canned_routers(pages), canned_routers([generate_latest(idle.registry).decode()])]
    before, down = read_counters(urls)
    after, _ = read_counters(urls)
    assert down == {} and before == {"prompt": 50, "output": 5, "requests": 1}
    assert window_mix(before, after) == Mix(2, 200, 20)    # an idle router is no fault
    restarted = dict(after, prompt=after["prompt"] - 50, requests=after["requests"] + 1)
    assert window_mix(after, restarted) is None            # a counter went back: a router restarted


def test_with_a_router_down_elastic_holds_and_says_which(canned_routers, tmp_path, capsys):
    m = router()
    finish(m, (100, 10))
    up = canned_routers([generate_latest(m.registry).decode()])
    totals, down = read_counters([up, canned_routers.DOWN])
    assert totals is None and list(down) == [canned_routers.DOWN]      # no partial sum
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    with pytest.raises(SystemExit) as done:      # never asks the router (nothing listens on --addr) to switch
        elastic.main(["--plan", str(tmp_path / "plan.json"), "--addr", "127.0.0.1:1", "--window", "0.05", "--once",
                      "--metrics-url", f"{up},{canned_routers.DOWN}"])
    err = capsys.readouterr().err
    assert done.value.code == 1
    assert "[elastic] holding this window: no switch on part of the traffic; 1 of 2 router(s) did not answer: " \
           f"{canned_routers.DOWN} (" in err, err
    assert "Traceback" not in err and up not in err


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
