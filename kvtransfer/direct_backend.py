"""The device-direct KV backend ("direct"): a request's KV goes from the prefill device to the
decode device through a collective library (NCCL between GPUs, HCCL between Ascend NPUs,
gloo on the CPU), with no host staging; gRPC carries only the rendezvous and descriptors.

Each prefill->decode pair of workers shares one two-rank communicator (prefill rank 0,
decode rank 1) and one long-lived control stream. `Connect` sets the communicator up (the
decode worker hosts a torch.distributed TCPStore for the pair and both ends build the
process group on it); `Session` is the control stream, on which transfers are multiplexed:

    OPEN -> READY                  the receiver claimed the transfer and staged a device buffer;
                                   the prefill worker opens when the prefill starts, so this
                                   round trip hides under the prefill compute
    PIECE, PIECE, ...              one per prefill chunk: those blocks' KV, final and packed on
                                   the prefill device, follows on the communicator at once;
                                   the last PIECE carries the first token (sampled in the step
                                   that made its blocks final), or a FINISH follows with it
    -> DONE                        every byte landed and went to the decode engine

The bytes of each PIECE go on the communicator in the order of the PIECE messages: the
sender posts its sends, and the receiver its receives, in that order, on the pair's own
device stream (so they overlap the engines' compute); a watcher thread per pair tells the
event loop when each has completed. Any number of transfers may be open on a pair; their
pieces interleave. Messages (and acks) queued while the stream's previous write is under way
go out together in one write (`Outbox`), so under load control costs one round per batch,
not one per message. On GPUs the pair calls NCCL directly (kvtransfer.nccl): posting an
operation costs microseconds instead of the 110-160 us of ProcessGroupNCCL.

Faults: a transfer that does not land by its deadline (a stalled link, a sender that died)
fails on the receiver -- its blocks are freed through the registry's on_fail -- and, when a
receive of it is left unmatched, the pair is closed: its communicator is aborted and its
control stream ends, which fails the pair's other open transfers; the sender connects a fresh
pair for its next transfer. A transfer the decode worker ended early (cancelled, refused)
still gets its posted pieces received, into a scratch buffer, so the pair stays in step.
A sender that gives a transfer up says so (ABANDON) and the receiver frees it at once.

Security: with a KV secret, Connect and Session need the session of the KVTransfer
handshake. The per-pair TCPStore and the collective's own sockets are not authenticated by
torch.distributed; they live on the KV network (`--kv-advertise` host) for as long as the
pair, so keep that network private.
"""
from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import timedelta

import grpc
import torch
import torch.distributed as dist

from baton.engine.kv_blocks import Pieces
from baton.kvtransfer.backend import KVSender, KVTransferError, SendStats, TransferDescriptor, resolve_payload
from baton.kvtransfer.grpc_backend import GrpcKVSender
from baton.kvtransfer.layout import KVLayout
from baton.kvtransfer.peer_auth import KVPeerAuth, session_of
from baton.kvtransfer.receiver import REMEMBERED_ENDED, PendingTransfers, Transfer, TransferRejected
from baton.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc

log = logging.getLogger("baton.kvtransfer")
Code = grpc.StatusCode
Ack = kvtransfer_pb2.DirectAck
Msg = kvtransfer_pb2.DirectMessage

BACKEND = "direct"
COLLECTIVES = ("nccl", "hccl", "gloo")
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")
HELLO_TIMEOUT_S = 10.0         # the receiver waits this long for a control stream's first message
JOIN_TIMEOUT_S = 60.0          # building a pair's communicator (both ends must join)
MAX_PAIRS = 64                 # communicators one decode worker keeps (oldest idle ones closed first)
PAIR_IDLE_S = 600.0            # a pair unused this long is closed (its sender reconnects when it returns)
# Fault injection for tests and drills: a sender holds each piece this many seconds between
# announcing it and sending its bytes, as a stalled device link would.
STALL_ENV = "BATON_KV_FAULT_STALL_S"
# "torch" posts NCCL operations through ProcessGroupNCCL instead of calling NCCL directly
# (a comparison, or a way around an NCCL library that ctypes cannot use)
NCCL_ENV = "BATON_KV_NCCL"


