"""The decode worker: admits requests whose KV a prefill worker will push, joins them into
its continuously batched decode loop, and streams their tokens.

Per request, its `KVTicket` (engine/kv_handoff.py) says who owns its blocks: RESERVED at
Admit (the engine allocated them) -> RECEIVING (a sender claimed the transfer) -> LANDED
(every byte staged; `DecodeHandoff` hands it to the engine) -> JOINED (the engine copied it
into the blocks; the request decodes) -> FINISHED. Any failure, abort, cancel or deadline
before that ends it FREED: the engine frees the blocks, and the transfer registry drops the
staging buffer. With role "colocated" the same server also runs whole requests itself
(`Generate`), with no transfer.
"""
from __future__ import annotations

import asyncio
import collections
import math
import time
import uuid
from dataclasses import dataclass

import grpc

from baton.engine.async_engine import EngineDead
from baton.engine.kv_handoff import KVHandoff, KVState, KVTicket
from baton.kvtransfer.factory import accepted, make_receivers
from baton.kvtransfer.peer_auth import KVPeerAuth
from baton.kvtransfer.receiver import PendingTransfers
from baton.serving.grpc_server import ServiceError
from baton.serving.processes import reachable_host
from baton.serving.wire import chunk_from_output, images_from_proto, sampling_from_proto
from baton.serving.worker import EngineWorker
from baton.v1 import decode_pb2, decode_pb2_grpc, worker_pb2

DEFAULT_ADMIT_TIMEOUT_S = 60.0
# a stream with no deadline of its own ends only if its engine goes this long without a token for
# it (a wedged engine, never a long answer)
STREAM_IDLE_LIMIT_S = 600.0


class DecodeHandoff(KVHandoff):
    """The decode worker's half of the engine's seam: tickets whose KV landed, for the engine
    to join at its next step (appended on the event loop, taken on the engine thread)."""

    def __init__(self):
        self._landed: collections.deque[KVTicket] = collections.deque()

    def land(self, ticket: KVTicket, payload, first_token: int, meta: dict[str, str]) -> bool:
        """False when the request ended meanwhile (nothing is written into its blocks)."""
        if not ticket.land(payload, first_token, meta):
            return False
        self._landed.append(ticket)
        return True

    def take_landed(self) -> list[KVTicket]:
        taken = []
        while self._landed:
            taken.append(self._landed.popleft())
        return taken

    def has_landed(self) -> bool:
        return bool(self._landed)


@dataclass(slots=True)
class DecodeRequest:
    request_id: str
    transfer_id: str
    ticket: KVTicket | None                   # None: a colocated request (no transfer)
    queue: asyncio.Queue
    attached: bool = False
    prefill_done_unix: float | None = None    # the prefill worker's clock at its last forward


