"""router/worker_metrics.py: the router's /metrics with its workers' beside it (the stack-level
check, a plain `baton serve` scraped on the router alone, is tests/test_dashboard.py's)."""
from __future__ import annotations

import asyncio
import time

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from baton.router import worker_metrics
from baton.serving.metrics import Metrics
from baton.v1 import worker_pb2


class Worker:
    def __init__(self, address, role, metrics=None):
        self.address, self.role, self.metrics = address, role, metrics
        self.stub = self

    async def GetMetrics(self, request, timeout=None):
        if self.metrics is None:
            raise TimeoutError("no answer")
        return worker_pb2.WorkerMetrics(text=generate_latest(self.metrics.registry))


def series(text: bytes) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text.decode()) for s in f.samples}


def test_workers_series_join_the_routers_labelled_and_each_counted_once():
    router, decode, prefill = Metrics("router"), Metrics("decode"), Metrics("prefill")
    for m in (router, decode, prefill):
        m.serving_model("m")
    router.requests.labels("m", "length").inc(3)
    decode.requests.labels("m", "length").inc(3)                 # its own count of the same requests
    decode.running.set(2)
    prefill.kv_transfer_bytes.labels("out").inc(4096)
    workers = [Worker("d:1", "decode", decode), Worker("p:1", "prefill", prefill), Worker("gone:1", "decode")]
    scraped = asyncio.run(worker_metrics.scrape(workers, timeout=1))
    assert [w.address for w, _ in scraped] == ["d:1", "p:1"]          # the silent one is left out
    got = series(worker_metrics.merge(generate_latest(router.registry), scraped))
    assert got[("baton_running", (("role", "decode"), ("worker", "d:1")))] == 2
    assert ("baton_running", ()) not in got                           # the router's idle copy is not shown
    assert got[("baton_kv_transfer_bytes_total", (("direction", "out"), ("role", "prefill"),
                                                  ("worker", "p:1")))] == 4096
    requests = {k: v for k, v in got.items() if k[0] == "baton_requests_total"}
    assert requests == {("baton_requests_total", (("model", "m"), ("status", "length"))): 3}   # once: the router's
    infos = {dict(k[1])["role"] for k in got if k[0] == "baton_model_info"}
    assert infos == {"router", "decode", "prefill"}                   # every process names itself


def test_the_metrics_port_asks_the_workers_on_the_routers_loop():
    """PortView: what --metrics-port serves with --worker-metrics. prometheus_client calls it from a thread of its
    own; the workers are asked on the router's loop. Before the router attaches its workers (the port opens
    first), and when the loop does not answer, the router's own series still come."""
    import threading
    router, decode = Metrics("router"), Metrics("decode")
    router.serving_model("m")
    decode.running.set(5)
    view = worker_metrics.PortView(router.registry)
    registry = view.registry()
    assert ("baton_running", (("role", "decode"), ("worker", "d:1"))) not in series(generate_latest(registry))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        view.attach(lambda: [Worker("d:1", "decode", decode)], loop)
        got = series(generate_latest(registry))
        assert got[("baton_running", (("role", "decode"), ("worker", "d:1")))] == 5
        assert any(k[0] == "baton_model_info" and dict(k[1]).get("role") == "router" for k in got)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
    t0 = time.monotonic()
    got = series(generate_latest(registry))             # the loop is gone: the router's own, at once
    assert time.monotonic() - t0 < 1.0
    assert any(k[0] == "baton_model_info" for k in got) and not any(dict(k[1]).get("worker") for k in got)