class PairGroup:
    """One two-rank communicator with its own device stream, and a thread that watches its
    operations complete."""

    def __init__(self, pair_id: str, collective: str, device: torch.device):
        if collective not in COLLECTIVES:
            raise ValueError(f"unknown collective {collective!r}: use one of {', '.join(COLLECTIVES)}")
        self.pair_id = pair_id
        self.collective = collective
        self.device = device
        self.comm = None                         # _NcclComm or TorchGroup, once joined
        self.store = None
        self.broken: str | None = None          # why the pair can no longer be used
        self.control: asyncio.Task | None = None   # the receiver's control stream handler
        self.in_flight = 0                       # transfers open on the pair (receiver side)
        self.last_used = time.monotonic()
        # the pair's operations go on a stream of their own: on the default one they would queue
        # behind whatever compute the engine has launched; high priority, so its kernels go
        # first when SMs free up
        self.stream = None if device.type == "cpu" else getattr(torch, device.type).Stream(device, priority=-1)
        self._watching: queue.SimpleQueue[Posted | None] = queue.SimpleQueue()   # posted, not yet seen done
        self._watcher: threading.Thread | None = None

    # -- set-up -----------------------------------------------------------------------------
    def host_store(self, host: str) -> int:
        """Decode side: start this pair's rendezvous store on a free port; returns the port."""
        self.store = dist.TCPStore(host, 0, 2, True, timeout=timedelta(seconds=JOIN_TIMEOUT_S),
                                   wait_for_workers=False)
        return self.store.port

    async def join(self, rank: int, host: str = "", port: int = 0, timeout: float = JOIN_TIMEOUT_S) -> None:
        """Build the communicator (rank 1 on the store this end hosts, rank 0 as its client)."""
        def build():
            if self.stream is not None:
                getattr(torch, self.device.type).set_device(self.device)
            if self.store is None:
                self.store = dist.TCPStore(host, port, 2, False, timeout=timedelta(seconds=timeout))
            comm = make_comm(self.collective, dist.PrefixStore(self.pair_id, self.store), rank, timeout)
            # one tiny exchange: communicators that connect lazily (NCCL, HCCL) connect now, so a
            # transfer's receive is posted without blocking, and the link is known to work
            probe = torch.zeros(1, dtype=torch.uint8, device=self.device)
            work = comm.send(probe, self.stream) if rank == 0 else comm.recv(probe, self.stream)
            if work is not None:
                work.wait()
            if self.stream is not None:
                self.stream.synchronize()
            return comm
        try:
            # on a daemon thread: a peer that never joins must not keep this process from exiting
            comm = await asyncio.wait_for(_on_daemon_thread(build, f"kv-join-{self.pair_id[:8]}"), timeout)
        except Exception as exc:
            self.close(f"could not build the {self.collective} communicator of pair {self.pair_id}: {exc}")
            raise
        if self.broken is not None:          # closed while it was being built
            _abort_later(comm)
            raise RuntimeError(f"KV pair {self.pair_id} was closed while it was built: {self.broken}")
        self.comm = comm

    # -- transfers ----------------------------------------------------------------------------
    # Operations are posted from the event loop's thread: posting only enqueues work on the
    # pair's stream (a few microseconds with NCCL called directly), where a hop to another
    # thread and back costs a few hundred on a lone transfer's critical path, at each end.
    def post_send(self, tensor: torch.Tensor, after=None) -> Posted:
        """Post the send of a packed uint8 tensor (once `after`, a device event, has passed)."""
        return self._post(True, tensor, after)

    def post_recv(self, tensor: torch.Tensor) -> Posted:
        return self._post(False, tensor)

    def _post(self, send: bool, tensor: torch.Tensor, after=None) -> Posted:
        comm = self.comm
        if comm is None:
            raise RuntimeError(f"KV pair {self.pair_id} is closed: {self.broken}")
        if self.stream is None:
            return self._track(comm.send(tensor, None) if send else comm.recv(tensor, None), None, tensor)
        accel = getattr(torch, self.device.type)
        with accel.stream(self.stream):
            if after is not None:            # the engine packed it on its own stream
                self.stream.wait_event(after)
            work = comm.send(tensor, self.stream) if send else comm.recv(tensor, self.stream)
            if work is not None:
                work.wait()                  # the pair's stream waits for it (the host does not)
            event = accel.Event(blocking=True)   # passes when the operation has
            event.record(self.stream)
        return self._track(work, event, tensor)

    def _track(self, work, event, tensor: torch.Tensor) -> Posted:
        """Hand the operation to the pair's watcher thread, which keeps it and its tensor alive
        until it completes (a pending gloo work that is dropped is cancelled, which would put
        every later operation of the pair out of step; a device buffer freed early would be
        reused under the transfer) and then settles its `done`."""
        self.last_used = time.monotonic()
        loop = asyncio.get_running_loop()
        posted = Posted(work, tensor, event, loop)
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, args=(loop,), daemon=True,
                                             name=f"kv-watch-{self.pair_id[:8]}")
            self._watcher.start()
        self._watching.put(posted)
        return posted

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Watcher thread: operations complete in the order they were posted (one communicator,
        one stream), so waiting for them one after the other loses nothing. An operation that
        ends because the communicator was aborted has failed, not completed."""
        if self.device.type != "cpu":
            getattr(torch, self.device.type).set_device(self.device)
        while (posted := self._watching.get()) is not None:
            error = posted.wait_blocking()
            if error is None and self.broken is not None:
                error = f"the pair was closed: {self.broken}"
            try:
                loop.call_soon_threadsafe(posted.settle, error)
            except RuntimeError:             # the loop has closed: nobody is waiting any more
                return

    async def wait_done(self, posted: list[Posted], timeout: float, what: str) -> None:
        """Wait until every operation has finished on the device (its bytes are final), within `timeout`."""
        pending = [p.done for p in posted if not p.done.done()]
        if pending:
            _, late = await asyncio.wait(pending, timeout=timeout)
            if late:
                raise TimeoutError(f"the {self.collective} {what} did not complete within {timeout:.1f}s")
        for p in posted:
            p.result()                      # raises if the collective failed
        self.last_used = time.monotonic()

    def close(self, reason: str, wait: float = 0.0) -> None:
        """Abort the communicator (pending operations fail) and stop the watcher; `wait`:
        seconds to let the abort finish (at shutdown; the event loop must not block on it
        otherwise)."""
        if self.broken is None:
            self.broken = reason
        comm, self.comm = self.comm, None
        if comm is not None:
            _abort_later(comm).join(wait)
        self._watching.put(None)             # the watcher ends once what is posted has settled
        self.store = None


class Posted:
    """One posted send or receive, with its tensor (alive until the operation completes).
    `done` is settled on the event loop by the pair's watcher thread once the operation has
    finished. Nothing polls from the loop: a sub-millisecond asyncio sleep lasts a whole
    millisecond (epoll's timeout resolution), four times what 100 MiB takes over NVLink."""

    __slots__ = ("work", "tensor", "event", "done", "_error")

    def __init__(self, work, tensor: torch.Tensor, event, loop: asyncio.AbstractEventLoop):
        self.work = work                     # a torch.distributed work, or None (NCCL called directly)
        self.tensor = tensor
        self.event = event                   # device collectives: passes when the operation has
        self.done = loop.create_future()     # gloo (event None): known by waiting on the work
        self._error: str | None = None

    def settle(self, error: str | None) -> None:
        """Event-loop side of the watcher's notice."""
        self._error = error
        if not self.done.done():
            self.done.set_result(None)

    def wait_blocking(self) -> str | None:
        """Watcher thread: block until the operation has finished; its error, if any."""
        try:
            if self.event is not None:
                self.event.synchronize()     # releases the GIL; a blocking-sync event sleeps, not spins
            else:
                self.work.wait(timedelta(seconds=JOIN_TIMEOUT_S))
        except Exception as exc:             # timed out, or the peer went away
            return str(exc) or type(exc).__name__
        return None

    def completed(self) -> bool:
        return self.done.done()

    def result(self) -> None:
        if self._error is not None:
            raise RuntimeError(self._error)
        if self.event is not None and self.work is not None:
            self.work.wait()                 # raises if the collective failed (aborted, peer gone)


def _abort_later(comm) -> threading.Thread:
    """Abort a communicator on a thread of its own (NCCL/HCCL: it may block until in-flight
    kernels stop, which the event loop must not)."""
    t = threading.Thread(target=_quietly, args=(comm.abort,), daemon=True)
    t.start()
    return t


def _on_daemon_thread(fn, name: str) -> asyncio.Future:
    """Run fn() (which builds a communicator) on a fresh daemon thread; a future of its result
    on the running loop. One built after its waiter gave up is aborted."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, error):
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)
        elif result is not None:
            _abort_later(result)

    def run():
        try:
            result, error = fn(), None
        except BaseException as exc:
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:                 # the loop has closed
            pass
    threading.Thread(target=run, name=name, daemon=True).start()
    return future


class TorchGroup:
    """A two-rank torch.distributed process group as a pair's communicator: gloo on the CPU,
    HCCL on Ascend, and NCCL where its library cannot be called directly (`_NcclComm`)."""

    def __init__(self, pg):
        self.pg = pg
        self.name = type(pg).__name__

    def send(self, tensor: torch.Tensor, stream):
        return self.pg.send([tensor], 1, 0)

    def recv(self, tensor: torch.Tensor, stream):
        return self.pg.recv([tensor], 0, 0)

    def abort(self) -> None:
        abort = getattr(self.pg, "abort", None) or getattr(self.pg, "shutdown", None)
        if abort is not None:
            abort()


class _NcclComm:
    """An NCCL communicator called directly (kvtransfer.nccl), with the pair's interface: send
    and recv are stream-ordered and return no work."""

    def __init__(self, comm, peer: int):
        self.comm = comm
        self.peer = peer
        from baton.kvtransfer import nccl
        self.name = f"NCCL {nccl.version()}, called directly"

    def send(self, tensor: torch.Tensor, stream):
        self.comm.send(tensor, self.peer, stream)

    def recv(self, tensor: torch.Tensor, stream):
        self.comm.recv(tensor, self.peer, stream)

    def abort(self) -> None:
        self.comm.abort()


_warned_nccl = False


def make_comm(collective: str, store, rank: int, timeout: float):
    """A two-rank communicator of `collective` on `store`, without touching the default group.
    NCCL is called directly (kvtransfer.nccl: a few microseconds a call, where ProcessGroupNCCL
    takes over a hundred); its id travels over the store."""
    global _warned_nccl
    if collective == "nccl" and os.environ.get(NCCL_ENV, "direct") != "torch":
        from baton.kvtransfer import nccl
        try:
            nccl.library()
        except nccl.NcclUnavailable as exc:
            if not _warned_nccl:
                log.warning("calling NCCL through ProcessGroupNCCL (more host time per transfer): %s", exc)
                _warned_nccl = True
        else:
            if rank == 0:
                store.set("nccl-id", nccl.unique_id())
            return _NcclComm(nccl.Communicator(bytes(store.get("nccl-id")), rank, 2), peer=1 - rank)
    return TorchGroup(make_group(collective, store, rank, timeout))


def make_group(collective: str, store, rank: int, timeout: float):
    """A two-rank process group of `collective` on `store`."""
    td = timedelta(seconds=timeout)
    if collective == "gloo":
        return dist.ProcessGroupGloo(store, rank, 2, td)
    if collective == "nccl":     # NCCL's own stream high priority too: sends are not starved by
        options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)   # the GEMMs they overlap
        options._timeout = td
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    from torch_npu._C._distributed_c10d import ProcessGroupHCCL  # the HCCL twin (never run here)
    options = ProcessGroupHCCL.Options()
    options._timeout = td
    return ProcessGroupHCCL(store, rank, 2, options)


def collective_for(device: torch.device) -> str:
    return {"cuda": "nccl", "npu": "hccl"}.get(device.type, "gloo")


def record_ready(device: torch.device):
    """An event on the calling thread's current stream of `device` (None on the CPU, where work
    is done when it returns): a piece packed there may be sent once it has passed."""
    if device.type == "cpu":
        return None
    accel = getattr(torch, device.type)
    event = accel.Event()
    event.record(accel.current_stream(device))
    return event


def _quietly(fn) -> None:
    try:
        fn()
    except Exception as exc:      # an abort of a broken communicator may itself complain
        log.debug("aborting a KV communicator: %s", exc)


def _refused(tid: str, code: grpc.StatusCode, reason: str) -> Ack:
    return Ack(kind=Ack.KIND_REFUSED, transfer_id=tid, reason=reason, code=code.value[0])


def _strings(extra: dict | None) -> dict[str, str]:
    return {k: str(v) for k, v in (extra or {}).items()}


def _code(number: int) -> grpc.StatusCode:
    return next((c for c in grpc.StatusCode if c.value[0] == number), Code.UNKNOWN)


class Outbox:
    """The writes of one control stream. A gRPC stream takes one write at a time, and waiting
    for each in turn made a message pay for every one queued before it (under load, dozens of
    OPENs and PIECEs); here what is put while a write is under way goes out together in the
    next one, in order (`batch` wraps several), and an idle stream writes at once. A message
    may come with `then`, run once its write has gone out, in the order of the messages (the
    sender posts a PIECE's bytes there: the PIECE is on its way first, and sends are posted in
    the order of their PIECEs)."""

    def __init__(self, write, batch, on_error):
        self._write = write
        self._batch = batch
        self._on_error = on_error
        self._queued: list = []              # (message, then)
        self._task: asyncio.Task | None = None
        self.closed = False
        self.messages = self.writes = 0      # how well it coalesces

    def put(self, msg, then=None) -> None:
        if self.closed:
            return
        self._queued.append((msg, then))
        if self._task is None:              # (not an eager task: grpc.aio's write fails in one)
            self._task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            while self._queued:
                queued, self._queued = self._queued, []
                msgs = [m for m, _ in queued]
                self.messages += len(msgs)
                self.writes += 1
                await self._write(msgs[0] if len(msgs) == 1 else self._batch(msgs))
                for _, then in queued:
                    if then is not None:
                        then()
        except Exception as exc:             # the stream (or the pair, in a `then`) broke: nothing more goes
            self.closed = True
            self._queued.clear()
            self._on_error(exc)
        finally:
            self._task = None

    def close(self) -> None:
        self.closed = True
        self._queued.clear()
        if self._task is not None:
            self._task.cancel()


# -- decode side ---------------------------------------------------------------------------------
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
            self.say(_refused(tid, exc.code, str(exc)))
            return
        inc = _Incoming(t, op.total_bytes // bb)
        self.open[tid] = inc
        self.pair.in_flight += 1
        inc.timer = asyncio.get_running_loop().call_at(t.deadline, self.overdue, tid)
        self._spawn(inc, self._stage(tid, inc))   # may wait for staging room: never in the reader

    async def _stage(self, tid: str, inc: _Incoming) -> None:
        try:
            await self.r.pending.stage(inc.t, lambda n: torch.empty(n, dtype=torch.uint8, device=self.r.device))
            self.r.pending.check_active(inc.t)
        except TransferRejected as exc:
            self.end(tid, str(exc), exc.code)
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
            self.r.drop(self.pair, f"a receive of transfer {tid} was left unmatched")
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
            self.say(_refused(tid, exc.code, str(exc)))
            return
        self.say(Ack(kind=Ack.KIND_DONE, transfer_id=tid))

    def overdue(self, tid: str) -> None:
        """At a transfer's deadline: the registry has failed it; unmatched receives close the pair."""
        inc = self.open.get(tid)
        if inc is None:
            return
        if not all(p.completed() for p in inc.works):
            self.r.drop(self.pair, f"a receive of transfer {tid} was left unmatched past its deadline")
        self.end(tid, f"the KV of transfer {tid} did not arrive before its deadline", Code.DEADLINE_EXCEEDED)

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
            self.say(_refused(tid, code, reason))

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
        self.outbox.close()


