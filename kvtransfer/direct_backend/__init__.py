"""The device-direct KV backend ("direct"): a request's KV goes from the prefill device to the
decode device through a collective library (NCCL between GPUs, HCCL between Ascend NPUs,
gloo on the CPU), with no host staging; gRPC carries only the rendezvous and descriptors.

Each prefill->decode pair of workers shares one two-rank communicator (prefill rank 0,
decode rank 1) and one long-lived control stream. `Connect` sets the communicator up (the
decode worker hosts a torch.distributed TCPStore for the pair and both ends build the
process group on it); `Session` is the control stream, on which transfers are multiplexed:

    OPEN -> READY                  the receiver claimed the transfer and staged a device buffer;
                                   the prefill worker opens when the prefill starts, so this
                                   round trip hides under the prefill compute
    PIECE, PIECE, ...              one per prefill chunk: those blocks' KV, final and packed on
                                   the prefill device, follows on the communicator at once;
                                   the last PIECE carries the first token (sampled in the step
                                   that made its blocks final), or a FINISH follows with it
    -> DONE                        every byte landed and went to the decode engine

The bytes of each PIECE go on the communicator in the order of the PIECE messages: the
sender posts its sends, and the receiver its receives, in that order, on the pair's own
device stream (so they overlap the engines' compute); a watcher thread per pair tells the
event loop when each has completed. Any number of transfers may be open on a pair; their
pieces interleave. Messages (and acks) queued while the stream's previous write is under way
go out together in one write (`Outbox`), so under load control costs one round per batch,
not one per message. On GPUs the pair calls NCCL directly (nccl.py): posting an
operation costs microseconds instead of the 110-160 us of ProcessGroupNCCL.

Faults: a transfer that does not land by its deadline (a stalled link, a sender that died)
fails on the receiver -- its blocks are freed through the registry's on_fail -- and, when a
receive of it is left unmatched, the pair is closed: its communicator is aborted and its
control stream ends, which fails the pair's other open transfers; the sender connects a fresh
pair for its next transfer. A transfer the decode worker ended early (cancelled, refused)
still gets its posted pieces received, into a scratch buffer, so the pair stays in step.
A sender that gives a transfer up says so (ABANDON) and the receiver frees it at once.

Security: with a KV secret, Connect and Session need the session of the KVTransfer
handshake. The per-pair TCPStore and the collective's own sockets are not authenticated by
torch.distributed; they live on the KV network (`--kv-advertise` host) for as long as the
pair, so keep that network private.

Files, by layer: pair.py (communicator, device stream, completion watcher; nccl.py the ctypes
binding), outbox.py (coalesced control writes), messages.py (protocol aliases and limits),
receiver.py (decode side, the KVDirect service), sender.py (prefill side).
"""
from baton.kvtransfer.direct_backend.messages import BACKEND
from baton.kvtransfer.direct_backend.pair import PairGroup
from baton.kvtransfer.direct_backend.receiver import DirectKVReceiver
from baton.kvtransfer.direct_backend.sender import DirectKVSender, DirectOutgoing

__all__ = ["BACKEND", "DirectKVReceiver", "DirectKVSender", "DirectOutgoing", "PairGroup", "make_receiver",
           "make_sender"]


def make_sender(ctx) -> DirectKVSender:
    return DirectKVSender(ctx.channel, ctx.address, ctx.platform, auth=ctx.auth,
                          nccl=ctx.options["kv_nccl"], stall_s=ctx.options["kv_fault_stall_s"])


def make_receiver(ctx) -> DirectKVReceiver:
    return DirectKVReceiver(ctx.pending, ctx.platform, ctx.layout.payload_nbytes(1), ctx.store_host, auth=ctx.auth,
                            nccl=ctx.options["kv_nccl"])
