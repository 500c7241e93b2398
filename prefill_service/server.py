"""The prefill worker: runs prompts in continuous batches (prefix cache, chunked prefill),
samples each request's first token, and pushes its KV to the decode worker the router chose.

Per request, grpc backend: QUEUED -> PREFILLED (first token, KV held) -> TRANSFERRING ->
done; the KV is staged to host memory right after prefill, so its device blocks are released
at once and stay in the prefix cache.

Direct backend (device to device), streamed: the transfer opens when the request is queued,
so the decode worker stages it while the prefill runs. After each prefill step the engine
packs the prompt blocks that step made final into a device buffer (on its own stream, no
wait) and the sender sends them at once, overlapping the next chunk's compute; the first
token goes with the last piece. No block is held past the prefill.

Abort, deadline or a failed push ends the request with a status and nothing held; a streamed
transfer is abandoned, so the decode worker frees its blocks at once.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import grpc

from baton.engine.async_engine import EngineDead
from baton.engine.kv_blocks import pack_blocks, pack_blocks_on_device
from baton.engine.llm_engine import LLMEngine
from baton.kvtransfer.backend import KVSender, TransferDescriptor
from baton.kvtransfer.direct_backend import DirectKVSender, OutgoingTransfer, record_ready
from baton.kvtransfer.grpc_backend import GrpcKVSender, KVTransferError
from baton.kvtransfer.grpc_options import channel_options
from baton.kvtransfer.layout import KVLayout
from baton.kvtransfer.peer_auth import KVPeerAuth
from baton.serving.grpc_server import ServiceError, open_channel
from baton.serving.wire import sampling_from_proto
from baton.serving.worker import EngineWorker
from baton.v1 import prefill_pb2, prefill_pb2_grpc, worker_pb2

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
        if self.cfg.kv_backend == "direct":
            return await self._run_streamed(rid, prompt, params, handoff, timeout)
        t0 = time.perf_counter()
        out = await self._prefill(rid, prompt, params, hold_kv=True)
        first_token = out.new_token_ids[0]
        prefill_done = time.time()
        try:
            payload = await self.engine.call(lambda e: self._stage(e, rid))
            t1 = time.perf_counter()
            sender = await self.sender_for(handoff.decode_address, timeout)
            stats = await sender.send(handoff.transfer_id, payload, first_token,
                                      {"prefill_done_unix": repr(prefill_done), "request_id": rid}, timeout)
        except KVTransferError as exc:
            raise self._push_failed(handoff, exc) from exc
        return self._done(out, stats, t0, t1)

    async def _prefill(self, rid, prompt, params, hold_kv: bool, on_kv=None):
        """Run the prompt (one token here; the decode worker continues with the request's own
        limits); returns the engine's output carrying the first token."""
        queue = self.engine.open_stream(rid)
        try:
            first_params = replace(params, max_tokens=1, stop=[])
            await self.engine.call(lambda e: e.add_request(prompt, first_params, request_id=rid, hold_kv=hold_kv,
                                                           on_kv=on_kv))
            out = await queue.get()
            if isinstance(out, EngineDead):
                raise ServiceError(grpc.StatusCode.INTERNAL, f"prefill engine failed: {out}")
            return out
        finally:
            self.engine.close_stream(rid)

    async def _run_streamed(self, rid, prompt, params, handoff, timeout) -> prefill_pb2.PrefillResponse:
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue = asyncio.Queue()
        kv, device = self.llm.runner.kv_cache, self.llm.runner.device
        num_blocks = -(-len(prompt) // self.llm.block_manager.block_size)

        def on_kv(first_block: int, block_ids: list[int], first_token: int | None) -> None:   # engine thread
            # the last piece carries the first token and when the prompt's last forward ended
            extra = None if first_token is None else {"prefill_done_unix": repr(time.time()), "request_id": rid}
            try:
                item = (pack_blocks_on_device(kv, block_ids), len(block_ids), record_ready(device), first_token, extra)
            except Exception as exc:
                item = KVTransferError(f"packing the KV of {rid} failed: {exc}", grpc.StatusCode.INTERNAL)
            loop.call_soon_threadsafe(pieces.put_nowait, item)

        transfer = TransferDescriptor(handoff.transfer_id, nbytes=self.layout.payload_nbytes(num_blocks),
                                      num_tokens=len(prompt), backend="direct")
        streaming = asyncio.ensure_future(self._stream(handoff.decode_address, transfer, pieces, timeout))
        prefill = asyncio.ensure_future(self._prefill(rid, prompt, params, hold_kv=False, on_kv=on_kv))
        try:
            await asyncio.wait({streaming, prefill}, return_when=asyncio.FIRST_COMPLETED)
            if streaming.done() and streaming.exception() is not None:
                raise streaming.exception()   # refused or broken: no point finishing the prefill
            out = await prefill
            t1 = time.perf_counter()
            outgoing = await streaming
            if outgoing.token_sent:
                stats = await outgoing.done()
            else:                             # the engine passed no token with the last blocks
                stats = await outgoing.finish(out.new_token_ids[0], {"prefill_done_unix": repr(time.time()),
                                                                     "request_id": rid})
        except KVTransferError as exc:
            raise self._push_failed(handoff, exc) from exc
        finally:
            for task in (streaming, prefill):
                task.cancel()
            if streaming.done() and not streaming.cancelled() and streaming.exception() is None:
                streaming.result().abandon("the prefill ended first")   # no-op once finished
        return self._done(out, stats, t0, t1)

    async def _stream(self, address: str, transfer: TransferDescriptor, pieces: asyncio.Queue,
                      timeout: float) -> OutgoingTransfer:
        """Open the transfer and send every piece the engine hands over, the last one with the
        first token; the caller waits for the decode worker's word."""
        sender = await self.sender_for(address, timeout)
        outgoing = await sender.open(transfer, timeout)
        try:
            while outgoing.next_block < outgoing.num_blocks:
                item = await pieces.get()
                if isinstance(item, BaseException):
                    raise item
                await outgoing.piece(*item)
        except BaseException as exc:
            outgoing.abandon(f"{exc!r}" if not isinstance(exc, asyncio.CancelledError) else "prefill aborted")
            raise
        return outgoing

    def _push_failed(self, handoff, exc: KVTransferError) -> ServiceError:
        self.metrics.kv_transfer_failures.labels("send").inc()
        # a grpc sender is dropped (the next request handshakes afresh); a direct one carries other
        # transfers on its pair, and closes and reconnects the pair by itself when it breaks
        if not isinstance(self.senders.get(handoff.decode_address), DirectKVSender):
            stale = self.senders.pop(handoff.decode_address, None)
            if stale is not None:
                asyncio.ensure_future(_close_sender(stale))
        return ServiceError(getattr(exc, "code", None) or grpc.StatusCode.UNAVAILABLE,
                            f"KV push to {handoff.decode_address} failed: {exc}")

    def _done(self, out, stats, t0: float, t1: float) -> prefill_pb2.PrefillResponse:
        """`t1`: when the prefill ended; the transfer time reported is what came after it."""
        t2 = time.perf_counter()
        self.metrics.kv_transfer_bytes.labels("out").inc(stats.nbytes)
        self.metrics.kv_transfer_seconds.observe(t2 - t1)
        return prefill_pb2.PrefillResponse(first_token=out.new_token_ids[0], cached_prompt_tokens=out.cached_tokens,
                                           prefill_seconds=t1 - t0, transfer_seconds=t2 - t1,
                                           transfer_bytes=stats.nbytes)

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
