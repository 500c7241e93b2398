"""The decode side of the direct backend: the `baton.v1.KVDirect` service. `Connect` builds a
pair's communicator (this end hosts its rendezvous store); `Session` is the pair's control
stream, on which transfers are multiplexed: OPEN (claim and stage a device buffer) -> READY,
then each PIECE's receive posted on the pair's stream in PIECE order, and once the last
piece's bytes have landed the payload goes to the registry (`PendingTransfers`), which hands
it to the decode engine; DONE or REFUSED goes back.

A transfer that passes its deadline with receives still posted fails (its blocks freed, REFUSED
sent), but the pair stays: the sender posted each send when it announced the PIECE, so a late
send (a busy prefill worker) still completes, into the orphaned buffer. Only receives still
unmatched DRAIN_S later mean the sender never will, and close the pair (an unmatched receive
stalls every later one on its stream).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import grpc
import torch

from baton.engine.platforms import Platform
from baton.engine.runner.kv_blocks import Pieces
from baton.kvtransfer.backend import KVReceiver
from baton.kvtransfer.direct_backend.messages import (
    BACKEND,
    HELLO_TIMEOUT_S,
    MAX_PAIRS,
    PAIR_IDLE_S,
    WILDCARD_HOSTS,
    Ack,
    Code,
    refused,
)
from baton.kvtransfer.direct_backend.outbox import Outbox
from baton.kvtransfer.direct_backend.pair import JOIN_TIMEOUT_S, PairGroup
from baton.kvtransfer.peer_auth import KVPeerAuth, session_of
from baton.kvtransfer.receiver import REMEMBERED_ENDED, PendingTransfers, Transfer, TransferRejected
from baton.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc

log = logging.getLogger("baton.kvtransfer")

DRAIN_S = 10.0              # how long a failed transfer's posted receives may take to be matched


@dataclass(eq=False)
class _Incoming:
    """One transfer open on a control stream (receiver side)."""

    t: Transfer
    num_blocks: int
    ready: bool = False
    next_block: int = 0                  # pieces so far cover [0, next_block)
    parts: list = field(default_factory=list)
    works: list = field(default_factory=list)
    tasks: list = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None


class _Control:
    """The receiver's end of one pair's control stream."""

    def __init__(self, receiver: DirectKVReceiver, pair: PairGroup, context):
        self.r = receiver
        self.pair = pair
        self.context = context
        self.open: dict[str, _Incoming] = {}
        # transfers that ended here -> (block count, their buffer while pieces may still come)
        self.ended: OrderedDict[str, tuple[int, torch.Tensor | None]] = OrderedDict()
        self.outbox = Outbox(self.context.write, lambda acks: Ack(batch=acks), self._write_failed)
        self.draining: set[asyncio.Task] = set()

    def say(self, ack: Ack) -> None:
        self.outbox.put(ack)

    def _write_failed(self, exc: BaseException) -> None:
        # the stream went away: the sender will know, and this stream's handler ends with it
        log.debug("KV pair %s: could not write an ack: %s", self.pair.pair_id, exc)

    def _spawn(self, inc: _Incoming, coro) -> None:
        task = asyncio.ensure_future(coro)
        inc.tasks.append(task)
        task.add_done_callback(inc.tasks.remove)

    def handle(self, msg, batched: bool = False) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "open":
            self.on_open(msg.open)
        elif kind == "piece":
            self.on_piece(msg.piece)
        elif kind == "finish":
            self.on_finish(msg.finish)
        elif kind == "batch" and not batched:
            for m in msg.batch.messages:
                self.handle(m, batched=True)
        elif kind == "abandon":
            tid = msg.abandon.transfer_id
            self.end(tid, f"the prefill worker gave it up: {msg.abandon.reason}", Code.ABORTED)
            if tid in self.ended:            # nothing more comes for it: let its buffer go
                self._remember(tid, self.ended[tid][0], None)
        else:
            raise ProtocolError(f"unexpected control message {kind!r}{' in a batch' if batched else ''}")

    def on_open(self, op) -> None:
        tid, bb = op.transfer_id, self.r.block_bytes
        if tid in self.open or tid in self.ended:
            raise ProtocolError(f"transfer {tid!r} was opened twice on pair {self.pair.pair_id}")
        try:
            t = self.r.pending.lookup(tid)
            if op.total_bytes % bb:
                msg = f"transfer {tid}: {op.total_bytes} bytes is not a whole number of {bb}-byte blocks"
                self.r.pending.fail(tid, msg, Code.INVALID_ARGUMENT)
                raise TransferRejected(Code.INVALID_ARGUMENT, msg)
            self.r.pending.claim(t, op.total_bytes)
        except TransferRejected as exc:
            self._remember(tid, 0, None)
            self.say(refused(tid, exc.code, str(exc)))
            return
        inc = _Incoming(t, op.total_bytes // bb)
        self.open[tid] = inc
        self.pair.in_flight += 1
        inc.timer = asyncio.get_running_loop().call_at(t.deadline, self.overdue, tid)
        self._spawn(inc, self._stage(tid, inc))   # may wait for staging room: never in the reader

    async def _stage(self, tid: str, inc: _Incoming) -> None:
        pending = self.r.pending
        try:
            await pending.stage(inc.t, lambda n: torch.empty(n, dtype=torch.uint8, device=self.r.device))
            pending.check_active(inc.t)
        except TransferRejected as exc:
            self.end(tid, str(exc), exc.code)
            return
        except torch.OutOfMemoryError:
            # the device has less room than the staging limit assumed (a peak of transfers at once): refuse this
            # one as overload, which the router retries, rather than let the error end the pair's control task
            log.warning("no device memory to stage the %d-byte KV of transfer %s (%d bytes staged): refused",
                        inc.t.nbytes, tid, pending.staged_bytes)
            self.end(tid, f"no device memory to stage the KV of transfer {tid}", Code.RESOURCE_EXHAUSTED)
            return
        inc.ready = True
        self.say(Ack(kind=Ack.KIND_READY, transfer_id=tid))

    def on_piece(self, piece) -> None:
        tid, bb = piece.transfer_id, self.r.block_bytes
        inc = self.open.get(tid)
        if inc is None:                      # ended here (cancelled, abandoned): keep the pair in step
            num_blocks, buffer = self.ended.get(tid, (0, None))
            if buffer is None or piece.first_block + piece.num_blocks > num_blocks:
                raise ProtocolError(f"a piece of transfer {tid!r}, which is not open on this pair")
            # into its old buffer, which nothing reads any more (no new device memory)
            self.pair.post_recv(buffer[piece.first_block * bb:(piece.first_block + piece.num_blocks) * bb])
            if piece.first_block + piece.num_blocks == num_blocks:
                self._remember(tid, num_blocks, None)
            return
        if not inc.ready or piece.first_block != inc.next_block or piece.num_blocks < 1 \
                or piece.first_block + piece.num_blocks > inc.num_blocks:
            raise ProtocolError(f"transfer {tid}: a piece of blocks [{piece.first_block}, "
                                f"{piece.first_block + piece.num_blocks}) where [{inc.next_block}, ...) of "
                                f"{inc.num_blocks} was due{'' if inc.ready else ', before READY'}")
        last = piece.HasField("first_token")
        if last and piece.first_block + piece.num_blocks != inc.num_blocks:
            raise ProtocolError(f"transfer {tid}: the first token came with blocks [{piece.first_block}, "
                                f"{piece.first_block + piece.num_blocks}) of {inc.num_blocks}, not with the last")
        view = inc.t.buffer[piece.first_block * bb:(piece.first_block + piece.num_blocks) * bb]
        inc.works.append(self.pair.post_recv(view))
        inc.parts.append((piece.first_block, piece.num_blocks, view))
        inc.next_block += piece.num_blocks
        if last:                             # lands as soon as these bytes have
            self._spawn(inc, self._land(tid, inc, piece.first_token, dict(piece.extra)))

    def on_finish(self, fin) -> None:
        tid = fin.transfer_id
        inc = self.open.get(tid)
        if inc is None:
            if tid not in self.ended:
                raise ProtocolError(f"FINISH of transfer {tid!r}, which is not open on this pair")
            self._remember(tid, self.ended[tid][0], None)     # no more pieces: let the buffer go
            return                           # it was refused already
        if inc.next_block != inc.num_blocks:
            self.end(tid, f"transfer {tid} finished with {inc.next_block} of its {inc.num_blocks} blocks sent",
                     Code.INVALID_ARGUMENT)
            return
        self._spawn(inc, self._land(tid, inc, fin.first_token, dict(fin.extra)))

    async def _land(self, tid: str, inc: _Incoming, first_token: int, extra: dict) -> None:
        try:
            await self.pair.wait_done(inc.works, max(0.0, self.r.pending.time_left(inc.t)), "receive")
        except TimeoutError as exc:
            if tid in self.open:                 # (not drained by `overdue` already)
                self._drain(tid, inc)
            self.end(tid, f"KV of transfer {tid} did not land before its deadline: {exc}", Code.DEADLINE_EXCEEDED)
            return
        except RuntimeError as exc:          # the collective failed (peer gone, aborted)
            self.r.drop(self.pair, f"a receive of transfer {tid} failed")
            self.end(tid, f"KV receive of {tid} failed: {exc}", Code.UNAVAILABLE)
            return
        self._forget(tid)
        payload = inc.t.buffer if len(inc.parts) == 1 else Pieces(tuple(inc.parts))
        try:
            self.r.pending.complete(inc.t, first_token, extra, payload)
        except TransferRejected as exc:      # ended meanwhile (deadline, cancel), or the engine refused it
            self.say(refused(tid, exc.code, str(exc)))
            return
        self.say(Ack(kind=Ack.KIND_DONE, transfer_id=tid))

    def overdue(self, tid: str) -> None:
        """At a transfer's deadline: the registry has failed it; unmatched receives close the pair."""
        inc = self.open.get(tid)
        if inc is None:
            return
        self._drain(tid, inc)
        self.end(tid, f"the KV of transfer {tid} did not arrive before its deadline", Code.DEADLINE_EXCEEDED)

    def _drain(self, tid: str, inc: _Incoming) -> None:
        """Let `inc`'s posted receives complete after it failed (the pair stays in step), or close
        the pair if they are still unmatched DRAIN_S from now."""
        works = [p for p in inc.works if not p.completed()]
        if not works:
            return

        async def drain() -> None:
            try:
                await self.pair.wait_done(works, DRAIN_S, "receive")
            except TimeoutError:
                self.r.drop(self.pair, f"a receive of transfer {tid} was still unmatched {DRAIN_S:g}s after the "
                            "transfer failed")
            except RuntimeError:
                pass                         # the collective failed: the pair is closing already
        task = asyncio.ensure_future(drain())
        self.draining.add(task)
        task.add_done_callback(self.draining.discard)

    def end(self, tid: str, reason: str, code: grpc.StatusCode) -> None:
        """Fail an open transfer (freeing its blocks) and tell the sender, unless the stream is over."""
        inc = self._forget(tid)
        if inc is None:
            return
        self.r.pending.fail(tid, reason, code)
        for task in list(inc.tasks):
            if task is not asyncio.current_task():
                task.cancel()
        if self.pair.control is not None and not self.pair.broken:
            self.say(refused(tid, code, reason))

    def _forget(self, tid: str) -> _Incoming | None:
        inc = self.open.pop(tid, None)
        if inc is not None:
            self._remember(tid, inc.num_blocks, inc.t.buffer if inc.next_block < inc.num_blocks else None)
            self.pair.in_flight -= 1
            if inc.timer is not None:
                inc.timer.cancel()
        return inc

    def _remember(self, tid: str, num_blocks: int, buffer) -> None:
        self.ended[tid] = (num_blocks, buffer)
        self.ended.move_to_end(tid)
        while len(self.ended) > REMEMBERED_ENDED:
            self.ended.popitem(last=False)

    def close(self, reason: str) -> None:
        """The control stream is over: every transfer still open on it fails."""
        for tid in list(self.open):
            self.end(tid, reason, Code.CANCELLED)
        for task in list(self.draining):     # the pair closes: nothing is left to drain into
            task.cancel()
        self.outbox.close()


