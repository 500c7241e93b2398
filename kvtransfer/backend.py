"""The backend interface: how one request's KV goes from a prefill worker to a decode worker.

Sending: a `KVSender` per decode worker handshakes once, then `send`s each request's payload
under the transfer id the decode worker handed out at admission, with the first sampled
token. Receiving: a `KVReceiver` feeds arriving payloads into the decode worker's
`PendingTransfers`, which calls the engine back exactly once per transfer.

The portable `grpc` backend streams the bytes over gRPC. A device-direct backend (NCCL on
GPUs, HCCL on Ascend) implements the same two classes, but gRPC carries only descriptors:
its receiver publishes `backend_params` (e.g. a communicator id) in the admission reply, its
sender's payload provider yields a device tensor, and the bytes go device to device.
"""
from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from baton.kvtransfer.layout import KVLayout

# What a sender is given to send: the payload itself, or a zero-argument function (sync or
# async) that produces it, called only once the receiver has accepted the transfer (when the
# descriptor states nbytes), so a rejected transfer costs no packing. A sync function runs on
# the event loop: make heavy packing async (e.g. run pack_blocks on the engine thread). The
# grpc backend wants host bytes (bytes, bytearray, memoryview or a CPU uint8 tensor); a
# device-direct backend wants a device tensor.
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
    backend_params: bytes = b""          # opaque, from the receiver's KVReceiver.backend_params

    @classmethod
    def of(cls, transfer: TransferDescriptor | str) -> TransferDescriptor:
        return transfer if isinstance(transfer, TransferDescriptor) else cls(transfer_id=transfer)


@dataclass(slots=True)
class SendStats:
    """What one `send` did, for metrics and benchmarks."""

    nbytes: int = 0
    chunks: int = 0
    resent_chunks: int = 0
    max_in_flight_bytes: int = 0         # never more than the window the receiver granted
    window_bytes: int = 0
    seconds: float = 0.0


class KVSender(ABC):
    """Prefill side, one per decode worker (peer)."""

    backend: str

    @abstractmethod
    async def handshake(self, layout: KVLayout, timeout: float = 10.0) -> KVLayout:
        """Check compatibility with the peer; returns its layout, raises KVTransferError
        (FAILED_PRECONDITION naming every differing field) on a mismatch."""

    @abstractmethod
    async def send(self, transfer: TransferDescriptor | str, payload_provider: PayloadProvider,
                   first_token: int, extra: dict[str, str] | None = None, timeout: float = 30.0) -> SendStats:
        """Deliver the payload and the first token; returns once the peer has handed them to its
        engine. Raises KVTransferError (with its status code) on any failure, and within
        `timeout` seconds whatever the peer does."""

    async def close(self) -> None:
        """Release connections; pending sends fail."""
        return None


class KVReceiver(ABC):
    """Decode side: serves one backend's wire and reports into a `PendingTransfers`."""

    backend: str

    @abstractmethod
    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register the gRPC services this backend needs (data or descriptors)."""

    def backend_params(self, transfer_id: str) -> bytes:
        """Opaque parameters the sender needs for this transfer (e.g. a communicator id)."""
        return b""

    async def close(self) -> None:
        """Stop receiving; transfers in progress are failed by their registry."""
        return None


async def resolve_payload(provider: PayloadProvider) -> object:
    """The payload a provider stands for (calling it, and awaiting the result, if needed)."""
    if not callable(provider):
        return provider
    result = provider()
    return await result if inspect.isawaitable(result) else result
