"""The NIXL KV backend ("nixl"): the prefill worker writes a request's KV straight into the
decode worker's KV cache pages, through NIXL's UCX backend (UCX picks the transport: shared
memory or CMA between processes of one host, RDMA between hosts, CUDA IPC or GPUDirect between
GPUs). gRPC carries only the handshake and one small control stream per transfer (wire.py); a
NIXL notification, sent once every write completed, carries the first token.

Memory: the decode worker registers its whole paged KV cache once (DRAM on the CPU, VRAM on a
GPU); each transfer's reserved block ids travel in its READY, and the prefill worker writes each
piece's blocks into them (no staging copy on the decode side). Where that cannot be (no cache
given, one NIXL cannot register), the decode worker stages a registered buffer per transfer
instead (receiver.py says when). The prefill worker's pieces are device tensors on a GPU, so
no byte goes through the host. Ascend NPUs: NIXL has no Ascend memory type; use direct (HCCL).

Files: agent.py (the NIXL package, agents, descriptors), wire.py (the control stream),
receiver.py (decode side), sender.py (prefill side).
"""
from baton.kvtransfer.nixl_backend.receiver import NixlKVReceiver
from baton.kvtransfer.nixl_backend.sender import BACKEND, NixlKVSender, NixlOutgoing

__all__ = ["BACKEND", "NixlKVReceiver", "NixlKVSender", "NixlOutgoing", "make_receiver", "make_sender"]


def make_sender(ctx) -> NixlKVSender:
    return NixlKVSender(ctx.channel, ctx.address, auth=ctx.auth, platform=ctx.platform)


def make_receiver(ctx) -> NixlKVReceiver:
    return NixlKVReceiver(ctx.pending, ctx.layout, ctx.platform.device, auth=ctx.auth, kv_cache=ctx.kv_cache)