class ProtocolError(Exception):
    """The sender broke the control protocol: the pair can no longer be trusted to be in step."""


class DirectKVReceiver(kvtransfer_pb2_grpc.KVDirectServicer):
    """Serves KVDirect: builds pairs on request and receives transfers into device buffers
    that the registry `pending` hands to the decode engine (a uint8 tensor, or `Pieces`)."""

    backend = BACKEND

    def __init__(self, pending: PendingTransfers, device: torch.device, block_bytes: int,
                 store_host: str = "127.0.0.1", auth: KVPeerAuth | None = None):
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        self.pending = pending
        self.device = device
        self.block_bytes = block_bytes
        self.collective = collective_for(device)
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
        pair = PairGroup(request.pair_id, self.collective, self.device)
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


# -- prefill side --------------------------------------------------------------------------------
class _SessionLost(Exception):
    """The pair's control stream is gone (or was refused) before this transfer was READY:
    nothing of it was sent, so it may go again on a fresh pair."""

    def __init__(self, error: KVTransferError):
        super().__init__(str(error))
        self.error = error


class _SenderControl:
    """The sender's end of one pair's control stream: writes, and acks routed per transfer."""

    def __init__(self, pair: PairGroup, call):
        self.pair = pair
        self.call = call
        self.acks: dict[str, asyncio.Queue] = {}
        self.lost: KVTransferError | None = None
        self.lost_event = asyncio.Event()
        self.stalling = asyncio.Lock()       # fault injection: stalled pieces go one at a time, in order
        self.outbox = Outbox(call.write, lambda msgs: Msg(batch=kvtransfer_pb2.DirectBatch(messages=msgs)),
                              self._write_failed)
        self._reader = asyncio.ensure_future(self._read())

    @property
    def alive(self) -> bool:
        return self.lost is None and not self.pair.broken

    async def _read(self) -> None:
        try:
            while True:
                ack = await self.call.read()
                if ack is grpc.aio.EOF:
                    break
                for a in ack.batch or (ack,):
                    queue = self.acks.get(a.transfer_id)
                    if queue is not None:
                        queue.put_nowait(a)
            why = f"{(await self.call.code()).name}: {await self.call.details()}"
        except grpc.aio.AioRpcError as exc:
            why = f"{exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            why = "closed by this prefill worker"
        # whatever the reason, the pair is gone and its open transfers with it (retryable)
        self.fail_all(KVTransferError(f"the KV pair's control stream ended ({why})", Code.UNAVAILABLE))

    def fail_all(self, why: KVTransferError) -> None:
        if self.lost is None:
            self.lost = why
            self.lost_event.set()
            for queue in self.acks.values():
                queue.put_nowait(why)

    def send(self, msg, then=None) -> None:
        """Queue a control message (it goes out with the others queued meanwhile; `then` runs
        once it has); raises if the stream is gone. A write that fails later fails every
        transfer open on the pair."""
        if self.lost is not None:
            raise self.lost
        self.outbox.put(msg, then)

    def _write_failed(self, exc: BaseException) -> None:
        """A write, or posting a written PIECE's send, failed: the pair is out of step."""
        self.fail_all(KVTransferError(f"the KV control stream or pair broke: {exc}", Code.UNAVAILABLE))

    async def next_ack(self, tid: str, timeout: float):
        item = await asyncio.wait_for(self.acks[tid].get(), max(timeout, 0.0))
        if isinstance(item, KVTransferError):
            raise item
        return item

    def close(self) -> None:
        self._reader.cancel()
        self.outbox.close()
        if not self.call.done():
            self.call.cancel()