class ProtocolError(Exception):
    """The sender broke the control protocol: the pair can no longer be trusted to be in step."""


class DirectKVReceiver(KVReceiver, kvtransfer_pb2_grpc.KVDirectServicer):
    """Serves KVDirect: builds pairs on request and receives transfers into device buffers
    that the registry `pending` hands to the decode engine (a uint8 tensor, or `Pieces`)."""

    backend = BACKEND

    def __init__(self, pending: PendingTransfers, platform: Platform, block_bytes: int,
                 store_host: str = "127.0.0.1", auth: KVPeerAuth | None = None, nccl: str = "direct"):
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        self.pending = pending
        self.platform = platform
        self.device = platform.device
        self.block_bytes = block_bytes
        self.collective = platform.dist_backend
        self.nccl = nccl
        self.store_host = store_host
        self.auth = auth
        self.pairs: dict[str, PairGroup] = {}
        self._joins: dict[str, asyncio.Task] = {}

    def add_to_server(self, server: grpc.aio.Server) -> None:
        kvtransfer_pb2_grpc.add_KVDirectServicer_to_server(self, server)

    async def _check_session(self, context) -> None:
        if self.auth is not None and not self.auth.session_valid(session_of(context.invocation_metadata())):
            await context.abort(Code.UNAUTHENTICATED, "KV direct call without a valid session: handshake with "
                                "the shared KV secret first (a restarted decode worker forgets old sessions)")

    async def Connect(self, request, context):
        await self._check_session(context)
        if request.collective != self.collective:
            await context.abort(Code.FAILED_PRECONDITION, f"this decode worker moves KV with {self.collective} "
                                f"(its device is {self.device}), the prefill worker asked for "
                                f"{request.collective or 'nothing'}: both must run on the same kind of device")
        if not request.pair_id or request.pair_id in self.pairs:
            await context.abort(Code.INVALID_ARGUMENT, f"pair id {request.pair_id!r} is empty or already used")
        self._evict_idle()
        pair = PairGroup(request.pair_id, self.platform, self.nccl)
        port = pair.host_store(self.store_host)
        self.pairs[pair.pair_id] = pair
        # a wildcard bind address means nothing to the sender: it then uses the host it dialed
        advertised = "" if self.store_host in WILDCARD_HOSTS else self.store_host
        self._joins[pair.pair_id] = asyncio.ensure_future(pair.join(rank=1))
        self._joins[pair.pair_id].add_done_callback(lambda f, p=pair: self._joined(p, f))
        return kvtransfer_pb2.ConnectResponse(store_host=advertised, store_port=port,
                                              collective=self.collective)

    def _joined(self, pair: PairGroup, fut: asyncio.Future) -> None:
        self._joins.pop(pair.pair_id, None)
        if fut.cancelled() or fut.exception() is not None:
            self.pairs.pop(pair.pair_id, None)      # join() closed it already

    def _evict_idle(self) -> None:
        """Close pairs of senders that went away (a restarted prefill worker never says so),
        and the oldest idle ones beyond MAX_PAIRS: each communicator holds device buffers."""
        now = time.monotonic()
        idle = sorted((p for p in self.pairs.values() if not p.in_flight and p.pair_id not in self._joins),
                      key=lambda p: p.last_used)
        for pair in [p for p in idle if now - p.last_used > PAIR_IDLE_S]:
            self.drop(pair, f"unused for {PAIR_IDLE_S:.0f}s")
            idle.remove(pair)
        while len(self.pairs) >= MAX_PAIRS and idle:
            self.drop(idle.pop(0), "too many KV pairs on this decode worker; the oldest idle one was closed")

    def drop(self, pair: PairGroup, reason: str, wait: float = 0.0) -> None:
        """Close a pair: its communicator is aborted and its control stream ends."""
        self.pairs.pop(pair.pair_id, None)
        pair.close(reason, wait)
        control, pair.control = pair.control, None
        if control is not None and control is not asyncio.current_task():
            control.cancel()

    async def Session(self, request_iterator, context):
        await self._check_session(context)
        messages = aiter(request_iterator)
        try:
            msg = await asyncio.wait_for(anext(messages), HELLO_TIMEOUT_S)
        except (TimeoutError, StopAsyncIteration):
            msg = None
        if msg is None or msg.WhichOneof("kind") != "hello":
            await context.abort(Code.INVALID_ARGUMENT, "a KV control stream must open with its pair's hello")
        pair = self.pairs.get(msg.hello.pair_id)
        why = "unknown pair: Connect first (a restarted decode worker forgets pairs)" if pair is None else \
            pair.broken or ("it has a control stream already" if pair.control is not None else None)
        if why is not None:
            await context.abort(Code.FAILED_PRECONDITION, f"KV pair {msg.hello.pair_id!r}: {why}")
        join = self._joins.get(pair.pair_id)
        if join is not None:
            try:
                await asyncio.wait_for(asyncio.shield(join), JOIN_TIMEOUT_S)
            except Exception as exc:
                await context.abort(Code.UNAVAILABLE, f"KV pair {pair.pair_id} could not be built: {exc}")
        pair.control = asyncio.current_task()
        control = _Control(self, pair, context)
        reason = "the prefill worker closed the pair's control stream"
        closed_here = None
        try:
            control.say(Ack(kind=Ack.KIND_READY))
            async for msg in messages:
                control.handle(msg)
        except ProtocolError as exc:
            log.warning("KV pair %s closed: %s", pair.pair_id, exc)
            reason = closed_here = str(exc)
        except asyncio.CancelledError:
            if not pair.broken:              # the RPC itself was cancelled (the sender went away)
                raise
            reason = closed_here = pair.broken   # drop(): end the stream with a status, below
        finally:
            if pair.control is asyncio.current_task():
                pair.control = None
            control.close(f"KV pair {pair.pair_id}: {reason}")
            self.drop(pair, reason)
        if closed_here is not None:          # tell the sender why, so it stops using the pair
            await context.abort(Code.UNAVAILABLE, f"KV pair {pair.pair_id} closed: {closed_here}")

    def close_pairs(self, wait: float = 5.0) -> None:
        """Abort every pair's communicator (at shutdown: each abort gets `wait` seconds)."""
        for pair in list(self.pairs.values()):
            self.drop(pair, "decode worker stopping", wait)

    async def close(self) -> None:
        self.close_pairs()
