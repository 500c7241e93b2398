"""The portable KV backend: a request's payload over gRPC, in chunks, with credit.

One Push stream per transfer: `open` (size, chunk size, window asked for) -> CREDIT ack;
data chunks, each ACKed or NACKed (bad checksum: send it again) with its bytes of credit
returned, so the sender never has more than the window in flight; `done` (first token,
metadata) -> DONE ack once the decode engine has the payload. A rejection fails the
transfer at once (the decode worker frees its blocks), answers REFUSED, and ends the stream
with the status code once the sender has half-closed.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
import zlib
from collections import deque

import grpc
import numpy as np

from baton.kvtransfer.backend import (
    KVReceiver,
    KVSender,
    KVTransferError,
    PayloadProvider,
    SendStats,
    TransferDescriptor,
    resolve_payload,
)
from baton.kvtransfer.chunk_codec import decode_chunk, encode_chunk, transfer_id_field
from baton.kvtransfer.grpc_options import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_WINDOW_BYTES,
    MAX_CHUNK_BYTES,
    channel_options,
)
from baton.kvtransfer.layout import KVLayout, KVLayoutMismatch, check_compatible
from baton.kvtransfer.peer_auth import SESSION_KEY, KVPeerAuth, PeerAuthError, session_of
from baton.kvtransfer.receiver import PendingTransfers, Transfer, TransferRejected
from baton.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc

Ack = kvtransfer_pb2.KVAck
Code = grpc.StatusCode
SERVICE = "baton.v1.KVTransfer"
PUSH_METHOD = f"/{SERVICE}/Push"
DEFAULT_MAX_WINDOW_BYTES = 64 << 20
MAX_CRC_RETRIES = 3                  # NACKs of one chunk before the transfer fails with DATA_LOSS
MAX_CHUNKS = 1 << 20                 # bounds per-transfer bookkeeping whatever the sender claims
OPEN_TIMEOUT_S = 10.0                # a stream must say which transfer it carries by then
LINGER_S = 2.0                       # after REFUSED, how long to wait for the sender to half-close
THREADED_COPY_BYTES = 256 << 10      # smaller chunks are checked and copied inline: a thread hop costs more


# -- decode side ---------------------------------------------------------------------------------
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
        try:
            remote = KVLayout.from_proto(request.layout)
        except ValueError as exc:
            await context.abort(Code.INVALID_ARGUMENT, f"the prefill worker sent an unusable KV layout: {exc}")
        session = proof = b""
        if self.auth is not None:     # the secret first: a stranger learns nothing, not even our layout
            try:
                session, proof = self.auth.accept(request.nonce, request.unix_ms, request.proof,
                                                  request.layout.SerializeToString(deterministic=True))
            except PeerAuthError as exc:
                await context.abort(Code.UNAUTHENTICATED, str(exc))
        try:
            check_compatible(self.layout, remote)
        except KVLayoutMismatch as exc:
            await context.abort(Code.FAILED_PRECONDITION, str(exc))
        return kvtransfer_pb2.HandshakeResponse(layout=self.layout.to_proto(), max_chunk_bytes=self.max_chunk_bytes,
                                                max_window_bytes=self.max_window_bytes, session=session, proof=proof)

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


# -- prefill side ----------------------------------------------------------------------------------
class GrpcKVSender(KVSender):
    """Pushes payloads to one decode worker's KVTransfer service; one Push stream per transfer,
    so concurrent sends share the channel."""

    backend = "grpc"

    def __init__(self, channel_or_address: grpc.aio.Channel | str, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 window_bytes: int = DEFAULT_WINDOW_BYTES, auth: KVPeerAuth | None = None):
        if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in (0, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
        if window_bytes < chunk_bytes:
            raise ValueError(f"window_bytes ({window_bytes}) must hold at least one chunk ({chunk_bytes})")
        if isinstance(channel_or_address, str):
            self.address = channel_or_address
            self.channel = grpc.aio.insecure_channel(channel_or_address, options=channel_options())
            self._owns_channel = True
        else:
            self.address = "its peer"
            self.channel = channel_or_address
            self._owns_channel = False
        self.stub = kvtransfer_pb2_grpc.KVTransferStub(self.channel)
        # Push taking data chunks pre-encoded by encode_chunk (one copy of the payload) or messages
        self._push_call = self.channel.stream_stream(
            PUSH_METHOD, request_serializer=_serialize, response_deserializer=Ack.FromString)
        self.chunk_bytes = chunk_bytes
        self.window_bytes = window_bytes
        self.peer_layout: KVLayout | None = None
        self.auth = auth
        self._layout: KVLayout | None = None
        self._metadata: tuple[tuple[str, str], ...] = ()

    async def handshake(self, layout: KVLayout, timeout: float = 10.0) -> KVLayout:
        request = kvtransfer_pb2.HandshakeRequest(layout=layout.to_proto())
        if self.auth is not None:
            request.nonce, request.unix_ms, request.proof = self.auth.hello(
                request.layout.SerializeToString(deterministic=True))
        try:
            reply = await self.stub.Handshake(request, timeout=timeout)
            if self.auth is not None:
                self.auth.check_reply(request.nonce, reply.session, reply.proof)
            peer = KVLayout.from_proto(reply.layout)
            check_compatible(layout, peer, local_role="prefill", remote_role="decode")
        except grpc.aio.AioRpcError as exc:
            raise KVTransferError(f"KV handshake with {self.address} failed: {exc.details()}", exc.code()) from exc
        except PeerAuthError as exc:
            raise KVTransferError(f"KV handshake with {self.address}: {exc}", Code.UNAUTHENTICATED) from exc
        except ValueError as exc:               # an unusable or mismatching layout in the reply
            raise KVTransferError(f"KV handshake with {self.address}: {exc}", Code.FAILED_PRECONDITION) from exc
        self._layout = layout
        self._metadata = ((SESSION_KEY, reply.session.hex()),) if reply.session else ()
        if reply.max_chunk_bytes:
            self.chunk_bytes = min(self.chunk_bytes, reply.max_chunk_bytes)
        if reply.max_window_bytes:
            self.window_bytes = max(self.chunk_bytes, min(self.window_bytes, reply.max_window_bytes))
        self.peer_layout = peer
        return peer

    @property
    def session_metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata proving the handshake (empty without a KV secret), for other services
        of the same peer (the direct backend's KVDirect)."""
        return self._metadata

    async def send(self, transfer: TransferDescriptor | str, payload_provider: PayloadProvider,
                   first_token: int, extra: dict[str, str] | None = None, timeout: float = 30.0) -> SendStats:
        transfer = TransferDescriptor.of(transfer)
        if self.peer_layout is None:
            raise KVTransferError(f"handshake with {self.address} before sending KV", Code.FAILED_PRECONDITION)
        try:
            return await self._send(transfer, payload_provider, first_token, extra, timeout)
        except KVTransferError as exc:    # the receiver restarted and forgot our session: once more
            if exc.code != Code.UNAUTHENTICATED or self.auth is None:
                raise
        await self.handshake(self._layout, timeout=min(timeout, 10.0))
        return await self._send(transfer, payload_provider, first_token, extra, timeout)

    async def _send(self, transfer: TransferDescriptor, payload_provider: PayloadProvider, first_token: int,
                    extra: dict[str, str] | None, timeout: float) -> SendStats:
        started = time.perf_counter()
        call = self._push_call(timeout=timeout, metadata=self._metadata)   # the receiver sees this deadline too
        acks = _AckReader(call)
        try:
            async with asyncio.timeout(timeout):
                stats = await self._push(call, acks, transfer, payload_provider, first_token, extra or {})
        except TimeoutError:
            raise KVTransferError(f"KV push of {transfer.transfer_id} to {self.address} did not finish within "
                                  f"{timeout:g}s", Code.DEADLINE_EXCEEDED) from None
        except KVTransferError as exc:
            raise KVTransferError(f"KV push of {transfer.transfer_id} to {self.address} failed: {exc}",
                                  exc.code) from exc
        except grpc.aio.AioRpcError as exc:
            raise KVTransferError(f"KV push of {transfer.transfer_id} to {self.address} failed: {exc.details()}",
                                  exc.code()) from exc
        finally:                                          # on any failure the receiver sees a cancel
            acks.close()
            if not call.done():
                call.cancel()
        stats.seconds = time.perf_counter() - started
        return stats

    async def _push(self, call, acks: _AckReader, transfer: TransferDescriptor, provider, first_token: int,
                    extra: dict[str, str]) -> SendStats:
        tid = transfer.transfer_id
        payload = None
        if transfer.nbytes < 0:                           # size unknown: materialize the payload first
            payload = _byte_view(await resolve_payload(provider))
        total = transfer.nbytes if transfer.nbytes >= 0 else len(payload)
        chunk = self.chunk_bytes
        await _write(call, acks, kvtransfer_pb2.KVChunk(transfer_id=tid, open=kvtransfer_pb2.PushOpen(
            total_bytes=total, chunk_bytes=chunk, window_bytes=self.window_bytes)))
        grant = await acks.next(Ack.KIND_CREDIT)
        if payload is None:                               # accepted: now it is worth producing
            payload = _byte_view(await acks.unless_refused(resolve_payload(provider)))
            if len(payload) != total:
                raise KVTransferError(f"the payload has {len(payload)} bytes, its descriptor said {total}",
                                      Code.INVALID_ARGUMENT)
        num_chunks = -(-total // chunk)
        stats = SendStats(nbytes=total, chunks=num_chunks, window_bytes=grant.credit)
        credit, in_flight = grant.credit, 0
        todo: deque[int] = deque(range(num_chunks))
        encoded = _Encoder(transfer_id_field(tid), payload, chunk)
        while todo or in_flight:
            while todo and credit >= _chunk_size(todo[0], chunk, total):
                i = todo.popleft()
                if todo:                                  # checksum the next one while this one goes out
                    encoded.start(todo[0])
                await _write(call, acks, await encoded.take(i))
                credit -= _chunk_size(i, chunk, total)
                in_flight += _chunk_size(i, chunk, total)
                stats.max_in_flight_bytes = max(stats.max_in_flight_bytes, in_flight)
            ack = await acks.next(Ack.KIND_ACK, Ack.KIND_NACK)
            if ack.index >= num_chunks:
                raise KVTransferError(f"the receiver acknowledged chunk {ack.index} of {num_chunks}", Code.INTERNAL)
            credit += ack.credit
            in_flight -= _chunk_size(ack.index, chunk, total)
            if ack.kind == Ack.KIND_NACK:                 # corrupted on the way: send it again
                todo.appendleft(ack.index)
                stats.resent_chunks += 1
        await _write(call, acks, kvtransfer_pb2.KVChunk(transfer_id=tid, done=kvtransfer_pb2.PushDone(
            first_token=first_token, num_tokens=transfer.num_tokens, num_chunks=num_chunks,
            extra={k: str(v) for k, v in extra.items()})))
        await acks.next(Ack.KIND_DONE)
        await call.done_writing()
        if (code := await call.code()) is not Code.OK:     # DONE came first, so this is not expected
            raise KVTransferError(await call.details() or code.name, code)
        return stats

    async def close(self) -> None:
        if self._owns_channel:
            await self.channel.close()


class _AckReader:
    """Reads a Push stream's acks in the background, so a refusal is noticed whatever the sender is
    doing (writing, waiting for credit, producing the payload)."""

    def __init__(self, call):
        self.call = call
        self.inbox: asyncio.Queue = asyncio.Queue()       # acks, then None (stream over) or the error
        self.task = asyncio.get_running_loop().create_task(self._pump())

    async def _pump(self) -> None:
        try:
            while (ack := await self.call.read()) is not grpc.aio.EOF:
                self.inbox.put_nowait(ack)
            self.inbox.put_nowait(None)
        except grpc.aio.AioRpcError as exc:
            self.inbox.put_nowait(exc)

    async def next(self, *kinds: int) -> kvtransfer_pb2.KVAck:
        """The next ack, which must be one of `kinds`; raises KVTransferError otherwise."""
        item = await self.inbox.get()
        if isinstance(item, Ack) and item.kind in kinds:
            return item
        await self._raise(item, kinds)

    async def unless_refused(self, work):
        """Await `work`, unless the receiver refuses or ends the stream first."""
        task = asyncio.ensure_future(work)
        news = asyncio.ensure_future(self.inbox.get())    # cancelling a Queue.get loses nothing
        try:
            await asyncio.wait((task, news), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for f in (task, news):
                f.cancel()
        if task.done() and not task.cancelled() and not news.done():
            return task.result()
        await self._raise(news.result(), ())

    async def _raise(self, item, expected: tuple[int, ...]):
        if isinstance(item, grpc.aio.AioRpcError):
            raise KVTransferError(item.details() or item.code().name, item.code())
        if isinstance(item, Ack) and item.kind == Ack.KIND_REFUSED:
            with contextlib.suppress(Exception):
                await self.call.done_writing()
            status = await self.inbox.get()               # the status, with its code, follows the half-close
            if isinstance(status, grpc.aio.AioRpcError):
                raise KVTransferError(status.details() or item.reason, status.code())
            raise KVTransferError(item.reason, Code.UNKNOWN)
        if item is None:
            raise KVTransferError("the receiver ended the stream early", Code.INTERNAL)
        raise KVTransferError(f"the receiver answered {Ack.Kind.Name(item.kind)} where "
                              f"{'/'.join(Ack.Kind.Name(k) for k in expected)} was due", Code.INTERNAL)

    async def raise_why_it_ended(self):
        """The stream ended under a write: skip the acks still queued, raise the reason."""
        while isinstance(item := await self.inbox.get(), Ack) and item.kind != Ack.KIND_REFUSED:
            pass
        await self._raise(item, ())

    def close(self) -> None:
        self.task.cancel()


async def _write(call, acks: _AckReader, msg) -> None:
    try:
        await call.write(msg)
    except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
        await acks.raise_why_it_ended()


class _Encoder:
    """Encodes chunks on a worker thread, one ahead of the writes: zlib.crc32 releases the GIL, so the
    checksum of chunk i+1 overlaps gRPC sending chunk i."""

    def __init__(self, tid_field: bytes, payload: memoryview, chunk: int):
        self.tid_field, self.payload, self.chunk = tid_field, payload, chunk
        self.futures: dict[int, asyncio.Future] = {}

    def start(self, i: int) -> None:
        if i not in self.futures:
            data = self.payload[i * self.chunk:(i + 1) * self.chunk]
            self.futures[i] = asyncio.get_running_loop().run_in_executor(
                None, encode_chunk, self.tid_field, i, i * self.chunk, data)

    async def take(self, i: int) -> bytes:
        self.start(i)
        return await self.futures.pop(i)


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


def _serialize(msg: kvtransfer_pb2.KVChunk | bytes) -> bytes:
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def _chunk_size(index: int, chunk: int, total: int) -> int:
    return min(chunk, total - index * chunk)


def _byte_view(payload) -> memoryview:
    """Bytes-like or CPU uint8 tensor (what pack_blocks returns) -> flat byte view, no copy."""
    if hasattr(payload, "numpy") and hasattr(payload, "dtype"):          # a torch tensor
        if str(payload.dtype) != "torch.uint8" or payload.device.type != "cpu" or not payload.is_contiguous():
            raise KVTransferError(f"the grpc backend sends contiguous CPU uint8 tensors (pack_blocks' output), "
                                  f"got {payload.dtype} on {payload.device}", Code.INVALID_ARGUMENT)
        payload = payload.numpy()
    return memoryview(payload).cast("B")
