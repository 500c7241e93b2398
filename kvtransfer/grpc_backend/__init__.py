"""The portable KV backend ("grpc"): host-staged bytes over gRPC in CRC-checked chunks with
credit flow control. `sender` is the prefill side, `servicer` the decode side's
`baton.v1.KVTransfer` service (also the handshake every backend starts with), `chunk_codec`
the zero-copy framing of data chunks."""
from baton.kvtransfer.grpc_backend.sender import GrpcKVSender, GrpcOutgoing
from baton.kvtransfer.grpc_backend.servicer import KVTransferServicer

__all__ = ["GrpcKVSender", "GrpcOutgoing", "KVTransferServicer", "make_receiver", "make_sender"]


def make_sender(ctx) -> GrpcKVSender:
    return GrpcKVSender(ctx.channel, auth=ctx.auth)


def make_receiver(ctx) -> KVTransferServicer:
    return KVTransferServicer(ctx.pending, ctx.layout, auth=ctx.auth)
