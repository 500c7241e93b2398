"""One scrape target for a deployment (--worker-metrics, which `baton serve` turns on): the
router's /metrics on its HTTP port serves every healthy worker's Prometheus metrics beside its
own, each worker's series labelled with `worker` (its address) and `role`. A Prometheus pointed
at the router, as a vLLM user points it at vLLM, then sees KV transfers, handover, step times
and KV use, which live on the workers.

Families are merged by name, each from the processes that record it (serving/metrics.py:
RECORDED_BY): a worker's idle copy of a router gauge, or the router's of a worker gauge, never
shows up as a second series, and a request counted by the router is not counted again by its
decode worker. Workers are asked over gRPC (GetMetrics) at scrape time, concurrently, each within
a short timeout; one that does not answer is left out of that scrape (a debug line says why)."""
from __future__ import annotations

import asyncio
import logging

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from baton.serving.metrics import RECORDED_BY
from baton.v1 import worker_pb2

log = logging.getLogger("baton.router")

SCRAPE_TIMEOUT_S = 2.0


def shown(family: str, role: str) -> bool:
    """Whether the merged view shows `family`'s series from a process of `role`: the router's
    families from the router, the rest from the workers (of what both record, requests by outcome,
    the router's alone: a request is counted once). Families Baton does not list: every process's."""
    who = RECORDED_BY.get(family)
    if who is None or "every process" in who:
        return True
    return ("router" in who) == (role == "router")


def targets(registry) -> list:
    """The workers a merged scrape asks: the healthy ones the router has a channel to."""
    return [w for w in registry.workers if w.healthy and w.stub is not None]


async def scrape(workers, timeout: float = SCRAPE_TIMEOUT_S) -> list[tuple[object, str]]:
    """(worker, its metrics text) of each worker that answered in time."""
    async def one(w):
        reply = await w.stub.GetMetrics(worker_pb2.GetMetricsRequest(), timeout=timeout)
        return w, reply.text.decode()
    results = await asyncio.gather(*(one(w) for w in workers), return_exceptions=True)
    out = []
    for w, r in zip(workers, results, strict=True):
        if isinstance(r, BaseException):
            log.debug("metrics of %s (%s) left out of this scrape: %s", w.address, w.role, r)
        else:
            out.append(r)
    return out


class _Merged:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return self.families


def merge(own: bytes, scraped: list[tuple[object, str]]) -> bytes:
    """The router's exposition `own` and each scraped worker's, as one, families merged by name."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(merged_families(own, scraped)))
    return generate_latest(registry)


def merged_families(own: bytes, scraped: list[tuple[object, str]]) -> list[Metric]:
    """`merge`'s families."""
    merged: dict[str, Metric] = {}

    def add(text: str, role: str, extra: dict[str, str]) -> None:
        for fam in text_string_to_metric_families(text):
            out = merged.get(fam.name)
            if out is None:         # declared even with no series shown: a dashboard finds the family
                out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            if out.type != fam.type or not shown(fam.name.removesuffix("_created"), role):
                continue
            for s in fam.samples:
                labels = {**s.labels, **{k: v for k, v in extra.items() if k not in s.labels}}
                out.add_sample(s.name, labels, s.value, s.timestamp, s.exemplar)

    add(own.decode(), "router", {})
    for w, text in scraped:
        add(text, w.role, {"worker": w.address, "role": w.role})
    return list(merged.values())


class PortView:
    """What the router's --metrics-port serves with --worker-metrics: its own families and, once `attach`ed, every
    healthy worker's, merged as the HTTP port's /metrics merges them. Several routers of one deployment share
    its HTTP port (each scrape reaches one of them) but each has a metrics port of its own: with this, each is
    one whole target (`baton top --url A,B` and `baton elastic` take the workers' series once). prometheus_client
    serves the port from a thread of its own; the workers are asked on the router's event loop."""

    def __init__(self, own: CollectorRegistry):
        self.own = own
        self._loop: asyncio.AbstractEventLoop | None = None
        self._workers = None

    def attach(self, workers, loop: asyncio.AbstractEventLoop) -> None:
        """workers() -> the workers to ask (called on `loop`)."""
        self._workers, self._loop = workers, loop

    def registry(self) -> CollectorRegistry:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        return registry

    def collect(self):
        scraped = []
        if self._loop is not None and not self._loop.is_closed():
            async def ask():
                return await scrape(self._workers())
            asked = ask()
            try:
                future = asyncio.run_coroutine_threadsafe(asked, self._loop)
            except RuntimeError as exc:       # the loop closed since: its own series still
                asked.close()
                log.debug("workers' metrics left out of this scrape of the metrics port: %r", exc)
            else:
                try:
                    scraped = future.result(SCRAPE_TIMEOUT_S + 1)
                except Exception as exc:      # a router stopping, a loop that does not answer
                    future.cancel()
                    log.debug("workers' metrics left out of this scrape of the metrics port: %r", exc)
        return merged_families(generate_latest(self.own), scraped)