class OutgoingTransfer:
    """A transfer open on a pair: send its blocks piece by piece as they become final, the
    first token with the last piece (or in `finish`), then `done` waits for the decode
    worker's word. Any failure ends it; `abandon` gives it up."""

    def __init__(self, sender: DirectKVSender, control: _SenderControl, transfer: TransferDescriptor,
                 num_blocks: int, deadline: float):
        self.sender = sender
        self.control = control
        self.transfer = transfer
        self.num_blocks = num_blocks
        self.deadline = deadline            # event-loop time
        self.next_block = 0
        self.pieces = 0
        self.opened = time.perf_counter()
        self.ended = False                   # (the pair keeps each sent tensor until its send completes)
        self.token_sent = False

    def _left(self) -> float:
        return self.deadline - asyncio.get_running_loop().time()

    def _refused(self) -> None:
        """Raise what the receiver said, if it already refused or failed this transfer."""
        queue = self.control.acks.get(self.transfer.transfer_id)
        if queue is not None and not queue.empty():
            item = queue.get_nowait()
            self._end()
            raise item if isinstance(item, KVTransferError) else KVTransferError(item.reason, _code(item.code))

    async def piece(self, data: torch.Tensor, num_blocks: int, after=None, first_token: int | None = None,
                    extra: dict[str, str] | None = None) -> None:
        """Send the next `num_blocks` blocks, packed in `data` (a uint8 tensor on this device,
        final once the device event `after` has passed). With `first_token` this is the last
        piece and the token travels with it: the decode side lands the transfer as soon as these
        bytes have, and `done` waits for its word (no `finish`). Returns once the PIECE is
        queued; its send is posted when the PIECE has gone out (a failure then fails the pair's
        transfers, `done` included)."""
        if self.ended:
            raise KVTransferError(f"transfer {self.transfer.transfer_id} has ended", Code.FAILED_PRECONDITION)
        self._refused()
        nbytes = num_blocks * self.sender.block_bytes
        end = self.next_block + num_blocks
        if data.dtype != torch.uint8 or data.device != self.sender.device or data.numel() != nbytes \
                or not data.is_contiguous() or end > self.num_blocks or num_blocks < 1 \
                or (first_token is not None and end != self.num_blocks):
            self.abandon("payload mismatch")
            raise KVTransferError(f"a piece of {num_blocks} blocks must be {nbytes} contiguous uint8 bytes on "
                                  f"{self.sender.device}, got {data.numel()} {data.dtype} on {data.device}; the "
                                  f"descriptor promised {self.num_blocks} blocks, {self.next_block} sent"
                                  f"{'; the first token goes with the last piece' if first_token is not None else ''}",
                                  Code.INVALID_ARGUMENT)
        msg = kvtransfer_pb2.DirectPiece(transfer_id=self.transfer.transfer_id, first_block=self.next_block,
                                         num_blocks=num_blocks)
        if first_token is not None:
            msg.first_token = first_token
            msg.extra.update(_strings(extra))
        ctl = self.control
        queued = False
        try:
            if self._left() <= 0:
                raise TimeoutError()
            if not self.sender.stall_s:
                # the bytes are posted once the PIECE has gone out, in the order of the PIECEs
                ctl.send(Msg(piece=msg), then=lambda: ctl.pair.post_send(data, after))
            else:
                async with asyncio.timeout(self._left()), ctl.stalling:   # one stalled piece at a time
                    ctl.send(Msg(piece=msg))
                    queued = True
                    await self._stall()
                    ctl.pair.post_send(data, after)
                    queued = False
        except BaseException as exc:
            why = f"piece {self.pieces} of transfer {self.transfer.transfer_id} failed: {exc!r}"
            if queued:                       # the receiver will post a receive that nothing matches
                self._fail(why)
            else:
                self.abandon(why)
            if isinstance(exc, TimeoutError):
                raise KVTransferError(f"KV transfer {self.transfer.transfer_id} to {self.sender.address} ran "
                                      "out of time", Code.DEADLINE_EXCEEDED) from None
            if isinstance(exc, RuntimeError):
                raise KVTransferError(f"KV send to {self.sender.address} failed on {ctl.pair.collective}: "
                                      f"{exc}", Code.UNAVAILABLE) from exc
            raise
        self.next_block = end
        self.pieces += 1
        self.token_sent = first_token is not None

    async def _stall(self) -> None:
        """Fault injection: hold the announced bytes back, as a stalled device link would."""
        try:
            await asyncio.wait_for(self.control.lost_event.wait(), self.sender.stall_s)
        except TimeoutError:
            return
        raise self.control.lost

    async def finish(self, first_token: int, extra: dict[str, str] | None = None) -> SendStats:
        """Send the first token after the last piece; returns once every byte landed and went
        to the decode engine."""
        tid = self.transfer.transfer_id
        if self.ended or self.token_sent:
            raise KVTransferError(f"transfer {tid} has ended or has its first token", Code.FAILED_PRECONDITION)
        if self.next_block != self.num_blocks:
            self.abandon("finished early")
            raise KVTransferError(f"transfer {tid} finished with {self.next_block} of {self.num_blocks} blocks "
                                  "sent", Code.INVALID_ARGUMENT)
        try:
            self.control.send(Msg(finish=kvtransfer_pb2.DirectFinish(
                transfer_id=tid, first_token=first_token, extra=_strings(extra))))
        except BaseException as exc:
            self._interrupted(exc)
            raise
        self.token_sent = True
        return await self.done()

    async def done(self) -> SendStats:
        """Once the first token went (with the last piece, or `finish`): wait until every byte
        landed and went to the decode engine."""
        tid = self.transfer.transfer_id
        if self.ended or not self.token_sent:
            raise KVTransferError(f"transfer {tid} has ended or has not sent its first token",
                                  Code.FAILED_PRECONDITION)
        try:
            ack = await self.control.next_ack(tid, self._left())
        except TimeoutError:
            self._fail(f"transfer {tid} timed out")
            raise KVTransferError(f"KV transfer {tid} to {self.sender.address} was not confirmed in time",
                                  Code.DEADLINE_EXCEEDED) from None
        except BaseException as exc:
            self._interrupted(exc)
            raise
        self._end()
        if ack.kind != Ack.KIND_DONE:
            raise KVTransferError(ack.reason or "the decode worker refused the KV", _code(ack.code))
        return SendStats(nbytes=self.transfer.nbytes, chunks=self.pieces,
                         seconds=time.perf_counter() - self.opened)

    def _interrupted(self, exc: BaseException) -> None:
        """End the transfer after a control-stream call failed: a broken stream may have left the
        pair out of step (close it); anything else (a cancellation) gives the transfer up."""
        if isinstance(exc, KVTransferError):
            self._fail("the control stream broke")
        else:
            self.abandon("cancelled")

    def abandon(self, reason: str) -> None:
        """Give the transfer up: the receiver frees it now, not at its deadline."""
        if self.ended:
            return
        self._end()
        _say_abandon(self.control, self.transfer.transfer_id, reason)

    def _fail(self, reason: str) -> None:
        """The pair may be out of step: close it (the receiver fails its open transfers)."""
        self._end()
        self.sender.break_pair(reason, control=self.control)

    def _end(self) -> None:
        if not self.ended:
            self.ended = True
            self.control.acks.pop(self.transfer.transfer_id, None)


