"""The prefill side of the direct backend: one pair (communicator + control stream) per
decode worker, connected on first use and again after it breaks; transfers are opened before
their KV exists, and each piece's PIECE goes on the control stream while its bytes follow on
the communicator, on the pair's own device stream.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc
import torch

from baton.engine.kv_handoff import KVPiece
from baton.engine.platforms import Platform
from baton.kvtransfer.backend import (
    KVSender,
    KVTransferError,
    OutgoingTransfer,
    SendStats,
    TransferDescriptor,
)
from baton.kvtransfer.direct_backend.messages import BACKEND, Ack, Code, Msg, status_code, strings
from baton.kvtransfer.direct_backend.outbox import Outbox
from baton.kvtransfer.direct_backend.pair import JOIN_TIMEOUT_S, PairGroup
from baton.kvtransfer.direct_backend.receiver import DRAIN_S
from baton.kvtransfer.handshake import handshake
from baton.kvtransfer.layout import KVLayout
from baton.kvtransfer.peer_auth import KVPeerAuth
from baton.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc

log = logging.getLogger("baton.kvtransfer")
VERDICT_GRACE_S = DRAIN_S + 2.0  # past a transfer's deadline, how long its word may take before the pair closes


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
        self.verdicts: set[asyncio.Task] = set()     # transfers past their deadline awaiting the word
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
        for task in list(self.verdicts):
            task.cancel()
        self._reader.cancel()
        self.outbox.close()
        if not self.call.done():
            self.call.cancel()


class DirectOutgoing(OutgoingTransfer):
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

    def _check_refused(self) -> None:
        """Raise what the receiver said, if it already refused or failed this transfer."""
        queue = self.control.acks.get(self.transfer.transfer_id)
        if queue is not None and not queue.empty():
            item = queue.get_nowait()
            self._end()
            raise item if isinstance(item, KVTransferError) else KVTransferError(item.reason, status_code(item.code))

    async def piece(self, piece: KVPiece) -> None:
        """Send the piece's blocks (a uint8 tensor on this device, final once `piece.ready` has
        passed; without an event, once the work queued so far on this thread's stream has). The
        last piece carries the first token: the decode side lands the transfer as soon as these
        bytes have, and `done` waits for its word. Returns once the PIECE is queued; its send is
        posted when the PIECE has gone out (a failure then fails the pair's transfers, `done`
        included)."""
        data, num_blocks, first_token, extra = piece.data, piece.num_blocks, piece.first_token, piece.meta
        after = piece.ready if piece.ready is not None else self.sender.platform.record_event()
        if piece.first_block != self.next_block:
            self.abandon("pieces out of order")
            raise KVTransferError(f"transfer {self.transfer.transfer_id}: a piece from block {piece.first_block} "
                                  f"where block {self.next_block} was due", Code.INVALID_ARGUMENT)
        if self.ended:
            raise KVTransferError(f"transfer {self.transfer.transfer_id} has ended", Code.FAILED_PRECONDITION)
        self._check_refused()
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
            msg.extra.update(strings(extra))
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
                transfer_id=tid, first_token=first_token, extra=strings(extra))))
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
            self._await_verdict()
            raise KVTransferError(f"KV transfer {tid} to {self.sender.address} was not confirmed in time",
                                  Code.DEADLINE_EXCEEDED) from None
        except BaseException as exc:
            self._interrupted(exc)
            raise
        self._end()
        if ack.kind != Ack.KIND_DONE:
            raise KVTransferError(ack.reason or "the decode worker refused the KV", status_code(ack.code))
        return SendStats(nbytes=self.transfer.nbytes, chunks=self.pieces,
                         seconds=time.perf_counter() - self.opened)

    def _await_verdict(self) -> None:
        """The deadline passed with every byte posted and no word yet. The decode side still
        answers (DONE, or a refusal at its own deadline, which may come a moment after this one),
        and its posted receives drain (receiver.DRAIN_S): wait that long, in the background, for
        the word before deciding the pair is out of step. The caller's request fails now."""
        tid, control = self.transfer.transfer_id, self.control

        async def wait() -> None:
            try:
                await control.next_ack(tid, VERDICT_GRACE_S)
            except TimeoutError:
                self._fail(f"transfer {tid} was not answered {VERDICT_GRACE_S:g}s past its deadline")
                return
            except KVTransferError:          # the pair broke meanwhile: it failed every transfer
                pass
            self._end()
        task = asyncio.ensure_future(wait())
        control.verdicts.add(task)
        task.add_done_callback(control.verdicts.discard)

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

    def __init__(self, channel: grpc.aio.Channel, address: str, platform: Platform,
                 auth: KVPeerAuth | None = None, nccl: str = "direct", stall_s: float = 0.0):
        """`nccl`: how NCCL is called (direct / torch); `stall_s`: fault injection, every piece
        held this long between its PIECE and its bytes, as a stalled device link would."""
        self.address = address
        self.channel = channel
        self.platform = platform
        self.device = platform.device
        self.collective = platform.dist_backend
        self.nccl = nccl
        self.stub = kvtransfer_pb2_grpc.KVDirectStub(channel)
        self.auth = auth
        self.peer_layout: KVLayout | None = None
        self._layout: KVLayout | None = None
        self.block_bytes = 0
        self.control: _SenderControl | None = None
        self._connecting = asyncio.Lock()
        self._metadata: tuple[tuple[str, str], ...] = ()
        self.stall_s = stall_s
        if stall_s:
            log.warning("--kv-fault-stall-s %g: every device-direct KV transfer will stall (fault injection)",
                        stall_s)

    @property
    def pair(self) -> PairGroup | None:
        return self.control.pair if self.control is not None else None

    async def handshake(self, layout: KVLayout, timeout: float = 10.0) -> KVLayout:
        self._layout = layout
        done = await handshake(self.channel, self.address, layout, self.auth, timeout, backend=BACKEND)
        peer = done.peer
        self._metadata = done.metadata
        self.peer_layout = peer
        self.block_bytes = layout.payload_nbytes(1)
        return peer

    async def _control(self, timeout: float) -> _SenderControl:
        """The live control stream, connecting a fresh pair when there is none."""
        async with self._connecting:
            if self.control is not None and self.control.alive:
                return self.control
            self.break_pair("replaced")
            pair = PairGroup(uuid.uuid4().hex, self.platform, self.nccl)
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

    async def warm(self, timeout: float = 10.0) -> None:
        """Connect the pair now, as the first transfer would: Connect, the communicator built on
        both ends (and one byte exchanged on it, so NCCL's lazy connection is made), the control
        stream's hello. Costs ~1 s on GPUs (NCCL's communicator); later transfers find it live."""
        if self.peer_layout is None:
            raise KVTransferError(f"handshake with {self.address} before warming the KV pair", Code.FAILED_PRECONDITION)
        try:
            async with asyncio.timeout(timeout):
                for attempt in range(2):
                    try:
                        await self._control(timeout)
                        return
                    except _SessionLost as lost:      # as in open: once more, re-handshaken if it forgot us
                        if attempt:
                            raise lost.error from None
                        if lost.error.code == Code.UNAUTHENTICATED:
                            await self.handshake(self._layout, timeout=min(timeout, 10.0))
        except TimeoutError:
            raise KVTransferError(f"the KV pair with {self.address} was not connected within {timeout:g}s",
                                  Code.DEADLINE_EXCEEDED) from None
        except RuntimeError as exc:          # building the communicator failed (that pair is closed)
            raise KVTransferError(f"KV pair with {self.address} failed on {self.collective}: {exc}",
                                  Code.UNAVAILABLE) from exc

    async def open(self, transfer: TransferDescriptor | str, timeout: float = 30.0) -> DirectOutgoing:
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

    async def _open_on(self, ctl: _SenderControl, transfer: TransferDescriptor, deadline: float) -> DirectOutgoing:
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
            raise KVTransferError(ack.reason or "the decode worker refused the transfer", status_code(ack.code))
        return DirectOutgoing(self, ctl, transfer, transfer.nbytes // self.block_bytes, deadline)

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
