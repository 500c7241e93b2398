"""The decode side of the gRPC backend: the `baton.v1.KVTransfer` service. A layout
handshake (and, with a KV secret, a mutual HMAC), then one Push stream per transfer whose
chunks are checked (CRC32, offsets, sizes) and staged into the buffer `PendingTransfers`
allocated for it; acks return credit, NACKs ask for a corrupted chunk again. A rejection fails
the transfer at once (the decode worker frees its blocks), answers REFUSED, and ends the stream
with the status code once the sender has half-closed.
"""
from __future__ import annotations

import asyncio
import contextlib
import zlib

import grpc
import numpy as np

from baton.kvtransfer.backend import KVReceiver
from baton.kvtransfer.grpc_backend.chunk_codec import decode_chunk
from baton.kvtransfer.grpc_options import DEFAULT_WINDOW_BYTES, MAX_CHUNK_BYTES
from baton.kvtransfer.handshake import answer
from baton.kvtransfer.layout import KVLayout
from baton.kvtransfer.peer_auth import KVPeerAuth, session_of
from baton.kvtransfer.receiver import PendingTransfers, Transfer, TransferRejected
from baton.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc

Ack = kvtransfer_pb2.KVAck
Code = grpc.StatusCode
SERVICE = "baton.v1.KVTransfer"
DEFAULT_MAX_WINDOW_BYTES = 64 << 20
MAX_CRC_RETRIES = 3                  # NACKs of one chunk before the transfer fails with DATA_LOSS
MAX_CHUNKS = 1 << 20                 # bounds per-transfer bookkeeping whatever the sender claims
OPEN_TIMEOUT_S = 10.0                # a stream must say which transfer it carries by then
LINGER_S = 2.0                       # after REFUSED, how long to wait for the sender to half-close
THREADED_COPY_BYTES = 256 << 10      # smaller chunks are checked and copied inline: a thread hop costs more


