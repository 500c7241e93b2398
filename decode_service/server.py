"""The decode worker: admits requests whose KV a prefill worker will push, joins them into
its continuously batched decode loop, and streams their tokens.

Per request: ADMITTED (blocks reserved, KV expected by a deadline) -> JOINED (running) ->
finished; any failure, abort, cancel or deadline frees its blocks. With role "colocated"
the same server also runs whole requests itself (`Generate`), with no transfer.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import grpc

from baton.engine.async_engine import EngineDead
from baton.engine.kv_blocks import unpack_blocks
from baton.engine.llm_engine import LLMEngine
from baton.engine.output_processor import RequestOutput
from baton.engine.sampling_params import SamplingParams
from baton.kvtransfer.direct_backend import DirectKVReceiver
from baton.kvtransfer.grpc_backend import KVTransferServicer
from baton.kvtransfer.layout import KVLayout
from baton.kvtransfer.peer_auth import KVPeerAuth
from baton.kvtransfer.receiver import PendingTransfers
from baton.serving.grpc_server import ServiceError
from baton.serving.wire import chunk_from_output, sampling_from_proto
from baton.serving.worker import EngineWorker
from baton.v1 import decode_pb2, decode_pb2_grpc, worker_pb2

DEFAULT_ADMIT_TIMEOUT_S = 60.0
STREAM_IDLE_LIMIT_S = 600.0


@dataclass(slots=True)
class DecodeRequest:
    request_id: str
    transfer_id: str
    prompt: list[int]
    params: SamplingParams
    deadline: float                      # loop clock; the KV must arrive before it
    queue: asyncio.Queue
    attached: bool = False
    prefill_done_unix: float | None = None    # the prefill worker's clock at its last forward
    handover_seconds: float = 0.0             # -> joined into the running batch here


class KVFailed(Exception):
    """The request's KV never arrived intact; carried through its stream queue."""

    def __init__(self, reason: str):
        super().__init__(reason)