class DecodeWorker(EngineWorker):
    service_names = ("baton.v1.Decode", "baton.v1.KVTransfer")

    def __init__(self, cfg):
        super().__init__(cfg)
        if cfg.kv_backend == "direct":
            self.service_names = (*self.service_names, "baton.v1.KVDirect")
        self.requests: dict[str, DecodeRequest] = {}
        self.by_transfer: dict[str, str] = {}
        self.pending = PendingTransfers()
        self.handoff = DecodeHandoff()
        self.receivers = []
        self.layout = None

    def add_services(self, server) -> None:
        decode_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(self), server)
        auth = KVPeerAuth(self.cfg.kv_secret) if self.cfg.kv_secret else None
        store_host = (self.cfg.kv_advertise or "").rpartition(":")[0] or self.cfg.host   # direct pairs' rendezvous
        self.layout = self.kv_layout()
        self.receivers = make_receivers(self.cfg.kv_backend, self.pending, self.layout, self.llm.platform,
                                        self.kv_address, store_host, auth=auth, nccl=self.cfg.kv_nccl)
        for receiver in self.receivers:
            receiver.add_to_server(server)

    def ready_note(self) -> str:
        return f"; prefill workers push KV to {self.kv_address} (--advertise-host / --kv-advertise to change)"

    @property
    def kv_address(self) -> str:
        """Where prefill workers push KV: never a wildcard (serving/processes.reachable_host)."""
        if self.cfg.kv_advertise:
            return self.cfg.kv_advertise
        return f"{reachable_host(self.cfg.host, self.cfg.advertise_host)}:{self.server.port}"

    def num_pending(self) -> int:
        return len(self.by_transfer)

    def num_active(self) -> int:
        return len(self.requests)

    async def release_transports(self) -> None:
        for receiver in self.receivers:
            await receiver.close()

    # -- admission and handover ---------------------------------------------------------------
    async def admit(self, req: decode_pb2.AdmitRequest) -> decode_pb2.AdmitResponse:
        self.check_accepting()
        rid = req.request_id
        if not rid:
            raise ValueError("request_id is required")
        if rid in self.requests:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is already admitted here")
        backend = req.backend or self.cfg.kv_backend
        if backend not in accepted(self.cfg.kv_backend):
            raise ValueError(f"KV backend {backend!r} not supported here; this worker accepts "
                             f"{accepted(self.cfg.kv_backend)}")
        prompt, params = list(req.prompt_token_ids), sampling_from_proto(req.sampling)
        self.llm.validate(prompt, params)
        timeout = req.timeout_ms / 1000 if req.timeout_ms else DEFAULT_ADMIT_TIMEOUT_S
        ticket, queue = await self.engine.reserve(rid, prompt, params)
        r = DecodeRequest(rid, uuid.uuid4().hex, ticket, queue)
        self.requests[rid] = r
        self.by_transfer[r.transfer_id] = rid
        num_blocks = -(-len(prompt) // self.llm.config.block_size)
        try:
            self.pending.expect(r.transfer_id, self.layout.payload_nbytes(num_blocks), timeout,
                                self._on_kv_complete, self._on_kv_fail, self._on_kv_claimed)
        except BaseException:
            self.abort_request(rid, "the transfer could not be expected")
            raise
        asyncio.get_running_loop().call_later(timeout, self._expire_unattached, rid, r.transfer_id)
        return decode_pb2.AdmitResponse(transfer_id=r.transfer_id, num_blocks=num_blocks, kv_address=self.kv_address,
                                        backend=backend)

    def _request_of(self, transfer_id: str, done: bool) -> DecodeRequest | None:
        rid = self.by_transfer.pop(transfer_id, None) if done else self.by_transfer.get(transfer_id)
        return self.requests.get(rid) if rid else None

    def _on_kv_claimed(self, transfer_id: str) -> None:
        r = self._request_of(transfer_id, done=False)
        if r is not None:
            r.ticket.try_advance(KVState.RECEIVING)

    def _on_kv_complete(self, transfer_id: str, payload, first_token: int, extra: dict) -> None:
        r = self._request_of(transfer_id, done=True)
        if r is None:
            return
        r.prefill_done_unix = _float(extra.get("prefill_done_unix"))
        if r.prefill_done_unix:
            self.metrics.kv_landed.observe(max(0.0, time.time() - r.prefill_done_unix))
        self.metrics.kv_transfer_bytes.labels("in").inc(len(payload))
        if not self.handoff.land(r.ticket, payload, first_token, extra):
            raise RuntimeError(f"request {r.request_id} ended before its KV landed ({r.ticket.state.value})")
        self.engine.wake()                   # joined between steps, not after an idle wait

    def _on_kv_fail(self, transfer_id: str, reason: str) -> None:
        r = self._request_of(transfer_id, done=True)
        if r is None:
            return
        self.metrics.kv_transfer_failures.labels("receive").inc()
        self.engine.abort(r.request_id)
        r.queue.put_nowait(KVFailed(reason))

    def _expire_unattached(self, rid: str, transfer_id: str) -> None:
        """Nobody opened the stream in time (router gone): reclaim everything."""
        r = self.requests.get(rid)
        if r is not None and r.transfer_id == transfer_id and not r.attached:
            self.abort_request(rid, "no stream attached before the admission deadline")

    def abort_request(self, rid: str, reason: str = "aborted") -> bool:
        r = self.requests.get(rid)
        self.engine.abort(rid)
        if r is None:
            return False
        self._end_transfer(r)
        r.queue.put_nowait(_Aborted(reason))
        if not r.attached:
            self._forget(r)
        return True

    def _end_transfer(self, r: DecodeRequest) -> None:
        """The transfer is no longer wanted: the registry drops its staging, late bytes are refused."""
        if self.by_transfer.pop(r.transfer_id, None) is not None:
            self.pending.cancel(r.transfer_id)

    def _forget(self, r: DecodeRequest) -> None:
        if self.requests.get(r.request_id) is r:
            del self.requests[r.request_id]
        self.by_transfer.pop(r.transfer_id, None)
        self.engine.close_stream(r.request_id)

    # -- streaming ----------------------------------------------------------------------------
    async def stream(self, rid: str, timeout_ms: int):
        r = self.requests.get(rid)
        if r is None:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, f"request {rid!r} is not admitted here")
        if r.attached:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} already has a stream")
        r.attached = True
        async for chunk in self._relay(r, timeout_ms):
            yield chunk

    async def generate(self, req: decode_pb2.WorkerGenerateRequest):
        """Colocated: the whole request here, no transfer."""
        self.check_accepting()
        if self.cfg.role != "colocated":
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               "Generate is served by colocated workers; this one is a decode worker")
        rid = req.request_id or uuid.uuid4().hex
        if rid in self.requests:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is already running here")
        prompt, params = list(req.prompt_token_ids), sampling_from_proto(req.sampling)
        self.llm.validate(prompt, params)
        queue, _ = await self.engine.add(rid, prompt, params, images=images_from_proto(req.images))
        r = DecodeRequest(rid, "", None, queue, attached=True)
        self.requests[rid] = r
        async for chunk in self._relay(r, req.timeout_ms):
            yield chunk

    async def _relay(self, r: DecodeRequest, timeout_ms: int):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_ms / 1000 if timeout_ms else math.inf
        finished = False
        first = True
        try:
            while not finished:
                item = await self._next_output(r, deadline - loop.time())
                finished = item.finished
                if finished:
                    self.metrics.requests.labels(self.metrics.model, item.finish_reason or "stop").inc()
                yield chunk_from_output(item, self._handover(r) if first else 0.0)
                first = False
        finally:
            self.requests_served += 1
            if not finished:        # cancelled, deadline, failure: free everything, once
                self.engine.abort(r.request_id)
                self._end_transfer(r)
            self._forget(r)

    async def _next_output(self, r: DecodeRequest, remaining: float):
        wait = min(remaining, STREAM_IDLE_LIMIT_S)
        try:
            if wait <= 0:
                raise TimeoutError
            item = await asyncio.wait_for(r.queue.get(), wait)
        except TimeoutError:
            if wait < remaining:
                raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"request {r.request_id}: the decode engine produced "
                                   f"no token for {STREAM_IDLE_LIMIT_S:.0f}s") from None
            raise TimeoutError(f"request {r.request_id} passed its client's deadline while decoding") from None
        if isinstance(item, KVFailed):
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"KV handover failed: {item}")
        if isinstance(item, _Aborted):
            raise ServiceError(grpc.StatusCode.ABORTED, f"request {r.request_id} aborted: {item}")
        if isinstance(item, EngineDead):
            raise ServiceError(grpc.StatusCode.INTERNAL, f"decode engine failed: {item}")
        if item.error:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"KV handover failed: {item.error}")
        return item

    def _handover(self, r: DecodeRequest) -> float:
        """The prefill's last forward -> this request's first decode step (its join)."""
        if r.ticket is None or r.ticket.joined_at is None or not r.prefill_done_unix:
            return 0.0
        seconds = max(0.0, r.ticket.joined_at - r.prefill_done_unix)
        self.metrics.handover.observe(seconds)
        return seconds


class KVFailed(Exception):
    """The request's KV never arrived intact; carried through its stream queue."""


class _Aborted(Exception):
    pass


def _float(x) -> float | None:
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    """Thin: decode the request, call the worker, encode the reply."""

    def __init__(self, worker: DecodeWorker):
        self.w = worker

    async def Admit(self, request, context):
        return await self.w.admit(request)

    async def Stream(self, request, context):
        async for chunk in self.w.stream(request.request_id, request.timeout_ms):
            yield chunk

    async def Generate(self, request, context):
        async for chunk in self.w.generate(request):
            yield chunk

    async def Abort(self, request, context):
        return worker_pb2.WorkerAbortResponse(found=self.w.abort_request(request.request_id))

    async def GetStatus(self, request, context):
        return self.w.status()


__all__ = ["DecodeHandoff", "DecodeWorker"]