class KVTransferServicer(kvtransfer_pb2_grpc.KVTransferServicer, KVReceiver):
    """Checks layouts and stages pushed chunks into the transfers `pending` expects."""

    backend = "grpc"

    def __init__(self, pending: PendingTransfers, local_layout: KVLayout, *,
                 max_chunk_bytes: int = MAX_CHUNK_BYTES, max_window_bytes: int = DEFAULT_MAX_WINDOW_BYTES,
                 max_crc_retries: int = MAX_CRC_RETRIES, open_timeout_s: float = OPEN_TIMEOUT_S,
                 auth: KVPeerAuth | None = None):
        if not 0 < max_chunk_bytes <= max_window_bytes:
            raise ValueError(f"need 0 < max_chunk_bytes ({max_chunk_bytes}) <= max_window_bytes "
                             f"({max_window_bytes})")
        self.pending = pending
        self.layout = local_layout
        self.max_chunk_bytes = max_chunk_bytes
        self.max_window_bytes = max_window_bytes
        self.max_crc_retries = max_crc_retries
        self.open_timeout_s = open_timeout_s
        self.auth = auth                  # None: any peer that reaches the port may push

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Like the generated add_KVTransferServicer_to_server, with Push's data chunks decoded as
        views of the received bytes (chunk_codec) instead of two protobuf copies."""
        handlers = {
            "Handshake": grpc.unary_unary_rpc_method_handler(
                self.Handshake, request_deserializer=kvtransfer_pb2.HandshakeRequest.FromString,
                response_serializer=kvtransfer_pb2.HandshakeResponse.SerializeToString),
            "Push": grpc.stream_stream_rpc_method_handler(
                self.Push, request_deserializer=decode_chunk, response_serializer=Ack.SerializeToString),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        server.add_registered_method_handlers(SERVICE, handlers)

    async def Handshake(self, request, context):
        return await answer(self.layout, self.auth, request, context, self.max_chunk_bytes, self.max_window_bytes)

    async def Push(self, request_iterator, context):
        push = _PushSession(self, context)
        if self.auth is not None and not self.auth.session_valid(session_of(context.invocation_metadata())):
            why = ("KV push without a valid session: handshake with the shared KV secret first (a restarted "
                   "decode worker forgets old sessions)")
            await push.refuse(why)                   # its messages are dropped unread; no transfer is touched
            push.stop_reading()
            await context.abort(Code.UNAUTHENTICATED, why)
        try:
            await push.run()
        except TransferRejected as exc:
            push.fail(str(exc), exc.code)            # blocks are freed now, not after the linger
            await push.refuse(str(exc))
            await context.abort(exc.code, str(exc))
        finally:          # cancelled, or any other way out: a transfer left unfinished is failed
            push.fail("the prefill worker's stream ended before the transfer completed", Code.CANCELLED)
            push.stop_reading()


class _PushSession:
    """One Push stream: one transfer's chunks, checked, staged, acknowledged."""

    def __init__(self, servicer: KVTransferServicer, context):
        self.s = servicer
        self.pending = servicer.pending
        self.context = context
        self.transfer: Transfer | None = None        # set once this stream owns (claimed) a transfer
        self.half_closed = False                      # the sender said it will write no more
        self.inbox: asyncio.Queue = asyncio.Queue()   # messages read ahead, then EOF or an error
        self.reader: asyncio.Task | None = None
        self.max_queued = 0                           # what the window lets a sender have in flight
        self.total = self.chunk_bytes = self.num_chunks = self.window = 0
        self.crcs: dict[int, int] = {}                # stored chunk index -> crc32
        self.nacks: dict[int, int] = {}
        self.stored_bytes = 0

    def fail(self, reason: str, code: grpc.StatusCode) -> None:
        if self.transfer is not None:                 # no-op once it ended
            self.pending.fail(self.transfer.transfer_id, reason, code)

    async def refuse(self, reason: str) -> None:
        """Say REFUSED, then let the sender half-close before the status goes out: a status that
        races the sender's writes can reach it as a bare INTERNAL instead of the real code."""
        self.start_reading(MAX_CHUNKS)
        with contextlib.suppress(Exception):
            await self.context.write(Ack(kind=Ack.KIND_REFUSED, reason=reason))
            async with asyncio.timeout(LINGER_S):
                while not self.half_closed:           # drop whatever was already on its way
                    msg = await self.inbox.get()
                    self.half_closed = msg is grpc.aio.EOF or isinstance(msg, Exception)

    def start_reading(self, max_queued: int) -> None:
        self.max_queued = max_queued
        if self.reader is None:
            self.reader = asyncio.get_running_loop().create_task(self._read_ahead())

    def stop_reading(self) -> None:
        if self.reader is not None:
            self.reader.cancel()

    async def _read_ahead(self) -> None:
        """Keep one read posted, so gRPC fetches chunk i+1 while chunk i is checked and copied."""
        try:
            while True:
                msg = await self.context.read()
                self.inbox.put_nowait(msg)
                if msg is grpc.aio.EOF:
                    return
                if self.inbox.qsize() > self.max_queued:
                    self.inbox.put_nowait(TransferRejected(
                        Code.RESOURCE_EXHAUSTED, f"more than {self.max_queued} chunks arrived unacknowledged: the "
                        f"sender ignored its {self.window}-byte window"))
                    return
        except Exception as exc:                      # the stream broke: the session learns it in order
            self.inbox.put_nowait(exc)

    async def run(self) -> None:
        try:
            first = await asyncio.wait_for(self.context.read(), self.s.open_timeout_s)
        except TimeoutError:
            raise TransferRejected(Code.DEADLINE_EXCEEDED, f"no message arrived within {self.s.open_timeout_s:g}s "
                                   "of opening the stream") from None
        if first is grpc.aio.EOF:
            self.half_closed = True
            return
        t = await self._open(first)
        self.start_reading(-(-self.window // self.chunk_bytes) + 1)
        await self.context.write(Ack(kind=Ack.KIND_CREDIT, credit=self.window))
        while True:
            msg = await self._next(self.pending.time_left(t), "the next chunk")
            self.pending.check_active(t)              # reaped or cancelled while we waited
            if msg is grpc.aio.EOF:
                raise TransferRejected(Code.DATA_LOSS, f"the prefill worker closed the stream of transfer "
                                       f"{t.transfer_id} after {self._progress()} without finishing it")
            if msg.transfer_id != t.transfer_id:
                raise TransferRejected(Code.INVALID_ARGUMENT, f"a Push stream carries one transfer: got a message "
                                       f"for {msg.transfer_id!r} in the stream of {t.transfer_id!r}")
            control = msg.WhichOneof("control")
            if control == "open":
                raise TransferRejected(Code.INVALID_ARGUMENT, f"transfer {t.transfer_id} was opened twice")
            if control == "done":
                self._finish(t, msg.done)
                await self.context.write(Ack(kind=Ack.KIND_DONE))
                return
            await self.context.write(await self._store(t, msg))

    async def _next(self, timeout: float, what: str):
        try:
            msg = await asyncio.wait_for(self.inbox.get(), max(0.0, timeout))
        except TimeoutError:
            raise TransferRejected(Code.DEADLINE_EXCEEDED, f"transfer {self.transfer.transfer_id} missed its "
                                   f"deadline waiting for {what}, after {self._progress()}") from None
        if isinstance(msg, Exception):
            raise msg
        self.half_closed = msg is grpc.aio.EOF
        return msg

    async def _open(self, msg) -> Transfer:
        if not msg.transfer_id:
            raise TransferRejected(Code.INVALID_ARGUMENT, "a Push stream's messages must name their transfer_id")
        t = self.pending.lookup(msg.transfer_id)              # NOT_FOUND, or how it ended
        if msg.WhichOneof("control") != "open":
            self.pending.fail(t.transfer_id, "its Push stream did not start with an open message")
            raise TransferRejected(Code.INVALID_ARGUMENT, f"the Push stream of transfer {t.transfer_id} must "
                                   "start with an open message")
        o = msg.open
        self.pending.claim(t, o.total_bytes)                  # size checked; one stream per transfer
        self.transfer = t
        if not 0 < o.chunk_bytes <= self.s.max_chunk_bytes:
            raise TransferRejected(Code.INVALID_ARGUMENT, f"chunk_bytes {o.chunk_bytes} is outside (0, "
                                   f"{self.s.max_chunk_bytes}] (the receiver's max_chunk_bytes)")
        self.total, self.chunk_bytes = o.total_bytes, o.chunk_bytes
        self.num_chunks = -(-self.total // self.chunk_bytes)
        if self.num_chunks > MAX_CHUNKS:
            raise TransferRejected(Code.INVALID_ARGUMENT, f"{self.num_chunks} chunks of {self.chunk_bytes} bytes "
                                   f"is too many (limit {MAX_CHUNKS}); send bigger chunks")
        asked = o.window_bytes or DEFAULT_WINDOW_BYTES
        self.window = max(self.chunk_bytes, min(asked, self.s.max_window_bytes))
        await self.pending.stage(t)                           # waits (bounded) for staging room
        return t

    async def _store(self, t: Transfer, msg) -> kvtransfer_pb2.KVAck:
        data = msg.data                                       # a view (DataChunk) or one copy (KVChunk)
        i, n = msg.index, len(data)
        if i >= self.num_chunks:
            raise TransferRejected(Code.INVALID_ARGUMENT, f"chunk index {i} is out of range: {self.total} bytes in "
                                   f"{self.chunk_bytes}-byte chunks make {self.num_chunks} chunks")
        start = i * self.chunk_bytes
        size = min(self.chunk_bytes, self.total - start)
        if msg.offset != start:
            raise TransferRejected(Code.INVALID_ARGUMENT, f"chunk {i} claims byte offset {msg.offset}; "
                                   f"with {self.chunk_bytes}-byte chunks it starts at {start}")
        if n != size:
            raise TransferRejected(Code.INVALID_ARGUMENT, f"chunk {i} has {n} bytes; it must have {size}")
        if i in self.crcs:                                    # a duplicate: acknowledged, not rewritten
            if msg.crc32 != self.crcs[i]:
                raise TransferRejected(Code.INVALID_ARGUMENT, f"chunk {i} was sent again with different contents")
            return Ack(kind=Ack.KIND_ACK, index=i, credit=n)
        actual = await _checked_copy(t.buffer[start:start + n], data, msg.crc32)
        if actual != msg.crc32:
            self.nacks[i] = self.nacks.get(i, 0) + 1
            if self.nacks[i] > self.s.max_crc_retries:
                raise TransferRejected(Code.DATA_LOSS, f"chunk {i} of transfer {t.transfer_id} failed its checksum "
                                       f"{self.nacks[i]} times (the link corrupts data)")
            return Ack(kind=Ack.KIND_NACK, index=i, credit=n,
                       reason=f"crc32 {actual:#010x} of the received bytes != {msg.crc32:#010x} sent")
        self.crcs[i] = actual
        self.stored_bytes += n
        return Ack(kind=Ack.KIND_ACK, index=i, credit=n)

    def _finish(self, t: Transfer, done: kvtransfer_pb2.PushDone) -> None:
        if self.stored_bytes != self.total:
            raise TransferRejected(Code.DATA_LOSS, f"truncated transfer {t.transfer_id}: done after "
                                   f"{self._progress()}")
        if done.num_chunks != self.num_chunks:
            raise TransferRejected(Code.INVALID_ARGUMENT, f"transfer {t.transfer_id} says it sent "
                                   f"{done.num_chunks} chunks; its size makes {self.num_chunks}")
        extra = dict(done.extra)
        if done.num_tokens:
            extra["num_tokens"] = str(done.num_tokens)
        self.pending.complete(t, done.first_token, extra)

    def _progress(self) -> str:
        return (f"{len(self.crcs)} of {self.num_chunks} chunks ({self.stored_bytes} of {self.total} bytes) "
                "arrived")



async def _checked_copy(dst: memoryview, src, crc: int) -> int:
    """Copy `src` into `dst` if its crc32 is `crc`; returns the crc32 found. Large chunks go to a worker
    thread (zlib and numpy's copy release the GIL), so the event loop keeps serving gRPC meanwhile."""
    if len(src) < THREADED_COPY_BYTES:
        return _check_then_copy(dst, src, crc)
    return await asyncio.get_running_loop().run_in_executor(None, _check_then_copy, dst, src, crc)


def _check_then_copy(dst: memoryview, src, crc: int) -> int:
    actual = zlib.crc32(src)
    if actual == crc:
        np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))
    return actual
