"""The in-memory KV backend ("memory"): prefill and decode workers in one process (service
tests, single-process tools). A decode worker's receiver registers its `PendingTransfers`
under its KV address in a process-wide table; a sender finds it there and hands each piece
over as it is: no wire, no copy. The registry's rules still hold (claim once, the size
announced, the staging bound, the deadline, exactly one callback), so the services see what
the other backends give them.
"""
from __future__ import annotations

import time

import grpc

from baton.engine.kv_handoff import KVPiece
from baton.engine.runner.kv_blocks import Pieces
from baton.kvtransfer.backend import (
    KVReceiver,
    KVSender,
    KVTransferError,
    OutgoingTransfer,
    SendStats,
    TransferDescriptor,
)
from baton.kvtransfer.layout import KVLayout, KVLayoutMismatch, check_compatible
from baton.kvtransfer.receiver import PendingTransfers, Transfer, TransferRejected

BACKEND = "memory"
Code = grpc.StatusCode
_RECEIVERS: dict[str, MemoryKVReceiver] = {}


class MemoryKVReceiver(KVReceiver):
    """Decode side: answers senders of this process looking for `address`."""

    backend = BACKEND

    def __init__(self, pending: PendingTransfers, layout: KVLayout, address: str):
        self.pending = pending
        self.layout = layout
        self.address = address

    def add_to_server(self, server) -> None:
        if _RECEIVERS.get(self.address, self) is not self:
            raise ValueError(f"another in-memory KV receiver already answers for {self.address}")
        _RECEIVERS[self.address] = self

    async def close(self) -> None:
        if _RECEIVERS.get(self.address) is self:
            del _RECEIVERS[self.address]


class MemoryKVSender(KVSender):
    """Prefill side, one per decode worker of this process."""

    backend = BACKEND

    def __init__(self, address: str):
        self.address = address
        self.peer_layout: KVLayout | None = None

    def _peer(self) -> MemoryKVReceiver:
        peer = _RECEIVERS.get(self.address)
        if peer is None:
            raise KVTransferError(f"no in-memory KV receiver at {self.address} in this process (the memory "
                                  "backend needs prefill and decode workers in one process)", Code.UNAVAILABLE)
        return peer

    async def handshake(self, layout: KVLayout, timeout: float = 10.0) -> KVLayout:
        peer = self._peer()
        try:
            check_compatible(peer.layout, layout)
        except KVLayoutMismatch as exc:
            raise KVTransferError(str(exc), Code.FAILED_PRECONDITION) from exc
        self.peer_layout = peer.layout
        return peer.layout

    async def open(self, transfer: TransferDescriptor | str, timeout: float = 30.0) -> MemoryOutgoing:
        transfer = TransferDescriptor.of(transfer)
        pending = self._peer().pending
        try:
            t = pending.lookup(transfer.transfer_id)
            pending.claim(t, transfer.nbytes)
            await pending.stage(t, allocate=lambda nbytes: [])       # the pieces themselves are the staging
        except TransferRejected as exc:
            raise KVTransferError(str(exc), exc.code) from exc
        block = self.peer_layout.block_nbytes if self.peer_layout is not None else 0
        return MemoryOutgoing(pending, t, transfer.nbytes // block if block else 0)


class MemoryOutgoing(OutgoingTransfer):
    def __init__(self, pending: PendingTransfers, t: Transfer, num_blocks: int):
        self.pending = pending
        self.t = t
        self.num_blocks = num_blocks
        self.next_block = 0
        self.token_sent = False
        self.opened = time.perf_counter()

    async def piece(self, piece: KVPiece) -> None:
        try:
            self.pending.check_active(self.t)
        except TransferRejected as exc:
            raise KVTransferError(str(exc), exc.code) from exc
        if piece.first_block != self.next_block or self.token_sent:
            self.abandon("pieces out of order")
            raise KVTransferError(f"transfer {self.t.transfer_id}: a piece from block {piece.first_block} where "
                                  f"block {self.next_block} was due", Code.INVALID_ARGUMENT)
        if self.num_blocks and _nbytes(piece.data) != piece.num_blocks * self.t.nbytes // self.num_blocks:
            self.abandon("payload mismatch")
            raise KVTransferError(f"transfer {self.t.transfer_id}: a piece of {piece.num_blocks} blocks must hold "
                                  f"{piece.num_blocks * self.t.nbytes // self.num_blocks} bytes, not "
                                  f"{_nbytes(piece.data)}", Code.INVALID_ARGUMENT)
        if piece.last and piece.first_block + piece.num_blocks != self.num_blocks and self.num_blocks:
            self.abandon("the last piece came early")
            raise KVTransferError(f"transfer {self.t.transfer_id}: the last piece ends at block "
                                  f"{piece.first_block + piece.num_blocks} of {self.num_blocks} (a truncated payload)",
                                  Code.INVALID_ARGUMENT)
        if piece.ready is not None:
            piece.ready.synchronize()
        self.t.buffer.append((piece.first_block, piece.num_blocks, piece.data))
        self.next_block += piece.num_blocks
        if piece.last:
            self.token_sent = True
            parts = tuple(self.t.buffer)
            payload = parts[0][2] if len(parts) == 1 else Pieces(parts)
            try:
                self.pending.complete(self.t, piece.first_token, dict(piece.meta), payload)
            except TransferRejected as exc:
                raise KVTransferError(str(exc), exc.code) from exc

    async def done(self) -> SendStats:
        if not self.token_sent:
            raise KVTransferError(f"transfer {self.t.transfer_id} has not sent its last piece",
                                  Code.FAILED_PRECONDITION)
        return SendStats(nbytes=self.t.nbytes, chunks=len(self.t.buffer), seconds=time.perf_counter() - self.opened)

    def abandon(self, reason: str) -> None:
        self.pending.fail(self.t.transfer_id, f"the prefill worker gave it up: {reason}", Code.ABORTED)


def _nbytes(data) -> int:
    if hasattr(data, "element_size"):                # a tensor
        return data.numel() * data.element_size()
    return memoryview(data).nbytes


def make_sender(ctx) -> MemoryKVSender:
    return MemoryKVSender(ctx.address)


def make_receiver(ctx) -> MemoryKVReceiver:
    return MemoryKVReceiver(ctx.pending, ctx.layout, ctx.address)
