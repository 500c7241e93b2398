"""What every engine-backed server process shares: start-up, status, abort, metrics, drain.

`prefill_service` and `decode_service` subclass `EngineWorker` and add their RPCs. The
engine runs on its own thread (AsyncEngine); everything here runs on the event loop.
"""
from __future__ import annotations

import asyncio
import sys
import time

import grpc

from baton.engine.async_engine import AsyncEngine
from baton.engine.kv_handoff import KVHandoff
from baton.engine.llm_engine import LLMEngine, freeze_startup_objects
from baton.kvtransfer.factory import accepted
from baton.kvtransfer.layout import KVLayout
from baton.serving.grpc_server import Server, ServiceError
from baton.serving.metrics import Metrics
from baton.serving.worker_config import WorkerConfig
from baton.v1 import worker_pb2


class EngineWorker:
    service_names: tuple[str, ...] = ()

    def __init__(self, cfg: WorkerConfig):
        self.cfg = cfg
        self.metrics = Metrics(cfg.role)
        self.engine: AsyncEngine | None = None
        self.server: Server | None = None
        self.requests_served = 0
        self.handoff: KVHandoff | None = None    # the services' side of the engine's KV seam

    @property
    def llm(self) -> LLMEngine:
        return self.engine.engine

    async def start(self) -> Server:
        t0 = time.perf_counter()
        # the engine thread and the event loop share the GIL; a thread that wants it back waits out
        # the holder's switch interval (Python's 5 ms is about one decode step of an 8B model)
        if self.cfg.gil_switch_ms:
            sys.setswitchinterval(self.cfg.gil_switch_ms / 1e3)
        # ports first: a clash is reported in a second, not after the model has loaded
        self.server = Server(self.cfg.host, self.cfg.port, self.service_names, tls=self.cfg.tls)
        self.metrics.serve(self.cfg.metrics_port, self.cfg.host)
        print(f"[baton] {self.cfg.role}: loading {self.cfg.engine.model} on {self.cfg.engine.device}",
              file=sys.stderr, flush=True)
        loop = asyncio.get_running_loop()
        llm = await loop.run_in_executor(None, lambda: LLMEngine(self.cfg.engine, handoff=self.handoff))
        freeze_startup_objects()
        self.metrics.serving_model(llm.source.name)
        self.engine = AsyncEngine(llm, loop)
        self.engine.on_step = self._after_step
        self.add_services(self.server.server)
        await self.server.start()
        self._observe()
        stats = self.engine.stats()
        print(f"[baton] {self.cfg.role} ready on {self.server.address} "
              f"({stats.kv_blocks_total} KV blocks of {llm.config.block_size}, "
              f"max_model_len {llm.max_model_len}) in {time.perf_counter() - t0:.1f}s; "
              f"{'mutual TLS' if self.cfg.tls.require_client_cert else 'TLS' if self.cfg.tls.cert else 'plaintext'}"
              f"{', KV peers proven by shared secret' if self.cfg.kv_secret else ''}{self.ready_note()}",
              file=sys.stderr, flush=True)
        return self.server

    def ready_note(self) -> str:
        """More for the ready line (the decode worker: where peers push KV)."""
        return ""

    def add_services(self, server) -> None:
        raise NotImplementedError

    async def serve_forever(self) -> None:
        server = await self.start()
        await server.wait_for_signal(self.cfg.grace_seconds, on_stop=self.stop, busy=self.num_active)

    async def stop(self) -> None:
        """After the drain: release the KV transports (device communicators), stop the engine."""
        await self.release_transports()
        self.engine.shutdown()

    async def release_transports(self) -> None:
        return None

    # -- shared RPC bodies ------------------------------------------------------------------
    def status(self) -> worker_pb2.WorkerStatus:
        s = self.engine.stats()
        return worker_pb2.WorkerStatus(
            role=self.cfg.role, model=self.llm.source.name, running=s.running,
            waiting=s.waiting + self.num_pending(), kv_blocks_total=s.kv_blocks_total,
            kv_blocks_free=s.kv_blocks_free, block_size=self.llm.config.block_size,
            max_model_len=self.llm.max_model_len, kv_backends=self.kv_backends(), device=self.cfg.engine.device,
            draining=bool(self.server and self.server.draining), requests_served=self.requests_served)

    def kv_layout(self) -> KVLayout:
        """This worker's KV layout, for the transfer handshake (both ends must agree)."""
        spec = self.llm.kv_spec
        return KVLayout(model=self.llm.source.name, architecture=self.llm.source.architecture, dtype=spec.dtype,
                        block_size=spec.block_size, num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
                        head_dim=spec.head_dim, tp_size=1, tp_rank=0, backends=self.kv_backends())

    def kv_backends(self) -> list[str]:
        """KV transports this worker speaks (a decode worker also takes grpc pushes whatever
        its own backend)."""
        return accepted(self.cfg.kv_backend)

    def num_pending(self) -> int:
        return 0

    def num_active(self) -> int:
        """Requests in flight here (what a drain waits for)."""
        return 0

    def check_accepting(self) -> None:
        """Admission control for a new request: draining or a full queue refuses it."""
        if self.server is not None and self.server.draining:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "worker is draining; send the request elsewhere")
        waiting = self.engine.stats().waiting + self.num_pending()
        if waiting >= self.cfg.max_waiting:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{self.cfg.role} worker has {waiting} requests queued (limit {self.cfg.max_waiting}); "
                               "retry shortly or on another worker", retry_after=1.0)

    def _after_step(self, llm: LLMEngine, outputs) -> None:
        self.metrics.step_seconds.labels("step").observe(llm.last_step_seconds)
        self._observe()

    def _observe(self) -> None:
        s = self.engine.stats()
        self.metrics.observe_engine(s.running, s.waiting, s.kv_blocks_total, s.kv_blocks_free)
