"""The sending half of the KV plane, in an engine core (serving/worker/engine_core.py): a prompt run
here with its KV pushed to the decode worker the router chose (`cmd_prefill`), the senders
warmed before any request needs them (`cmd_connect`), and a running stream's KV packed and
pushed to the worker that takes it over (`cmd_pause`, `cmd_export`: a role switch moves streams
so). The prefill worker's core is this (prefill_service/core.py); the decode worker's is this
too, with the receiving half (decode_service/core.py): so a worker can change role in place.

One pipeline whatever the KV backend: the transfer opens when the request is queued, so
the decode worker stages it while the prefill runs; after each prefill step the engine packs
the prompt blocks that step made final (`KVPiece`, through `PrefillHandoff`) and they go out
at once, overlapping the next chunk's compute; the last piece carries the first token.
Nothing is held past the prefill: the request's `KVTicket` goes QUEUED -> PREFILLING ->
PREFILLED (its blocks freed, still prefix-cached) -> SENT, or FREED / FAILED on the way.

Abort, deadline or a failed push ends the request with a status and nothing held; an open
transfer is abandoned, so the decode worker frees its blocks at once.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import replace

import grpc

from baton.engine.async_engine import EngineDead
from baton.engine.kv_handoff import KVHandoff, KVPiece, KVState, KVTicket
from baton.engine.kv_proof import seal
from baton.engine.output_processor import RequestOutput
from baton.engine.requests.sampling_params import SamplingParams
from baton.kvtransfer import registry
from baton.kvtransfer.backend import (
    KVSender,
    KVTransferError,
    OutgoingTransfer,
    SendStats,
    TransferDescriptor,
)
from baton.kvtransfer.grpc_options import channel_options
from baton.kvtransfer.peer_auth import KVPeerAuth
from baton.models.multimodal import ImageInput
from baton.serving.grpc_server import ServiceError, open_channel
from baton.serving.worker.engine_core import EngineCore

log = logging.getLogger("baton.kv_push")
DROPPED_REMEMBERED = 256        # requests whose late KV was dropped, remembered to say so once each
EXPORT_HOLD_S = 60.0            # a paused stream's packed KV waits this long for its Export, then goes


class PrefillHandoff(KVHandoff):
    """The prefill worker's half of the engine's seam: each piece goes to its request's
    transfer on the event loop (the engine thread only queues it).

    Packed pieces live in device memory outside the KV cache until they are sent, so their
    bytes are bounded (`limit`, --kv-buffer-mib): past it the engine starts no new prompt
    (`may_admit`) until sends drain them; prompts already running go on. A decode side slow
    to take KV thus holds prompts in this worker's queue, not in its memory."""

    def __init__(self):
        self.loop: asyncio.AbstractEventLoop | None = None
        self.wake = lambda: None                 # the engine's: step now (set by the core)
        self.sinks: dict[str, asyncio.Queue] = {}
        self.dropped: dict[str, None] = {}      # (insertion-ordered: the oldest goes first)
        self.limit = registry.BUFFER_MIB << 20
        self.unsent: dict[str, int] = {}        # request id -> bytes packed and not yet sent
        self.unsent_bytes = 0
        self.holding = False
        self.holds = 0                          # times new prompts were held (each logged once)
        self._lock = threading.Lock()           # the engine thread adds, the event loop subtracts

    def open(self, rid: str) -> asyncio.Queue:
        """The queue `rid`'s pieces will arrive on, until `forget(rid)`."""
        with self._lock:
            sink = self.sinks[rid] = asyncio.Queue()
        return sink

    def on_prompt_kv(self, piece: KVPiece) -> None:
        rid = piece.request_id
        with self._lock:               # one step with forget(): a piece is either counted and
            sink = self.sinks.get(rid)  # settled by it, or dropped here, never counted after it
            if sink is not None:
                self.unsent[rid] = self.unsent.get(rid, 0) + _nbytes(piece.data)
                self.unsent_bytes += _nbytes(piece.data)
        if sink is None:
            self._drop(rid)
            return
        self.loop.call_soon_threadsafe(sink.put_nowait, piece)

    def may_admit(self) -> bool:
        admit = self.unsent_bytes < self.limit
        if not admit and not self.holding:
            self.holds += 1
            log.info("%d MiB of packed KV waits to be sent (the bound is %d MiB, --kv-buffer-mib): new prompts "
                     "wait here until the decode side takes it", self.unsent_bytes >> 20, self.limit >> 20)
        self.holding = not admit
        return admit

    def sent(self, rid: str, piece: KVPiece) -> None:
        """`piece` of `rid` has gone out (its bytes are the backend's now)."""
        self._settle(rid, _nbytes(piece.data))

    def forget(self, rid: str) -> None:
        """`rid` ended: its queue closes, and whatever of it was packed and not sent is dropped
        with it."""
        self._settle(rid, None)

    def _settle(self, rid: str, nbytes: int | None) -> None:
        with self._lock:
            if nbytes is None:
                self.sinks.pop(rid, None)
            held = self.unsent.pop(rid, 0)
            freed = held if nbytes is None else min(nbytes, held)
            if held - freed > 0:
                self.unsent[rid] = held - freed
            was_full = self.unsent_bytes >= self.limit
            self.unsent_bytes -= freed
            drained = was_full and self.unsent_bytes < self.limit
        if drained:
            self.wake()

    def _drop(self, rid: str) -> None:
        """A piece of a request whose prefill ended meanwhile (aborted, timed out, its push failed):
        an expected race, and the request's abort is already on its way to the engine (cmd_prefill
        sends it as it ends), which ends it within a step. So one line, and no exception: the
        engine would log one as a failed hand-off, with its traceback."""
        if rid in self.dropped:
            return
        self.dropped[rid] = None
        if len(self.dropped) > DROPPED_REMEMBERED:
            del self.dropped[next(iter(self.dropped))]
        log.info("request %s was given up while its prompt ran (abort, deadline or failed push): its KV is dropped",
                 rid)


