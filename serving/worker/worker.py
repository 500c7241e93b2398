"""A worker's front: what every engine-backed server shares (start-up, status, admission,
metrics, drain, the engine core's life).

A worker is two processes. The front (this, on one event loop) serves the worker's RPCs,
checks requests, makes text and streams tokens; its engine core (serving/worker/engine_core.py,
a child process started through serving/worker/core_client.py) runs the step loop, the device, the
KV cache and the KV transfers. `prefill_service` and `decode_service` subclass `EngineWorker`
with their RPCs and name their core (`core_target`). The front never imports torch.

The core dying or hanging is the worker dying: the front fails what is in flight with
UNAVAILABLE (the router moves those streams elsewhere) and exits with code 1 (`baton serve`
restarts it; Kubernetes does the same).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import sys
import time

import grpc
from prometheus_client import generate_latest

from baton.engine.requests.limits import ModelLimits
from baton.serving.grpc_server import Server, ServiceError
from baton.serving.metrics import Metrics
from baton.serving.worker.core_client import CoreClient, start_core
from baton.serving.worker.core_protocol import MetricEvent, TokenUpdate
from baton.serving.worker.kv_events import KVEventLog
from baton.serving.worker.worker_config import WorkerConfig
from baton.v1 import worker_pb2

log = logging.getLogger("baton.worker")
EXIT_FLUSH_S = 0.5                 # a dead core's streams get their error out before the worker exits
STEP_WINDOW = 512                  # recent steps the reported step p99 is taken over


class EngineWorker:
    service_names: tuple[str, ...] = ()
    core_target = ""               # "module:Class" of the role's engine core
    switchable = False             # may change role in place (decode_service/server.py)

    def __init__(self, cfg: WorkerConfig):
        self.cfg = cfg
        self.role = cfg.role           # what it serves now (a switchable worker changes it)
        self.switching = ""            # the role it is switching to, while it does
        self.kv_events = KVEventLog()  # its prefix cache's changes, for routers (GetKVEvents)
        self.metrics = Metrics(cfg.role)
        self.core: CoreClient | None = None
        self.server: Server | None = None
        self.info: dict = {}
        self.limits: ModelLimits | None = None
        self.requests_served = 0
        self.step_seconds: collections.deque = collections.deque(maxlen=STEP_WINDOW)
        self._dead: asyncio.Future | None = None

    async def start(self) -> Server:
        t0 = time.perf_counter()
        # ports first: a clash is reported in a second, not after the model has loaded
        self.server = Server(self.cfg.host, self.cfg.port, self.service_names, tls=self.cfg.tls)
        self.metrics.serve(self.cfg.metrics_port, self.cfg.host)
        self._dead = asyncio.get_running_loop().create_future()
        self.core = start_core(self.cfg, self.cfg.engine_core or self.core_target, on_updates=self.on_updates,
                               on_metrics=self._record, on_death=self._core_died)
        self.info = info = await self.core.start()
        self.limits = ModelLimits(info["vocab_size"], info["max_model_len"], self.cfg.engine.scheduling_policy)
        self.metrics.serving_model(info["model"])
        self.prepare(info)
        self.add_services(self.server.server)
        await self.server.start()
        self._observe()
        stats = self.core.stats
        print(f"[baton] {self.cfg.role} ready on {self.server.address} "
              f"({stats.kv_blocks_total} KV blocks of {info['block_size']}, "
              f"max_model_len {info['max_model_len']}) in {time.perf_counter() - t0:.1f}s; "
              f"{'mutual TLS' if self.cfg.tls.require_client_cert else 'TLS' if self.cfg.tls.cert else 'plaintext'}"
              f"{', KV peers proven by shared secret' if self.cfg.kv_secret else ''}{self.ready_note()}",
              file=sys.stderr, flush=True)
        return self.server

    def prepare(self, info: dict) -> None:
        """What the role needs once the core serves (the decode front: its tokenizer)."""

    def ready_note(self) -> str:
        """More for the ready line (the decode worker: where peers push KV)."""
        return ""

    def add_services(self, server) -> None:
        raise NotImplementedError

    async def serve_forever(self) -> None:
        server = await self.start()
        stopped = asyncio.ensure_future(server.wait_for_signal(self.cfg.grace_seconds, on_stop=self.stop,
                                                               busy=self.num_active))
        await asyncio.wait({stopped, self._dead}, return_when=asyncio.FIRST_COMPLETED)
        if stopped.done():
            stopped.result()
            return
        stopped.cancel()
        await asyncio.sleep(EXIT_FLUSH_S)
        await server.server.stop(0)
        await self.core.stop()
        print(f"[baton] {self.cfg.role} on {server.address} exits: its engine core {self._dead.result()}",
              file=sys.stderr, flush=True)
        raise SystemExit(1)

    async def stop(self) -> None:
        """After the drain: stop the core (it releases the KV transports and the device)."""
        await self.core.stop()

    # -- the core's messages -------------------------------------------------------------------
    def on_updates(self, updates: list[TokenUpdate]) -> None:
        """Every request's new tokens of one engine step (the decode front streams them)."""

    def _record(self, events: list[MetricEvent]) -> None:
        """The core's metric events, and its counters into the gauges: every message that carries them (a
        step's updates, and the beat an idle core sends, so the gauges do not keep the last step's figures
        once no step runs)."""
        for name, labels, value in events:
            if name == "step_seconds":
                self.step_seconds.append(value)
            metric = getattr(self.metrics, name)
            metric = metric.labels(*labels) if labels else metric
            (metric.observe if hasattr(metric, "observe") else metric.inc)(value)
        self._observe()

    def _core_died(self, reason: str) -> None:
        log.error("%s worker: its engine core %s; failing what is in flight, then exiting", self.cfg.role, reason)
        self.server.draining = True
        asyncio.ensure_future(self.server.set_serving(False))
        self.fail_all(ServiceError(grpc.StatusCode.UNAVAILABLE, f"the worker's engine core {reason}"))
        if not self._dead.done():
            self._dead.set_result(reason)

    def fail_all(self, exc: ServiceError) -> None:
        """End every request in flight with `exc` (the core is gone)."""

    # -- shared RPC bodies ------------------------------------------------------------------
    def metrics_text(self) -> worker_pb2.WorkerMetrics:
        """This worker's Prometheus metrics (what --metrics-port serves), for a router that serves
        them beside its own."""
        return worker_pb2.WorkerMetrics(text=generate_latest(self.metrics.registry))

    async def get_kv_events(self, req: worker_pb2.GetKVEventsRequest) -> worker_pb2.KVEvents:
        return await self.kv_events.answer(self.core, req, self.info["block_size"])

    def status(self) -> worker_pb2.WorkerStatus:
        s, info, busy = self.core.stats, self.info, self.core.busy()
        return worker_pb2.WorkerStatus(
            role=self.role, switching_to=self.switching, switchable=self.switchable, model=info["model"], running=s.running, waiting=s.waiting,
            kv_blocks_total=s.kv_blocks_total, kv_blocks_free=s.kv_blocks_free, block_size=info["block_size"],
            max_model_len=info["max_model_len"], kv_backends=self.kv_backends(), device=self.cfg.engine.device,
            draining=bool(self.server and self.server.draining), requests_served=self.requests_served,
            kv_address=info.get("kv_address", ""), step_p99_ms=self.step_p99() * 1e3,
            stalled_seconds=self.core.stalled_seconds(), busy_seconds=busy.busy_s, busy_budget_seconds=busy.budget_s,
            busy_tokens=busy.tokens, seconds_per_token=busy.seconds_per_token, kv_skip_blocks=True)

    def step_p99(self) -> float:
        """Seconds: the p99 of the engine's recent steps (0 before any)."""
        steps = sorted(self.step_seconds)
        return steps[min(len(steps) - 1, int(0.99 * len(steps)))] if steps else 0.0

    def kv_backends(self) -> list[str]:
        """KV transports this worker speaks (a decode worker also takes grpc pushes whatever
        its own backend)."""
        return list(self.info["kv_backends"])

    def num_active(self) -> int:
        """Requests in flight here (what a drain waits for)."""
        return 0

    def check_accepting(self) -> None:
        """Admission control for a new request: draining or a full queue refuses it."""
        if self.server is not None and self.server.draining:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "worker is draining; send the request elsewhere")
        waiting = self.core.stats.waiting
        if waiting >= self.cfg.max_waiting:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{self.cfg.role} worker has {waiting} requests queued (limit {self.cfg.max_waiting}); "
                               "retry shortly or on another worker", retry_after=1.0)

    def _observe(self) -> None:
        s = self.core.stats
        self.metrics.observe_engine(s.running, s.waiting, s.kv_blocks_total, s.kv_blocks_free,
                                    (s.spec_draft_tokens, s.spec_accepted_tokens, s.spec_verified),
                                    s.spec_accepted_lengths)