def _say_abandon(control: _SenderControl, tid: str, reason: str) -> None:
    if control.alive:                        # (if the stream is gone, the receiver fails it anyway)
        control.send(Msg(abandon=kvtransfer_pb2.DirectAbandon(transfer_id=tid, reason=reason)))


class DirectKVSender(KVSender):
    """Prefill side, one per decode worker: the KVTransfer handshake (layout, secret), then
    transfers over this pair's communicator; payloads are uint8 tensors on this device."""

    backend = BACKEND

    def __init__(self, channel: grpc.aio.Channel, address: str, device: torch.device,
                 auth: KVPeerAuth | None = None):
        self.address = address
        self.channel = channel
        self.device = device
        self.collective = collective_for(device)
        self.stub = kvtransfer_pb2_grpc.KVDirectStub(channel)
        self._handshaker = GrpcKVSender(channel, auth=auth)
        self.peer_layout: KVLayout | None = None
        self._layout: KVLayout | None = None
        self.block_bytes = 0
        self.control: _SenderControl | None = None
        self._connecting = asyncio.Lock()
        self._metadata: tuple[tuple[str, str], ...] = ()
        self.stall_s = float(os.environ.get(STALL_ENV) or 0)
        if self.stall_s:
            log.warning("%s=%g: every device-direct KV transfer will stall (fault injection)", STALL_ENV,
                        self.stall_s)

    @property
    def pair(self) -> PairGroup | None:
        return self.control.pair if self.control is not None else None

    async def handshake(self, layout: KVLayout, timeout: float = 10.0) -> KVLayout:
        self._layout = layout
        peer = await self._handshaker.handshake(layout, timeout)
        if BACKEND not in peer.backends:
            raise KVTransferError(f"the decode worker at {self.address} does not take device-direct KV "
                                  f"(it speaks {peer.backends}); start both with --kv-backend direct",
                                  Code.FAILED_PRECONDITION)
        self._metadata = self._handshaker.session_metadata
        self.peer_layout = peer
        self.block_bytes = layout.payload_nbytes(1)
        return peer

    async def _control(self, timeout: float) -> _SenderControl:
        """The live control stream, connecting a fresh pair when there is none."""
        async with self._connecting:
            if self.control is not None and self.control.alive:
                return self.control
            self.break_pair("replaced")
            pair = PairGroup(uuid.uuid4().hex, self.collective, self.device)
            try:
                reply = await self.stub.Connect(kvtransfer_pb2.ConnectRequest(
                    pair_id=pair.pair_id, collective=self.collective), timeout=timeout, metadata=self._metadata)
                host = reply.store_host or self.address.rsplit(":", 1)[0]
                await pair.join(rank=0, host=host, port=reply.store_port, timeout=min(timeout, JOIN_TIMEOUT_S))
                call = self.stub.Session(timeout=None, metadata=self._metadata)
                await call.write(Msg(hello=kvtransfer_pb2.DirectHello(pair_id=pair.pair_id)))
                ack = await asyncio.wait_for(call.read(), timeout)
            except grpc.aio.AioRpcError as exc:
                pair.close("could not connect")
                raise _SessionLost(KVTransferError(f"KV pair with {self.address}: {exc.details()}",
                                                   exc.code())) from None
            except BaseException:
                pair.close("could not connect")
                raise
            if ack is grpc.aio.EOF or ack.kind != Ack.KIND_READY:
                call.cancel()
                pair.close("refused")
                raise _SessionLost(KVTransferError(f"the decode worker at {self.address} refused the KV pair",
                                                   Code.FAILED_PRECONDITION))
            self.control = _SenderControl(pair, call)
            return self.control

    async def open(self, transfer: TransferDescriptor | str, timeout: float = 30.0) -> OutgoingTransfer:
        """Open a transfer (before its KV exists, e.g. when its prefill starts); returns once the
        receiver has staged it. `timeout` bounds the whole transfer, up to its DONE."""
        transfer = TransferDescriptor.of(transfer)
        if self.peer_layout is None:
            raise KVTransferError(f"handshake with {self.address} before sending KV", Code.FAILED_PRECONDITION)
        if transfer.nbytes < 0 or transfer.nbytes % self.block_bytes:
            raise KVTransferError(f"the direct backend needs the payload size in the descriptor, in whole "
                                  f"{self.block_bytes}-byte blocks (got {transfer.nbytes})", Code.INVALID_ARGUMENT)
        tid = transfer.transfer_id
        deadline = asyncio.get_running_loop().time() + timeout
        ctl = None
        try:
            async with asyncio.timeout(timeout):
                for attempt in range(2):
                    ctl = None
                    try:
                        ctl = await self._control(timeout)
                        return await self._open_on(ctl, transfer, deadline)
                    except _SessionLost as lost:
                        # the peer forgot our pair (restart, idle eviction) or our session, before
                        # anything of this transfer was sent: once more with a fresh pair
                        if ctl is not None:
                            self.break_pair(str(lost.error), control=ctl)
                        if attempt:
                            raise lost.error from None
                        if lost.error.code == Code.UNAUTHENTICATED:
                            await self.handshake(self._layout, timeout=min(timeout, 10.0))
        except TimeoutError:
            # nothing of it was sent: the pair is fine, the receiver is told to let the transfer go
            if ctl is not None and ctl.alive:
                ctl.acks.pop(tid, None)
                _say_abandon(ctl, tid, "the sender gave up waiting for READY")
            raise KVTransferError(f"KV transfer {tid} to {self.address} could not open within {timeout:g}s",
                                  Code.DEADLINE_EXCEEDED) from None
        except RuntimeError as exc:          # building the communicator failed (that pair is closed)
            raise KVTransferError(f"KV pair with {self.address} failed on {self.collective}: {exc}",
                                  Code.UNAVAILABLE) from exc
        raise AssertionError("unreachable")

    async def _open_on(self, ctl: _SenderControl, transfer: TransferDescriptor, deadline: float) -> OutgoingTransfer:
        tid = transfer.transfer_id
        if tid in ctl.acks:
            raise KVTransferError(f"transfer {tid} is already open to {self.address}", Code.ALREADY_EXISTS)
        ctl.acks[tid] = asyncio.Queue()
        try:
            ctl.send(Msg(open=kvtransfer_pb2.DirectOpen(transfer_id=tid, total_bytes=transfer.nbytes,
                                                        num_tokens=transfer.num_tokens)))
            ack = await ctl.next_ack(tid, deadline - asyncio.get_running_loop().time())
        except KVTransferError as exc:
            ctl.acks.pop(tid, None)
            raise _SessionLost(exc) from None
        except BaseException:
            ctl.acks.pop(tid, None)
            raise
        if ack.kind != Ack.KIND_READY:
            ctl.acks.pop(tid, None)
            raise KVTransferError(ack.reason or "the decode worker refused the transfer", _code(ack.code))
        return OutgoingTransfer(self, ctl, transfer, transfer.nbytes // self.block_bytes, deadline)

    async def send(self, transfer: TransferDescriptor | str, payload_provider, first_token: int,
                   extra: dict[str, str] | None = None, timeout: float = 30.0) -> SendStats:
        """The whole payload in one piece: open, send, finish."""
        transfer = TransferDescriptor.of(transfer)
        out = await self.open(transfer, timeout)
        try:
            payload = await resolve_payload(payload_provider)
            if not isinstance(payload, torch.Tensor):
                raise KVTransferError(f"the direct backend sends a uint8 tensor on {self.device}, got "
                                      f"{type(payload).__name__}", Code.INTERNAL)
            await out.piece(payload, out.num_blocks, record_ready(self.device), first_token, extra)
            return await out.done()
        except BaseException as exc:
            out.abandon(f"the send failed: {exc}")
            raise

    def break_pair(self, reason: str, wait: float = 0.0, control: _SenderControl | None = None) -> None:
        """Close the current pair (or `control`'s, which a newer pair may have replaced already)."""
        control = control or self.control
        if control is self.control:
            self.control = None
        if control is not None:
            control.fail_all(KVTransferError(f"KV pair closed: {reason}", Code.UNAVAILABLE))
            control.close()
            control.pair.close(reason, wait)

    def close_pair(self, wait: float = 5.0) -> None:
        self.break_pair("sender closed", wait)

    async def close(self) -> None:
        self.close_pair()


__all__ = ["BACKEND", "DirectKVReceiver", "DirectKVSender", "OutgoingTransfer", "PairGroup", "collective_for",
           "record_ready"]