class DecodeWorker(EngineWorker):
    service_names = ("baton.v1.Decode", "baton.v1.KVTransfer")

    def __init__(self, cfg):
        super().__init__(cfg)
        if cfg.kv_backend == "direct":
            self.service_names = (*self.service_names, "baton.v1.KVDirect")
        self.requests: dict[str, DecodeRequest] = {}
        self.by_transfer: dict[str, str] = {}
        self.reserved: dict[str, list[int]] = {}     # engine thread only: request -> blocks awaiting KV
        self.pending = PendingTransfers()
        self.layout: KVLayout | None = None
        self.direct: DirectKVReceiver | None = None

    def add_services(self, server) -> None:
        decode_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(self), server)
        self.layout = self.kv_layout()
        auth = KVPeerAuth(self.cfg.kv_secret) if self.cfg.kv_secret else None
        KVTransferServicer(self.pending, self.layout, auth=auth).add_to_server(server)
        if self.cfg.kv_backend == "direct":     # descriptors here, bytes device to device
            store_host = (self.cfg.kv_advertise or "").rpartition(":")[0] or self.cfg.host
            self.direct = DirectKVReceiver(self.pending, self.llm.runner.device, self.layout.payload_nbytes(1),
                                           store_host, auth=auth)
            self.direct.add_to_server(server)

    def num_pending(self) -> int:
        return len(self.by_transfer)

    def release_transports(self) -> None:
        if self.direct is not None:
            self.direct.close_pairs()

    def num_active(self) -> int:
        return len(self.requests)

    # -- engine-thread commands (they touch engine state) -----------------------------------
    def _reserve(self, llm: LLMEngine, request_id: str, num_tokens: int) -> list[int]:
        blocks = llm.reserve_blocks(num_tokens)
        self.reserved[request_id] = blocks
        return blocks

    def _join(self, llm: LLMEngine, r: DecodeRequest, payload, first_token: int) -> RequestOutput:
        blocks = self.reserved.pop(r.request_id, None)
        if blocks is None:
            raise KVFailed("request was aborted before its KV arrived")
        try:
            unpack_blocks(llm.runner.kv_cache, blocks, payload)
        except Exception:
            llm.free_blocks(blocks)
            raise
        out = llm.join(r.request_id, r.prompt, first_token, r.params, blocks)
        if r.prefill_done_unix:              # the engine's next step is the request's first decode step
            r.handover_seconds = max(0.0, time.time() - r.prefill_done_unix)
            self.metrics.handover.observe(r.handover_seconds)
        return out

    def _abort(self, llm: LLMEngine, request_id: str) -> bool:
        blocks = self.reserved.pop(request_id, None)
        if blocks is not None:
            llm.free_blocks(blocks)
        return llm.abort(request_id) is not None or blocks is not None

    # -- admission and handover ---------------------------------------------------------------
    async def admit(self, req: decode_pb2.AdmitRequest) -> decode_pb2.AdmitResponse:
        self.check_accepting()
        rid = req.request_id
        if not rid:
            raise ValueError("request_id is required")
        if rid in self.requests:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is already admitted here")
        if req.backend and req.backend not in self.layout.backends:
            raise ValueError(f"KV backend {req.backend!r} not supported here; this worker accepts "
                             f"{self.layout.backends}")
        prompt = list(req.prompt_token_ids)
        params = sampling_from_proto(req.sampling)
        self.llm.validate(prompt, params)
        timeout = req.timeout_ms / 1000 if req.timeout_ms else DEFAULT_ADMIT_TIMEOUT_S
        loop = asyncio.get_running_loop()
        r = DecodeRequest(rid, uuid.uuid4().hex, prompt, params, loop.time() + timeout,
                          self.engine.open_stream(rid))
        self.requests[rid] = r
        try:
            blocks = await self.engine.call(lambda e: self._reserve(e, rid, len(prompt)))
        except BaseException:
            self._forget(r)
            self.engine.submit(lambda e: self._abort(e, rid))   # in case it ran after a timeout
            raise
        self.by_transfer[r.transfer_id] = rid
        self.pending.expect(r.transfer_id, self.layout.payload_nbytes(len(blocks)), timeout,
                            self._on_kv_complete, self._on_kv_fail)
        loop.call_later(timeout, self._expire_unattached, rid, r.transfer_id)
        return decode_pb2.AdmitResponse(transfer_id=r.transfer_id, num_blocks=len(blocks),
                                        kv_address=self.cfg.kv_advertise or self.server.address)

    def _on_kv_complete(self, transfer_id: str, payload, first_token: int, extra: dict) -> None:
        rid = self.by_transfer.pop(transfer_id, None)
        r = self.requests.get(rid) if rid else None
        if r is None:
            return
        r.prefill_done_unix = _float(extra.get("prefill_done_unix"))
        if r.prefill_done_unix:
            self.metrics.kv_landed.observe(max(0.0, time.time() - r.prefill_done_unix))
        nbytes = len(payload)
        self.metrics.kv_transfer_bytes.labels("in").inc(nbytes)

        def join(llm: LLMEngine):
            try:
                out = self._join(llm, r, payload, first_token)
            except Exception as exc:
                self.engine.loop.call_soon_threadsafe(
                    r.queue.put_nowait, KVFailed(f"could not join the transferred KV: {exc}"))
                return
            self.engine.deliver(out)
        self.engine.submit(join)         # queued now, not a loop turn later: the engine joins it between steps

    def _on_kv_fail(self, transfer_id: str, reason: str) -> None:
        rid = self.by_transfer.pop(transfer_id, None)
        if rid is None:
            return
        self.metrics.kv_transfer_failures.labels("receive").inc()
        self.engine.submit(lambda e: self._abort(e, rid))
        r = self.requests.get(rid)
        if r is not None:
            r.queue.put_nowait(KVFailed(reason))

    def _expire_unattached(self, rid: str, transfer_id: str) -> None:
        """Nobody opened the stream in time (router gone): reclaim everything."""
        r = self.requests.get(rid)
        if r is not None and r.transfer_id == transfer_id and not r.attached:
            self.abort_request(rid, "no stream attached before the admission deadline")

    def abort_request(self, rid: str, reason: str = "aborted") -> bool:
        r = self.requests.get(rid)
        if r is not None and r.transfer_id in self.by_transfer:
            self.by_transfer.pop(r.transfer_id, None)
            self.pending.cancel(r.transfer_id)
        self.engine.submit(lambda e: self._abort(e, rid))
        if r is not None:
            r.queue.put_nowait(_Aborted(reason))
            if not r.attached:
                self._forget(r)
        return r is not None

    def _forget(self, r: DecodeRequest) -> None:
        if self.requests.get(r.request_id) is r:
            del self.requests[r.request_id]
        self.by_transfer.pop(r.transfer_id, None)
        self.engine.close_stream(r.request_id)

    # -- streaming ----------------------------------------------------------------------------
    async def stream(self, rid: str, timeout_ms: int, context):
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
        loop = asyncio.get_running_loop()
        r = DecodeRequest(rid, "", prompt, params, loop.time(), self.engine.open_stream(rid), attached=True)
        self.requests[rid] = r
        try:
            await self.engine.call(lambda e: e.add_request(prompt, params, request_id=rid))
        except BaseException:
            self._forget(r)
            raise
        async for chunk in self._relay(r, req.timeout_ms):
            yield chunk

    async def _relay(self, r: DecodeRequest, timeout_ms: int):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout_ms / 1000 if timeout_ms else STREAM_IDLE_LIMIT_S)
        finished = False
        first = True
        try:
            while not finished:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise TimeoutError(f"request {r.request_id} passed its deadline while decoding")
                try:
                    item = await asyncio.wait_for(r.queue.get(), remaining)
                except asyncio.TimeoutError:
                    raise TimeoutError(f"request {r.request_id} passed its deadline while decoding") from None
                if isinstance(item, KVFailed):
                    raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"KV handover failed: {item}")
                if isinstance(item, _Aborted):
                    raise ServiceError(grpc.StatusCode.ABORTED, f"request {r.request_id} aborted: {item}")
                if isinstance(item, EngineDead):
                    raise ServiceError(grpc.StatusCode.INTERNAL, f"decode engine failed: {item}")
                finished = item.finished
                if finished:
                    self.metrics.requests.labels(item.finish_reason or "stop").inc()
                yield chunk_from_output(item, r.handover_seconds if first else 0.0)
                first = False
        finally:
            self.requests_served += 1
            if not finished:        # cancelled, deadline, failure: free everything, once
                self.engine.submit(lambda e: self._abort(e, r.request_id))
                if r.transfer_id in self.by_transfer:
                    self.by_transfer.pop(r.transfer_id, None)
                    self.pending.cancel(r.transfer_id)
            self._forget(r)


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
        async for chunk in self.w.stream(request.request_id, request.timeout_ms, context):
            yield chunk

    async def Generate(self, request, context):
        async for chunk in self.w.generate(request):
            yield chunk

    async def Abort(self, request, context):
        return worker_pb2.WorkerAbortResponse(found=self.w.abort_request(request.request_id))

    async def GetStatus(self, request, context):
        return self.w.status()
