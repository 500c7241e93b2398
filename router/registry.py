"""The router's view of its workers: addresses from flags/env, kept fresh by health checks.

A worker that fails a health check, a status call or a real request is marked unhealthy at
once and leaves rotation; the checker keeps probing it and a recovered worker returns.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.serving.grpc_server import open_channel
from baton.serving.security import TLSConfig
from baton.v1 import decode_pb2_grpc, prefill_pb2_grpc, worker_pb2

log = logging.getLogger("baton.router")
CHECK_INTERVAL_S = 1.0
CHECK_TIMEOUT_S = 2.0


@dataclass(slots=True)
class Worker:
    address: str
    role: str                                     # prefill | decode | colocated
    channel: grpc.aio.Channel | None = None
    stub: object = None
    health: object = None
    healthy: bool = False
    status: worker_pb2.WorkerStatus = field(default_factory=worker_pb2.WorkerStatus)
    inflight: int = 0                             # requests this router has sent and not finished
    last_error: str = ""
    last_seen: float = 0.0

    def connect(self, tls: TLSConfig | None = None) -> None:
        self.channel = open_channel(self.address, tls)
        stub_cls = prefill_pb2_grpc.PrefillStub if self.role == "prefill" else decode_pb2_grpc.DecodeStub
        self.stub = stub_cls(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def load(self) -> int:
        return max(self.inflight, self.status.running + self.status.waiting)

    def kv_free_fraction(self) -> float:
        total = self.status.kv_blocks_total
        return self.status.kv_blocks_free / total if total else 0.0

    def mark_down(self, reason: str) -> None:
        if self.healthy:
            log.warning("worker %s (%s) marked unhealthy: %s", self.address, self.role, reason)
        self.healthy = False
        self.last_error = reason


class Registry:
    def __init__(self, prefill: list[str], decode: list[str], colocated: list[str], model: str,
                 tls: TLSConfig | None = None):
        self.model = model
        self.tls = tls
        self.workers = ([Worker(a, "prefill") for a in prefill] + [Worker(a, "decode") for a in decode]
                        + [Worker(a, "colocated") for a in colocated])
        if not self.workers:
            raise ValueError("no workers configured: give --prefill and --decode, or --colocated")
        if bool(prefill) != bool(decode):
            raise ValueError("disaggregated serving needs both --prefill and --decode workers")
        self._task: asyncio.Task | None = None

    def healthy(self, role: str, exclude: set[str] = frozenset()) -> list[Worker]:
        return [w for w in self.workers if w.role == role and w.healthy and not w.status.draining
                and w.address not in exclude]

    async def start(self) -> None:
        for w in self.workers:
            w.connect(self.tls)
        await self.check_all()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        for w in self.workers:
            await w.channel.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            await self.check_all()

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.workers))

    async def check(self, w: Worker) -> None:
        try:
            reply = await w.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=CHECK_TIMEOUT_S)
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                w.mark_down("health: not serving (draining?)")
                return
            status = await w.stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=CHECK_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            w.mark_down(f"{exc.code().name}: {exc.details()}")
            return
        if status.role != w.role:
            w.mark_down(f"configured as {w.role} but reports role {status.role!r}")
            return
        if self.model and status.model != self.model:
            w.mark_down(f"serves model {status.model!r}, router serves {self.model!r}")
            return
        if not w.healthy:
            log.info("worker %s (%s) healthy", w.address, w.role)
        w.status, w.healthy, w.last_seen = status, True, time.monotonic()
