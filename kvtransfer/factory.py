"""Which classes carry a backend's KV: the one place that maps a backend's name to its sender
and receivers (SGLang's disaggregation/ draws the same seam)."""
from __future__ import annotations

import grpc

from baton.engine.platforms import Platform
from baton.kvtransfer.backend import KVReceiver, KVSender
from baton.kvtransfer.layout import KVLayout
from baton.kvtransfer.peer_auth import KVPeerAuth
from baton.kvtransfer.receiver import PendingTransfers

BACKENDS = ("grpc", "direct", "memory")


def make_sender(backend: str, address: str, channel: grpc.aio.Channel, platform: Platform,
                auth: KVPeerAuth | None = None, nccl: str = "direct", stall_s: float = 0.0) -> KVSender:
    """A sender to the decode worker at `address` (`channel` reaches it; the caller owns it)."""
    if backend == "grpc":
        from baton.kvtransfer.grpc_backend import GrpcKVSender
        return GrpcKVSender(channel, auth=auth)
    if backend == "direct":
        from baton.kvtransfer.direct_backend import DirectKVSender
        return DirectKVSender(channel, address, platform, auth=auth, nccl=nccl, stall_s=stall_s)
    if backend == "memory":
        from baton.kvtransfer.memory_backend import MemoryKVSender
        return MemoryKVSender(address)
    raise ValueError(f"unknown KV backend {backend!r}: use one of {', '.join(BACKENDS)}")


def accepted(backend: str) -> list[str]:
    """What a decode worker configured with `backend` takes: the gRPC service always runs (it
    is also every backend's handshake), so grpc pushes are always welcome."""
    return [backend, "grpc"] if backend != "grpc" else ["grpc"]


def make_receivers(backend: str, pending: PendingTransfers, layout: KVLayout, platform: Platform, address: str,
                   store_host: str, auth: KVPeerAuth | None = None, nccl: str = "direct") -> list[KVReceiver]:
    """The receivers a decode worker configured with `backend` serves, all reporting into `pending`.
    `address`: the KV address it advertises; `store_host`: where direct pairs' rendezvous listens."""
    from baton.kvtransfer.grpc_backend import KVTransferServicer
    receivers: list[KVReceiver] = [KVTransferServicer(pending, layout, auth=auth)]
    if backend == "direct":
        from baton.kvtransfer.direct_backend import DirectKVReceiver
        receivers.append(DirectKVReceiver(pending, platform, layout.payload_nbytes(1), store_host, auth=auth,
                                          nccl=nccl))
    elif backend == "memory":
        from baton.kvtransfer.memory_backend import MemoryKVReceiver
        receivers.append(MemoryKVReceiver(pending, layout, address))
    elif backend != "grpc":
        raise ValueError(f"unknown KV backend {backend!r}: use one of {', '.join(BACKENDS)}")
    return receivers
