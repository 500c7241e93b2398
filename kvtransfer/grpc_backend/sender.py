"""The prefill side of the gRPC backend: a request's KV pushed over `baton.v1.KVTransfer`, in
CRC-checked chunks, with credit.

One Push stream per transfer: OPEN (size, chunk size, window asked for) -> CREDIT; data
chunks, each ACKed or NACKed (bad checksum: sent again) with its bytes of credit returned,
so the sender never has more than the window in flight; DONE (first token, metadata) -> DONE
ack once the decode engine has the payload. A refusal fails the transfer on both ends.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable

import grpc
import numpy as np
import torch

from baton.engine.kv_handoff import KVPiece
from baton.kvtransfer.backend import (
    KVSender,
    KVTransferError,
    OutgoingTransfer,
    PayloadProvider,
    SendStats,
    TransferDescriptor,
    resolve_payload,
)
from baton.kvtransfer.grpc_backend.chunk_codec import encode_chunk, transfer_id_field
from baton.kvtransfer.grpc_backend.servicer import SERVICE
from baton.kvtransfer.grpc_options import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_WINDOW_BYTES,
    MAX_CHUNK_BYTES,
    channel_options,
)
from baton.kvtransfer.handshake import handshake
from baton.kvtransfer.layout import KVLayout
from baton.kvtransfer.peer_auth import KVPeerAuth
from baton.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc

Ack = kvtransfer_pb2.KVAck
Code = grpc.StatusCode
PUSH_METHOD = f"/{SERVICE}/Push"
Finish = Callable[[], tuple[int, dict[str, str]]]     # the first token and metadata, once the chunks are sent


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
        done = await handshake(self.channel, self.address, layout, self.auth, timeout)
        self._layout = layout
        self._metadata = done.metadata
        if done.max_chunk_bytes:
            self.chunk_bytes = min(self.chunk_bytes, done.max_chunk_bytes)
        if done.max_window_bytes:
            self.window_bytes = max(self.chunk_bytes, min(self.window_bytes, done.max_window_bytes))
        self.peer_layout = done.peer
        return done.peer

    @property
    def session_metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata proving the handshake (empty without a KV secret), for other services
        of the same peer (the direct backend's KVDirect)."""
        return self._metadata

    async def open(self, transfer: TransferDescriptor | str, timeout: float = 30.0) -> GrpcOutgoing:
        """Open the transfer's Push stream now (its OPEN/CREDIT round trip hides under the
        prefill); returns once the receiver granted credit, or at once when the descriptor states
        no size (the stream then opens with the last piece)."""
        transfer = TransferDescriptor.of(transfer)
        self._check_handshaken()
        out = GrpcOutgoing(self, transfer, timeout)
        if transfer.nbytes >= 0:
            await out.credited()
        return out

    async def send(self, transfer: TransferDescriptor | str, payload_provider: PayloadProvider,
                   first_token: int, extra: dict[str, str] | None = None, timeout: float = 30.0) -> SendStats:
        transfer = TransferDescriptor.of(transfer)
        self._check_handshaken()
        return await self.send_with_retry(transfer, payload_provider, lambda: (first_token, extra or {}), timeout)

    def _check_handshaken(self) -> None:
        if self.peer_layout is None:
            raise KVTransferError(f"handshake with {self.address} before sending KV", Code.FAILED_PRECONDITION)

    async def send_with_retry(self, transfer: TransferDescriptor, provider: PayloadProvider, finish: Finish,
                               timeout: float, credited: asyncio.Future | None = None) -> SendStats:
        try:
            return await self._send(transfer, provider, finish, timeout, credited)
        except KVTransferError as exc:    # the receiver restarted and forgot our session: once more
            if exc.code != Code.UNAUTHENTICATED or self.auth is None:
                raise
        await self.handshake(self._layout, timeout=min(timeout, 10.0))
        return await self._send(transfer, provider, finish, timeout, credited)

    async def _send(self, transfer: TransferDescriptor, payload_provider: PayloadProvider, finish: Finish,
                    timeout: float, credited: asyncio.Future | None) -> SendStats:
        started = time.perf_counter()
        call = self._push_call(timeout=timeout, metadata=self._metadata)   # the receiver sees this deadline too
        acks = _AckReader(call)
        try:
            async with asyncio.timeout(timeout):
                stats = await self._push(call, acks, transfer, payload_provider, finish, credited)
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

    async def _push(self, call, acks: _AckReader, transfer: TransferDescriptor, provider, finish: Finish,
                    credited: asyncio.Future | None) -> SendStats:
        tid = transfer.transfer_id
        payload = None
        if transfer.nbytes < 0:                           # size unknown: materialize the payload first
            payload = _byte_view(await resolve_payload(provider))
        total = transfer.nbytes if transfer.nbytes >= 0 else len(payload)
        chunk = self.chunk_bytes
        await _write(call, acks, kvtransfer_pb2.KVChunk(transfer_id=tid, open=kvtransfer_pb2.PushOpen(
            total_bytes=total, chunk_bytes=chunk, window_bytes=self.window_bytes)))
        grant = await acks.next(Ack.KIND_CREDIT)
        if credited is not None and not credited.done():
            credited.set_result(None)
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
        first_token, extra = finish()
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

