"""The prefill worker: runs prompts in continuous batches (prefix cache, chunked prefill),
samples each request's first token, and pushes its KV to the decode worker the router chose.

Per request: QUEUED -> PREFILLED (first token, KV held) -> TRANSFERRING -> done. The KV is
staged to host memory right after prefill (grpc backend), so its device blocks are released
at once and stay in the prefix cache. With the direct backend the blocks stay held until the
decode worker has posted its receive; the sender then packs them on its own device stream
and sends them device to device, and they are released when the send ends. Abort, deadline
or a failed push ends the request with a status and nothing held.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import grpc
from baton.v1 import prefill_pb2, prefill_pb2_grpc, worker_pb2

from engine.async_engine import EngineDead
from engine.grpc_server import ServiceError, open_channel
from engine.llm_engine import LLMEngine
from engine.wire import sampling_from_proto
from engine.worker import EngineWorker
from kvtransfer.backend import KVSender, TransferDescriptor
from kvtransfer.blocks import pack_blocks
from kvtransfer.direct_backend import DirectKVSender, HeldBlocks
from kvtransfer.grpc_backend import GrpcKVSender, KVTransferError
from kvtransfer.grpc_options import channel_options
from kvtransfer.layout import KVLayout
from kvtransfer.peer_auth import KVPeerAuth

DEFAULT_TIMEOUT_S = 120.0


class PrefillWorker(EngineWorker):
    service_names = ("baton.v1.Prefill",)

    def __init__(self, cfg):
        super().__init__(cfg)
        self.tasks: dict[str, asyncio.Task] = {}
        self.senders: dict[str, KVSender] = {}
        self.layout: KVLayout | None = None
        self.kv_auth = KVPeerAuth(cfg.kv_secret) if cfg.kv_secret else None

    def add_services(self, server) -> None:
        self.layout = self.kv_layout()
        prefill_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(self), server)

    def num_active(self) -> int:
        return len(self.tasks)

    def release_transports(self) -> None:
        for sender in self.senders.values():
            if isinstance(sender, DirectKVSender):
                sender.close_pair()

    async def sender_for(self, address: str, timeout: float) -> KVSender:
        sender = self.senders.get(address)
        if sender is None:       # over TLS (mutual, with our certificate) when this worker runs TLS
            channel = open_channel(address, self.cfg.tls, options=channel_options())
            if self.cfg.kv_backend == "direct":
                sender = DirectKVSender(channel, address, self.llm.runner.device, auth=self.kv_auth)
            else:
                sender = GrpcKVSender(channel, auth=self.kv_auth)
            await asyncio.wait_for(sender.handshake(self.layout), timeout)   # mismatch: clear error
            self.senders[address] = sender
        return sender

    async def prefill(self, req: prefill_pb2.PrefillRequest) -> prefill_pb2.PrefillResponse:
        self.check_accepting()
        rid = req.request_id
        if not rid:
            raise ValueError("request_id is required")
        if rid in self.tasks:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is already prefilling here")
        if not req.handoff.decode_address or not req.handoff.transfer_id:
            raise ValueError("handoff.decode_address and handoff.transfer_id are required")
        prompt = list(req.prompt_token_ids)
        params = sampling_from_proto(req.sampling)
        self.llm.validate(prompt, params)
        timeout = req.timeout_ms / 1000 if req.timeout_ms else DEFAULT_TIMEOUT_S
        self.tasks[rid] = asyncio.current_task()
        try:
            return await asyncio.wait_for(self._run(rid, prompt, params, req.handoff, timeout), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"prefill of {rid} did not finish within {timeout:.1f}s") from None
        finally:
            self.requests_served += 1
            self.tasks.pop(rid, None)
            self.engine.submit(lambda e: e.abort(rid))    # no-op when it completed

    async def _run(self, rid, prompt, params, handoff, timeout) -> prefill_pb2.PrefillResponse:
        t0 = time.perf_counter()
        queue = self.engine.open_stream(rid)
        try:
            # one token here; the decode worker continues with the request's own limits
            first_params = replace(params, max_tokens=1, stop=[])
            await self.engine.call(lambda e: e.add_request(prompt, first_params, request_id=rid, hold_kv=True))
            out = await queue.get()
            if isinstance(out, EngineDead):
                raise ServiceError(grpc.StatusCode.INTERNAL, f"prefill engine failed: {out}")
        finally:
            self.engine.close_stream(rid)
        first_token = out.new_token_ids[0]
        prefill_done = time.time()
        direct = self.cfg.kv_backend == "direct"
        try:
            if direct:      # the blocks stay held until the send ends (prefill()'s abort frees them)
                blocks = self._held_blocks(rid)
                nbytes = self.layout.payload_nbytes(len(blocks))
                transfer = TransferDescriptor(handoff.transfer_id, nbytes=nbytes, backend="direct")
                payload = HeldBlocks(self.llm.runner.kv_cache, blocks)
            else:
                payload = await self.engine.call(lambda e: self._stage(e, rid))
                transfer, nbytes = handoff.transfer_id, len(payload)
            t1 = time.perf_counter()
            sender = await self.sender_for(handoff.decode_address, timeout)
            stats = await sender.send(transfer, payload, first_token,
                                      {"prefill_done_unix": repr(prefill_done), "request_id": rid}, timeout)
        except KVTransferError as exc:
            self.metrics.kv_transfer_failures.labels("send").inc()
            stale = self.senders.pop(handoff.decode_address, None)
            if stale is not None:                   # the next request handshakes afresh
                asyncio.ensure_future(_close_sender(stale))
            raise ServiceError(getattr(exc, "code", None) or grpc.StatusCode.UNAVAILABLE,
                               f"KV push to {handoff.decode_address} failed: {exc}") from exc
        t2 = time.perf_counter()
        self.metrics.kv_transfer_bytes.labels("out").inc(stats.nbytes)
        self.metrics.kv_transfer_seconds.observe(t2 - t1)
        return prefill_pb2.PrefillResponse(first_token=first_token, cached_prompt_tokens=out.cached_tokens,
                                           prefill_seconds=t1 - t0, transfer_seconds=t2 - t1,
                                           transfer_bytes=nbytes)

    def _held_blocks(self, rid: str) -> tuple[int, ...]:
        """The KV blocks a prefilled request holds, read from the event loop: held blocks are
        final and stay put until released, so the direct sender packs them on its own stream
        without waiting for the engine's step in flight."""
        seq = self.llm.held.get(rid)
        if seq is None:
            raise ServiceError(grpc.StatusCode.ABORTED, f"request {rid} was aborted during prefill")
        return tuple(seq.block_table)

    @staticmethod
    def _stage(llm: LLMEngine, rid: str):
        """Copy the request's KV blocks to host memory and release them (engine thread)."""
        seq = llm.held.get(rid)
        if seq is None:
            raise ServiceError(grpc.StatusCode.ABORTED, f"request {rid} was aborted during prefill")
        try:
            return pack_blocks(llm.runner.kv_cache, seq.block_table)
        finally:
            llm.release(rid)

    def abort_request(self, rid: str) -> bool:
        task = self.tasks.get(rid)
        self.engine.submit(lambda e: e.abort(rid))
        if task is not None:
            task.cancel()
        return task is not None


async def _close_sender(sender: KVSender) -> None:
    """Release a sender and its channel (the worker opened the channel, so it closes it)."""
    await sender.close()
    await sender.channel.close()


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, worker: PrefillWorker):
        self.w = worker

    async def Prefill(self, request, context):
        return await self.w.prefill(request)

    async def Abort(self, request, context):
        return worker_pb2.WorkerAbortResponse(found=self.w.abort_request(request.request_id))

    async def GetStatus(self, request, context):
        return self.w.status()
