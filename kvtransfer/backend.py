"""The KV-transfer interface every backend implements: how one request's KV goes from a
prefill worker to a decode worker.

Sending (prefill side): a `KVSender` per decode worker handshakes once (layout, secret),
may `warm` up (whatever one-time set-up its first transfer would pay: a device backend's
communicator, NIXL's connection), then `open`s each transfer under the id the decode worker handed out at admission, before
the KV exists (when the prefill starts). The returned `OutgoingTransfer` takes the prompt's
KV as `KVPiece`s, in block order, as the engine makes them final; the last piece carries the
first sampled token; `done` waits for the decode worker's word; `abandon` gives it up (the
decode worker frees its blocks at once). `send` is the one-piece case: open, one piece, done.

Receiving (decode side): a `KVReceiver` serves its backend's wire and reports into the
decode worker's `PendingTransfers` (receiver.py), which calls the decode worker back exactly
once per transfer: complete (with the payload) or failed.

Backends, one folder each, listed in `registry.py`:
  grpc_backend/    portable: host-staged bytes in CRC-checked chunks with credit flow control
  direct_backend/  device to device over a two-rank NCCL / HCCL / gloo communicator per
                   worker pair; gRPC carries descriptors only
  nixl_backend/    NIXL (UCX picks the transport): the prefill worker writes into the decode
                   worker's registered memory; gRPC carries descriptors only
  memory_backend/  both ends in one process (tests, single-process tools): pieces handed over
"""
from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from baton.engine.kv_handoff import KVPiece
from baton.kvtransfer.layout import KVLayout

# What `send` is given: the payload itself, or a zero-argument function (sync or async) that
# produces it, called only once the receiver has accepted the transfer, so a refused transfer
# costs no packing. The grpc backend wants host bytes (bytes, bytearray, memoryview or a CPU
# uint8 tensor), device-direct backends a uint8 tensor on their device.
PayloadProvider = object | Callable[[], object] | Callable[[], Awaitable[object]]


class KVTransferError(Exception):
    """A transfer failed; `code` is the grpc.StatusCode a caller can map to its own reply."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class TransferDescriptor:
    """Which transfer: what the decode worker's admission (and the router's handoff) said."""

    transfer_id: str
    nbytes: int = -1                     # payload size, when known before the payload exists
    num_tokens: int = 0                  # tokens whose KV the payload holds (0: not stated)
    backend: str = "grpc"

    @classmethod
    def of(cls, transfer: TransferDescriptor | str) -> TransferDescriptor:
        return transfer if isinstance(transfer, TransferDescriptor) else cls(transfer_id=transfer)


@dataclass(slots=True)
class SendStats:
    """What one transfer did, for metrics and benchmarks."""

    nbytes: int = 0
    chunks: int = 0                      # wire messages that carried bytes (grpc chunks, direct pieces)
    resent_chunks: int = 0
    max_in_flight_bytes: int = 0         # never more than the window the receiver granted
    window_bytes: int = 0
    seconds: float = 0.0


class OutgoingTransfer(ABC):
    """One open transfer, prefill side. Any failure ends it; after that every call raises."""

    num_blocks: int                      # blocks the descriptor promised (0 when it stated no size)
    next_block: int                      # pieces so far covered [0, next_block)
    token_sent: bool                     # the first token went (with the last piece)

    @abstractmethod
    async def piece(self, piece: KVPiece) -> None:
        """Send the next blocks (piece.first_block must be next_block). Returns once the piece
        is on its way (its bytes may still be moving); a failure raises KVTransferError."""

    @abstractmethod
    async def done(self) -> SendStats:
        """After the last piece: wait until every byte landed and the decode worker took it."""

    @abstractmethod
    def abandon(self, reason: str) -> None:
        """Give the transfer up (no-op once ended): the decode worker frees it now, not at its
        deadline."""


class KVSender(ABC):
    """Prefill side, one per decode worker (peer)."""

    backend: str

    @abstractmethod
    async def handshake(self, layout: KVLayout, timeout: float = 10.0) -> KVLayout:
        """Check compatibility with the peer; returns its layout, raises KVTransferError
        (FAILED_PRECONDITION naming every differing field) on a mismatch."""

    async def warm(self, timeout: float = 10.0) -> None:
        """After the handshake: set up now what the first transfer would otherwise set up (a
        device pair's communicator, a connection), moving no request's KV; raises KVTransferError
        within `timeout`. A backend whose handshake is all it needs has nothing to do."""
        return None

    @abstractmethod
    async def open(self, transfer: TransferDescriptor | str, timeout: float = 30.0) -> OutgoingTransfer:
        """Open a transfer; `timeout` bounds the whole of it, up to `done`."""

    async def send(self, transfer: TransferDescriptor | str, payload_provider: PayloadProvider,
                   first_token: int, extra: dict[str, str] | None = None, timeout: float = 30.0) -> SendStats:
        """The whole payload in one piece, with the first token: open, send, wait for the
        peer's word. Raises KVTransferError within `timeout` whatever the peer does."""
        transfer = TransferDescriptor.of(transfer)
        out = await self.open(transfer, timeout)
        try:
            payload = await resolve_payload(payload_provider)
            await out.piece(KVPiece("", 0, out.num_blocks, payload, None, first_token,
                                    {k: str(v) for k, v in (extra or {}).items()}))
            return await out.done()
        except BaseException as exc:
            out.abandon(f"the send failed: {exc!r}")
            raise

    async def close(self) -> None:
        """Release connections; open transfers fail."""
        return None


class KVReceiver(ABC):
    """Decode side: serves one backend's wire and reports into a `PendingTransfers`."""

    backend: str

    @abstractmethod
    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register the gRPC services this backend needs (data or descriptors)."""

    async def close(self) -> None:
        """Stop receiving; transfers in progress are failed by their registry."""
        return None


async def resolve_payload(provider: PayloadProvider) -> object:
    """The payload a provider stands for (calling it, and awaiting the result, if needed)."""
    if not callable(provider):
        return provider
    result = provider()
    return await result if inspect.isawaitable(result) else result