class PushingCore(EngineCore):
    """An engine core that sends KV: prompts it prefills, streams it hands over."""

    def __init__(self, cfg, emit):
        super().__init__(cfg, emit)
        self.handoff = PrefillHandoff()
        self.tasks: dict[str, asyncio.Task] = {}
        self.senders: dict[tuple[str, str], KVSender] = {}     # (decode address, backend) -> sender
        self.channels: dict[tuple[str, str], object] = {}     # ...and the channel this core opened for it
        self.handshakes: dict[tuple[str, str], asyncio.Future] = {}   # ...and its handshake, awaited by all
        self.kv_auth = KVPeerAuth(cfg.kv_secret) if cfg.kv_secret else None
        self.layout = None
        self.exports: dict[str, tuple[KVPiece, asyncio.TimerHandle]] = {}   # paused streams' KV, until Export

    async def start_transport(self) -> None:
        self.handoff.loop = asyncio.get_running_loop()
        self.handoff.wake = self.engine.wake
        free = self.llm.platform.memory_info()[0] if self.llm.runner.device.type != "cpu" else None
        self.handoff.limit = registry.buffer_bytes(self.cfg.kv_options, free)
        self.layout = self.kv_layout()

    async def stop_transport(self) -> None:
        for key in list(self.senders):
            await self._drop_sender(key)

    # -- commands ------------------------------------------------------------------------------
    async def cmd_prefill(self, rid: str, prompt: list[int], params: SamplingParams, images: list[ImageInput],
                          handoff: tuple[str, str, str], timeout: float, skip_blocks: int = 0) -> dict:
        """Prefill `rid` and push its KV to (decode address, transfer id, backend), but for its first
        `skip_blocks` blocks (the decode worker has them); the reply's fields are PrefillResponse's."""
        if rid in self.tasks:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is already prefilling here")
        run = self._run(rid, prompt, images, params, handoff, timeout, skip_blocks)
        task = asyncio.ensure_future(asyncio.wait_for(run, timeout))
        self.tasks[rid] = task
        try:
            return await task
        except TimeoutError:
            raise TimeoutError(f"prefill of {rid} did not finish within {timeout:.1f}s") from None
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():      # our caller went away: so do we
                raise
            raise ServiceError(grpc.StatusCode.ABORTED, f"prefill of {rid} aborted") from None
        finally:
            self.tasks.pop(rid, None)
            self.engine.abort(rid)           # no-op when it completed

    async def cmd_connect(self, address: str, backend: str, timeout: float) -> dict:
        """Warm the sender to a decode worker before any request needs it (the router asks once a
        pair is healthy): the channel, the handshake and the backend's one-time set-up (`warm`), so
        the pair's first transfer pays none of it. Moves no request's KV. A sender that exists is
        handshaken again: the peer may have restarted since (a new session, its layout checked)."""
        t0 = time.perf_counter()
        key = (address, backend)
        known = key in self.senders
        try:
            async with asyncio.timeout(timeout):
                sender = await self.sender_for(address, backend, timeout, by="warm-up")
                if known:
                    await sender.handshake(self.layout, timeout)
                await sender.warm(timeout)
        except TimeoutError:
            raise TimeoutError(f"KV warm-up with {address} ({backend}) did not finish within {timeout:g}s") from None
        except KVTransferError as exc:
            if known and registry.spec(backend).drop_sender_on_failure and key in self.senders:
                await self._drop_sender(key)
            raise ServiceError(exc.code, f"KV warm-up with {address} ({backend}) failed: {exc}") from exc
        seconds = time.perf_counter() - t0
        self.metrics.add("kv_warmup_seconds", seconds, backend)
        log.info("KV sender to %s (%s) warm in %.1f ms%s", address, backend, seconds * 1e3,
                 "" if known else " (channel and handshake opened)")
        return {"seconds": seconds, "handshaken": not known}

    async def cmd_abort(self, rid: str) -> bool:
        task = self.tasks.get(rid)
        self.engine.abort(rid)
        if task is not None:
            task.cancel()
        return self._drop_export(rid) or task is not None

    # -- a running stream moving on with its KV (a role switch) ---------------------------------
    async def cmd_pause(self, rid: str) -> dict:
        """Take decoding request `rid` out of the batch with its KV packed (LLMEngine.pause), to wait
        for `cmd_export`; the reply's fields are PauseResponse's. Its blocks are free at once."""
        try:
            taken = await self.engine.call(lambda e: e.pause(rid))
        except KeyError:
            return {"found": False}
        if isinstance(taken, str):
            return {"found": True, "paused": False, "reason": taken}
        piece, tokens = taken
        expire = asyncio.get_running_loop().call_later(EXPORT_HOLD_S, self._drop_export, rid)
        self.exports[rid] = (piece, expire)
        return {"found": True, "paused": True, "output_token_ids": tokens, "num_blocks": piece.num_blocks}

    async def cmd_export(self, rid: str, address: str, transfer_id: str, backend: str, timeout: float) -> dict:
        """Push paused `rid`'s KV to the worker that admitted its continuation (transfer_id); the
        reply's fields are ExportResponse's. The packed copy goes either way."""
        held = self.exports.get(rid)
        if held is None:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, f"request {rid!r} is not paused here (or waited "
                                                          f"over {EXPORT_HOLD_S:.0f}s for its export)")
        piece = held[0]
        self._drop_export(rid)
        t0 = time.perf_counter()
        transfer = TransferDescriptor(transfer_id, nbytes=self.layout.payload_nbytes(piece.num_blocks),
                                      backend=backend)
        try:
            async with asyncio.timeout(timeout):
                outgoing = await (await self.sender_for(address, backend, timeout)).open(transfer, timeout)
                try:
                    await outgoing.piece(await asyncio.to_thread(seal, piece, transfer_id))
                    stats = await outgoing.done()
                except BaseException as exc:
                    outgoing.abandon(f"{exc!r}")
                    raise
        except TimeoutError:
            raise TimeoutError(f"the KV of {rid} did not reach {address} within {timeout:.1f}s") from None
        except KVTransferError as exc:
            raise self._push_failed(address, backend, exc) from exc
        seconds = time.perf_counter() - t0
        self.metrics.add("kv_transfer_bytes", stats.nbytes, "out")
        self.metrics.add("kv_transfer_seconds", seconds)
        return {"transfer_bytes": stats.nbytes, "transfer_seconds": seconds}

    def _drop_export(self, rid: str) -> bool:
        held = self.exports.pop(rid, None)
        if held is not None:
            held[1].cancel()
        return held is not None

    # -- one request ---------------------------------------------------------------------------
    async def _run(self, rid: str, prompt: list[int], images: list[ImageInput], params, handoff: tuple[str, str, str],
                   timeout: float, skip_blocks: int = 0) -> dict:
        address, transfer_id, backend = handoff
        t0 = time.perf_counter()
        bs = self.llm.config.block_size
        pieces = self.handoff.open(rid)
        num_blocks = -(-len(prompt) // bs) - skip_blocks
        transfer = TransferDescriptor(transfer_id, nbytes=self.layout.payload_nbytes(num_blocks),
                                      num_tokens=len(prompt) - skip_blocks * bs, backend=backend)
        streaming = asyncio.ensure_future(self._stream(address, transfer, pieces, timeout))
        prefill = asyncio.ensure_future(self._prefill(rid, prompt, images, params, skip_blocks))
        try:
            await asyncio.wait({streaming, prefill}, return_when=asyncio.FIRST_COMPLETED)
            if streaming.done() and streaming.exception() is not None:
                raise streaming.exception()   # refused or broken: no point finishing the prefill
            out, ticket = await prefill
            t1 = time.perf_counter()
            try:
                stats = await (await streaming).done()
            except KVTransferError:
                ticket.try_advance(KVState.FAILED)
                raise
            ticket.advance(KVState.SENT)
        except KVTransferError as exc:
            raise self._push_failed(address, backend, exc) from exc
        finally:
            self.handoff.forget(rid)
            for task in (streaming, prefill):
                task.cancel()
            if streaming.done() and not streaming.cancelled() and streaming.exception() is None:
                streaming.result().abandon("the prefill ended first")   # no-op once finished
        return self._done(out, stats, t0, t1)

    async def _prefill(self, rid: str, prompt: list[int], images: list[ImageInput],
                       params, skip_blocks: int = 0) -> tuple[RequestOutput, KVTicket]:
        """Run the prompt (and its images: the vision encoder runs here) with its KV handed off
        (one token here; the decode worker continues with the request's own limits); returns the
        output carrying the first token, and the request's KV ticket."""
        # (min_tokens: the first token is masked alike, whatever it is past 1)
        here = replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1), stop=[])
        queue, ticket = await self.engine.add(rid, prompt, here, images=images, hand_off_kv=True,
                                              skip_blocks=skip_blocks)
        try:
            out = await queue.get()
        finally:
            self.engine.close_stream(rid)
        if isinstance(out, EngineDead):
            raise ServiceError(grpc.StatusCode.INTERNAL, f"prefill engine failed: {out}")
        if out.error:
            raise ServiceError(grpc.StatusCode.INTERNAL, f"prefill of {rid} failed: {out.error}")
        return out, ticket

    async def _stream(self, address: str, transfer: TransferDescriptor, pieces: asyncio.Queue,
                      timeout: float) -> OutgoingTransfer:
        """Open the transfer and send every piece the engine hands over, up to the last (with the
        first token); the caller waits for the decode worker's word."""
        sender = await self.sender_for(address, transfer.backend, timeout)
        outgoing = await sender.open(transfer, timeout)
        try:
            while not outgoing.token_sent:
                piece = await pieces.get()
                if piece.last:          # its epoch and checksum (engine/kv_proof.py), once the device made it
                    piece = await asyncio.to_thread(seal, piece, transfer.transfer_id)
                await outgoing.piece(piece)
                self.handoff.sent(piece.request_id, piece)
        except BaseException as exc:
            outgoing.abandon(f"{exc!r}" if not isinstance(exc, asyncio.CancelledError) else "prefill aborted")
            raise
        return outgoing

    async def sender_for(self, address: str, backend: str, timeout: float, by: str = "request") -> KVSender:
        """The handshaken sender to a decode worker; concurrent first requests share one handshake.
        `by`: what needs it ("request", or "warm-up": cmd_connect), counted when it is opened here."""
        key = (address, backend)
        sender = self.senders.get(key)
        if sender is None:       # over TLS (mutual, with our certificate) when this worker runs TLS
            self.metrics.add("kv_handshakes", 1, backend, by)
            channel = open_channel(address, self.cfg.tls, options=channel_options())
            sender = registry.make_sender(backend, registry.SenderContext(
                address, channel, self.llm.platform, self.kv_auth, self.cfg.kv_options))
            self.senders[key], self.channels[key] = sender, channel
            self.handshakes[key] = asyncio.ensure_future(sender.handshake(self.layout))
            self.handshakes[key].add_done_callback(_retrieve)
        try:
            await asyncio.wait_for(asyncio.shield(self.handshakes[key]), timeout)   # mismatch: a clear error
        except BaseException:
            if self.senders.get(key) is sender:
                await self._drop_sender(key)
            raise
        return sender

    def _push_failed(self, address: str, backend: str, exc: KVTransferError) -> ServiceError:
        self.metrics.add("kv_transfer_failures", 1, "send")
        # most senders are dropped (the next request handshakes afresh); a direct one carries other
        # transfers on its pair, and closes and reconnects the pair by itself when it breaks
        if registry.spec(backend).drop_sender_on_failure and (address, backend) in self.senders:
            asyncio.ensure_future(self._drop_sender((address, backend)))
        return ServiceError(getattr(exc, "code", None) or grpc.StatusCode.UNAVAILABLE,
                            f"KV push to {address} failed: {exc}")

    def _done(self, out: RequestOutput, stats: SendStats, t0: float, t1: float) -> dict:
        """`t1`: when the prefill ended; the transfer time reported is what came after it."""
        t2 = time.perf_counter()
        self.metrics.add("kv_transfer_bytes", stats.nbytes, "out")
        self.metrics.add("kv_transfer_seconds", t2 - t1)
        return {"first_token": out.new_token_ids[0], "cached_prompt_tokens": out.cached_tokens,
                "prefill_seconds": t1 - t0, "transfer_seconds": t2 - t1, "transfer_bytes": stats.nbytes}

    def _drop_sender(self, key: tuple[str, str]):
        """Forget a sender now (the next request handshakes afresh); returns the coroutine that
        closes it and the channel this core opened for it."""
        handshake = self.handshakes.pop(key, None)
        if handshake is not None and not handshake.done():
            handshake.cancel()
        return _close(self.senders.pop(key, None), self.channels.pop(key, None))


def _nbytes(data) -> int:
    """A packed piece's bytes (a uint8 tensor, or bytes on the CPU path)."""
    return int(getattr(data, "nbytes", None) or len(data))


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


async def _close(sender: KVSender | None, channel) -> None:
    if sender is not None:
        await sender.close()
    if channel is not None:
        await channel.close()