class GrpcOutgoing(OutgoingTransfer):
    """A transfer on its own Push stream. The pieces gather in host memory (a device piece is
    copied off the event loop once its `ready` event has passed); the last one, with the first
    token, lets the chunks and the DONE go. `abandon` cancels the stream: the receiver fails the
    transfer and frees the decode worker's blocks at once."""

    def __init__(self, sender: GrpcKVSender, transfer: TransferDescriptor, timeout: float):
        loop = asyncio.get_running_loop()
        self.sender = sender
        self.transfer = transfer
        block = sender.peer_layout.block_nbytes if sender.peer_layout is not None else 0
        self.num_blocks = transfer.nbytes // block if block and transfer.nbytes > 0 else 0
        self.next_block = 0
        self.token_sent = False
        self._parts: list[memoryview] = []
        self._payload: asyncio.Future = loop.create_future()
        self._credited: asyncio.Future = loop.create_future()
        self._token: tuple[int, dict[str, str]] = (0, {})
        self._task = asyncio.ensure_future(
            sender.send_with_retry(transfer, self._wait_payload, lambda: self._token, timeout, self._credited))
        self._task.add_done_callback(_retrieve)

    async def credited(self) -> None:
        """Until the receiver granted credit; raises what ended the transfer first."""
        await asyncio.wait({self._credited, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if not self._credited.done():
            self._task.result()

    async def _wait_payload(self) -> memoryview:
        return await asyncio.shield(self._payload)      # a refused attempt must not cancel the future

    async def piece(self, piece: KVPiece) -> None:
        if self._task.done():
            self._task.result()                          # raises why it ended
            raise KVTransferError(f"transfer {self.transfer.transfer_id} has ended", Code.FAILED_PRECONDITION)
        if piece.first_block != self.next_block or self.token_sent:
            self.abandon("pieces out of order")
            raise KVTransferError(f"transfer {self.transfer.transfer_id}: a piece from block {piece.first_block} "
                                  f"where block {self.next_block} was due", Code.INVALID_ARGUMENT)
        self._parts.append(await _host_bytes(piece))
        self.next_block += piece.num_blocks
        if piece.last:
            self._token = (piece.first_token, dict(piece.meta))
            self.token_sent = True
            rows = 2 * self.sender.peer_layout.num_layers if self.sender.peer_layout is not None else 1
            self._payload.set_result(self._parts[0] if len(self._parts) == 1 else _joined(self._parts, rows))

    async def done(self) -> SendStats:
        if not self.token_sent:
            self.abandon("done before the last piece")
            raise KVTransferError(f"transfer {self.transfer.transfer_id} has not sent its last piece",
                                  Code.FAILED_PRECONDITION)
        return await self._task

    def abandon(self, reason: str) -> None:
        if not self._task.done():
            self._task.cancel()


async def _host_bytes(piece: KVPiece) -> memoryview:
    """The piece's bytes in host memory: a CPU payload as it is, a device tensor copied (into
    page-locked memory) on a worker thread once final."""
    data = piece.data
    if isinstance(data, torch.Tensor) and data.device.type != "cpu":
        data = await asyncio.get_running_loop().run_in_executor(None, _copy_to_host, data, piece.ready)
    return _byte_view(data)


def _copy_to_host(data: torch.Tensor, ready) -> torch.Tensor:
    if ready is not None:
        ready.synchronize()
    host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
    host.copy_(data)
    return host


def _joined(parts: list[memoryview], rows: int) -> memoryview:
    """Pieces of consecutive blocks -> the payload of all of them. A payload is kv[:, :, blocks]
    ([layers, 2, blocks, ...]): each (layer, K/V) row holds every block's bytes in turn, so the
    pieces are joined row by row, not end to end."""
    joined = np.concatenate([np.frombuffer(p, np.uint8).reshape(rows, -1) for p in parts], axis=1)
    return memoryview(joined.reshape(-1)).cast("B")


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


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
