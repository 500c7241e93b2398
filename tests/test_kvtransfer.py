"""The KV-transfer channel: layout handshake, block packing, and the grpc backend against a real
grpc.aio server on 127.0.0.1 in this process (cross-process runs are the services' tests).

Each test states one behaviour; the hypothesis test at the end throws random, garbled chunk
streams at the servicer and checks that every expected transfer still ends exactly once.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import socket
import time
import zlib
from dataclasses import dataclass, field

import grpc
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from baton.engine.kv_handoff import KVPiece
from baton.engine.runner.kv_blocks import pack_blocks, unpack_blocks
from baton.kvtransfer import peer_auth
from baton.kvtransfer.backend import KVTransferError, TransferDescriptor
from baton.kvtransfer.grpc_backend import GrpcKVSender, KVTransferServicer, chunk_codec
from baton.kvtransfer.grpc_backend import sender as grpc_sender
from baton.kvtransfer.grpc_backend import servicer as grpc_servicer
from baton.kvtransfer.grpc_options import channel_options, server_options
from baton.kvtransfer.layout import KVLayout, KVLayoutMismatch, check_compatible
from baton.kvtransfer.peer_auth import KVPeerAuth, load_secret
from baton.kvtransfer.receiver import PendingTransfers, TransferRejected
from baton.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc

Ack = kvtransfer_pb2.KVAck
Code = grpc.StatusCode
KiB, MiB = 1 << 10, 1 << 20

# kv[layers=4, 2, blocks, block_size=16, kv_heads=4, head_dim=64] in bfloat16: 64 KiB a block
LAYOUT = KVLayout(model="tiny", architecture="LlamaForCausalLM", dtype="bfloat16", block_size=16,
                  num_layers=4, num_kv_heads=4, head_dim=64)


def kv_cache(num_blocks: int, layout: KVLayout = LAYOUT, seed: int | None = None) -> torch.Tensor:
    shape = (layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    if seed is None:
        return torch.zeros(shape, dtype=getattr(torch, layout.dtype))
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(getattr(torch, layout.dtype))


def run(coro, timeout: float = 30.0):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(bounded())


@dataclass
class Outcomes:
    """Records the callbacks of a PendingTransfers: who completed or failed, how often."""

    completed: dict[str, list] = field(default_factory=dict)
    failed: dict[str, list[str]] = field(default_factory=dict)

    def on_complete(self, tid, payload, first_token, extra):
        self.completed.setdefault(tid, []).append((bytes(payload), first_token, extra))

    def on_fail(self, tid, reason):
        self.failed.setdefault(tid, []).append(reason)

    def ends(self, tid) -> int:
        return len(self.completed.get(tid, [])) + len(self.failed.get(tid, []))

    def expect(self, pending: PendingTransfers, tid: str, nbytes: int, deadline_s: float = 10.0) -> None:
        pending.expect(tid, nbytes, deadline_s, self.on_complete, self.on_fail)


@contextlib.asynccontextmanager
async def serving(*servicers, **servicer_kw):
    """A grpc.aio server on 127.0.0.1:<free port>; yields (pending, outcomes, address)."""
    server = grpc.aio.server(options=server_options())
    pending = PendingTransfers(max_staged_bytes=servicer_kw.pop("max_staged_bytes", 1 << 30))
    for s in servicers or (KVTransferServicer(pending, LAYOUT, **servicer_kw),):
        if isinstance(s, KVTransferServicer):
            s.add_to_server(server)
        else:                                                    # the test doubles below
            kvtransfer_pb2_grpc.add_KVTransferServicer_to_server(s, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield pending, Outcomes(), f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


@contextlib.asynccontextmanager
async def sender_to(address: str, layout: KVLayout = LAYOUT, **kw):
    sender = GrpcKVSender(address, **kw)
    try:
        await sender.handshake(layout)
        yield sender
    finally:
        await sender.close()


async def play(address: str, messages, timeout: float = 5.0):
    """Write raw KVChunks on one Push stream (ignoring credit); -> (status code, details, acks)."""
    async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
        call = kvtransfer_pb2_grpc.KVTransferStub(channel).Push(timeout=timeout)
        acks = []

        async def read_all():
            with contextlib.suppress(grpc.aio.AioRpcError):
                while (ack := await call.read()) is not grpc.aio.EOF:
                    acks.append(ack)
        reader = asyncio.create_task(read_all())
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            for m in messages:
                await call.write(m)
            await call.done_writing()
        await reader
        return await call.code(), await call.details(), acks


def open_msg(tid, total, chunk, window=0):
    return kvtransfer_pb2.KVChunk(transfer_id=tid, open=kvtransfer_pb2.PushOpen(
        total_bytes=total, chunk_bytes=chunk, window_bytes=window))


def chunk_msgs(tid, payload: bytes, chunk: int):
    return [kvtransfer_pb2.KVChunk(transfer_id=tid, index=i, offset=off, data=payload[off:off + chunk],
                                   crc32=zlib.crc32(payload[off:off + chunk]))
            for i, off in enumerate(range(0, len(payload), chunk))]


def done_msg(tid, num_chunks, first_token=7):
    return kvtransfer_pb2.KVChunk(transfer_id=tid, done=kvtransfer_pb2.PushDone(
        first_token=first_token, num_chunks=num_chunks))


def full_stream(tid, payload: bytes, chunk: int):
    chunks = chunk_msgs(tid, payload, chunk)
    return [open_msg(tid, len(payload), chunk), *chunks, done_msg(tid, len(chunks))]


# -- layout --------------------------------------------------------------------------------------------
def test_layout_survives_the_proto_and_sizes_a_payload_like_the_cache():
    assert KVLayout.from_proto(LAYOUT.to_proto()) == LAYOUT
    kv = kv_cache(8)
    assert LAYOUT.payload_nbytes(3) == pack_blocks(kv, [1, 2, 3]).numel() == 3 * 64 * KiB


def test_layout_mismatch_names_every_differing_field_with_both_values():
    prefill = KVLayout("tiny", "LlamaForCausalLM", "float16", 32, 4, 4, 64)
    with pytest.raises(KVLayoutMismatch) as err:
        check_compatible(LAYOUT, prefill)
    msg = str(err.value)
    assert "block_size: prefill has 32, decode has 16" in msg
    assert "dtype: prefill has 'float16', decode has 'bfloat16'" in msg
    assert "num_layers" not in msg


def test_layout_needs_a_backend_in_common_and_rejects_nonsense():
    with pytest.raises(KVLayoutMismatch, match="no KV backend in common"):
        check_compatible(LAYOUT, KVLayout("tiny", "LlamaForCausalLM", "bfloat16", 16, 4, 4, 64, backends=["nccl"]))
    with pytest.raises(ValueError, match="dtype"):
        KVLayout("tiny", "x", "complex64", 16, 4, 4, 64)
    with pytest.raises(ValueError, match="block_size=0"):
        KVLayout("tiny", "x", "bfloat16", 0, 4, 4, 64)


# -- blocks --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_pack_then_unpack_moves_exactly_those_blocks(dtype):
    layout = KVLayout("tiny", "x", dtype, 4, 2, 2, 8)
    src, dst = kv_cache(10, layout, seed=1), kv_cache(12, layout)
    payload = pack_blocks(src, [7, 2, 5])
    assert payload.dtype == torch.uint8 and payload.is_contiguous()
    unpack_blocks(dst, [0, 11, 3], bytes(payload.numpy()))
    for s, d in ((7, 0), (2, 11), (5, 3)):
        assert torch.equal(dst[:, :, d], src[:, :, s])
    assert not dst[:, :, [1, 2, 4, 5, 6, 7, 8, 9, 10]].any()      # nothing else written
    unpack_blocks(dst, [1, 2, 4], payload)                          # a tensor payload works too
    assert torch.equal(dst[:, :, 2], src[:, :, 2])


@pytest.mark.device
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pack_from_a_cuda_cache_stages_through_pinned_host_memory():
    src, dst = kv_cache(10, seed=4).cuda(), kv_cache(12).cuda()
    payload = pack_blocks(src, [3, 1])
    assert payload.device.type == "cpu" and payload.is_pinned()
    unpack_blocks(dst, [5, 6], memoryview(payload.numpy()))
    assert torch.equal(dst[:, :, [5, 6]], src[:, :, [3, 1]])


def test_unpack_refuses_a_payload_of_the_wrong_size_or_blocks_out_of_range():
    kv = kv_cache(4)
    with pytest.raises(ValueError, match="KV payload has 10 bytes but 2 blocks"):
        unpack_blocks(kv, [0, 1], b"x" * 10)
    with pytest.raises(ValueError, match="outside the cache's 4 blocks"):
        unpack_blocks(kv, [4], bytes(LAYOUT.payload_nbytes(1)))
    with pytest.raises(ValueError, match="distinct"):
        unpack_blocks(kv, [1, 1], bytes(LAYOUT.payload_nbytes(2)))


@settings(max_examples=200, deadline=None)
@given(tid=st.text(max_size=300), index=st.integers(0, 2**32 - 1), offset=st.integers(0, 2**64 - 1),
       data=st.binary(max_size=3000))
def test_hand_encoded_chunks_are_the_protobuf_message(tid, index, offset, data):
    raw = chunk_codec.encode_chunk(chunk_codec.transfer_id_field(tid), index, offset, memoryview(data))
    assert kvtransfer_pb2.KVChunk.FromString(raw) == kvtransfer_pb2.KVChunk(
        transfer_id=tid, index=index, offset=offset, data=data, crc32=zlib.crc32(data))


def fields_of(msg):
    return (msg.transfer_id, msg.index, msg.offset, bytes(msg.data), msg.crc32, msg.WhichOneof("control"))


@settings(max_examples=300, deadline=None)
@given(st.one_of(
    st.builds(lambda **kw: kvtransfer_pb2.KVChunk(**kw).SerializeToString(), transfer_id=st.text(max_size=40),
              index=st.integers(0, 2**32 - 1), offset=st.integers(0, 2**64 - 1), data=st.binary(max_size=300),
              crc32=st.integers(0, 2**32 - 1)),
    st.builds(lambda tid, total: open_msg(tid, total, 512).SerializeToString(), st.text(max_size=10),
              st.integers(0, 2**64 - 1)),
    st.lists(st.binary(max_size=40), max_size=4).map(b"".join),          # concatenations, garbage
))
def test_hand_decoded_chunks_agree_with_protobuf(raw):
    try:
        want = kvtransfer_pb2.KVChunk.FromString(raw)
    except Exception:                                          # protobuf rejects it: so must we
        with pytest.raises(Exception):  # noqa: B017 - whatever protobuf raises
            chunk_codec.decode_chunk(raw)
        return
    assert fields_of(chunk_codec.decode_chunk(raw)) == fields_of(want)


# -- the grpc backend: the happy path and flow control ------------------------------------------------
def test_multi_mib_kv_arrives_byte_exact_through_many_chunks():
    prefill_kv, decode_kv = kv_cache(200, seed=3), kv_cache(160)
    src_blocks = random.Random(0).sample(range(200), 150)            # 150 x 64 KiB = 9.4 MiB
    dst_blocks = list(range(159, 9, -1))

    async def main():
        async with serving() as (pending, out, address), sender_to(address, chunk_bytes=512 * KiB,
                                                                       window_bytes=2 * MiB) as sender:
            out.expect(pending, "req-1", LAYOUT.payload_nbytes(len(dst_blocks)))
            stats = await sender.send(TransferDescriptor("req-1", num_tokens=2400),
                                      lambda: pack_blocks(prefill_kv, src_blocks), first_token=42,
                                      extra={"prefill_done_unix": 1.5}, timeout=20)
            return pending, out, stats

    pending, out, stats = run(main())
    assert stats.nbytes == 150 * 64 * KiB and stats.chunks == 19 and stats.resent_chunks == 0
    [(payload, first_token, extra)] = out.completed["req-1"]
    assert first_token == 42 and extra == {"prefill_done_unix": "1.5", "num_tokens": "2400"}
    unpack_blocks(decode_kv, dst_blocks, payload)
    assert torch.equal(decode_kv[:, :, dst_blocks], prefill_kv[:, :, src_blocks])
    assert len(pending) == 0 and pending.stats().staged_bytes == 0 and not out.failed


def test_pieces_handed_over_as_a_prefill_runs_arrive_as_one_payload_after_an_early_open():
    """The streamed form every backend implements: opened before the KV exists (the receiver
    grants credit and stages at once), then the pieces in block order, the token on the last."""
    prefill_kv, decode_kv = kv_cache(12, seed=5), kv_cache(12)
    src, dst = [3, 7, 1, 9, 0], [0, 1, 2, 3, 4]

    async def main():
        async with serving() as (pending, out, address), sender_to(address, chunk_bytes=64 * KiB) as sender:
            out.expect(pending, "s", LAYOUT.payload_nbytes(len(dst)))
            outgoing = await sender.open(TransferDescriptor("s", nbytes=LAYOUT.payload_nbytes(len(dst))))
            staged_at_open = pending.stats().staged_bytes
            await outgoing.piece(KVPiece("s", 0, 2, pack_blocks(prefill_kv, src[:2])))
            await outgoing.piece(KVPiece("s", 2, 3, pack_blocks(prefill_kv, src[2:]), None, 9, {"k": "v"}))
            stats = await outgoing.done()
            return pending, out, stats, staged_at_open
    pending, out, stats, staged_at_open = run(main())
    assert staged_at_open == LAYOUT.payload_nbytes(5) and stats.nbytes == staged_at_open
    [(payload, first_token, extra)] = out.completed["s"]
    assert first_token == 9 and extra["k"] == "v"
    unpack_blocks(decode_kv, dst, payload)
    assert torch.equal(decode_kv[:, :, dst], prefill_kv[:, :, src]) and len(pending) == 0


def test_an_open_refused_by_the_receiver_fails_at_once_and_an_abandoned_one_frees_the_decode_side():
    async def main():
        async with serving() as (pending, out, address), sender_to(address) as sender:
            with pytest.raises(KVTransferError) as refused:
                await sender.open(TransferDescriptor("unknown", nbytes=LAYOUT.payload_nbytes(1)))
            out.expect(pending, "a", LAYOUT.payload_nbytes(2))
            outgoing = await sender.open(TransferDescriptor("a", nbytes=LAYOUT.payload_nbytes(2)))
            await outgoing.piece(KVPiece("a", 0, 1, pack_blocks(kv_cache(2, seed=1), [0])))
            outgoing.abandon("the prefill was aborted")
            for _ in range(100):
                if out.failed:
                    break
                await asyncio.sleep(0.02)
            return refused.value, out, pending.stats()
    refused, out, stats = run(main())
    assert refused.code is Code.NOT_FOUND
    assert "a" in out.failed and not out.completed and stats.active == 0 and stats.staged_bytes == 0


# -- peer authentication (shared secret) ---------------------------------------------------
SECRET = b"kv-secret-0123456789abcdef"


def test_with_the_shared_secret_peers_handshake_and_push_and_strangers_cannot_touch_a_transfer():
    payload = bytes(range(256)) * 40

    async def main():
        receiver = KVTransferServicer(PendingTransfers(max_staged_bytes=1 << 20), LAYOUT, auth=KVPeerAuth(SECRET))
        async with serving(receiver) as (_, out, address):
            pending = receiver.pending
            out.expect(pending, "t1", len(payload))
            # a stranger that guessed the id: refused before its stream is read, the transfer untouched
            stranger = await play(address, full_stream("t1", payload[::-1], 512))
            assert "t1" in pending and not out.failed
            refused = {"push without a session": stranger[0]}
            for name, auth in [("no secret", None), ("wrong secret", KVPeerAuth(b"another-secret-0123456789"))]:
                sender = GrpcKVSender(address, auth=auth)
                try:
                    await sender.handshake(LAYOUT)
                except KVTransferError as exc:
                    refused[name] = exc.code
                finally:
                    await sender.close()
            async with sender_to(address, auth=KVPeerAuth(SECRET)) as sender:
                await sender.send("t1", payload, first_token=3, timeout=10)
            return refused, out, pending

    refused, out, pending = run(main())
    assert refused == {"push without a session": Code.UNAUTHENTICATED, "no secret": Code.UNAUTHENTICATED,
                       "wrong secret": Code.UNAUTHENTICATED}
    assert [p for p, _, _ in out.completed["t1"]] == [payload] and len(pending) == 0


def test_a_sender_with_the_secret_refuses_a_receiver_that_cannot_prove_it():
    async def main():
        async with serving() as (_, _, address):                  # a receiver without any secret
            sender = GrpcKVSender(address, auth=KVPeerAuth(SECRET))
            try:
                await sender.handshake(LAYOUT)
            finally:
                await sender.close()

    with pytest.raises(KVTransferError, match="did not answer the KV secret challenge") as err:
        run(main())
    assert err.value.code is Code.UNAUTHENTICATED


def test_a_replayed_handshake_is_refused():
    auth = KVPeerAuth(SECRET)
    layout_bytes = LAYOUT.to_proto().SerializeToString(deterministic=True)
    nonce, unix_ms, proof = auth.hello(layout_bytes)
    receiver = KVPeerAuth(SECRET)
    session, reply = receiver.accept(nonce, unix_ms, proof, layout_bytes)
    auth.check_reply(nonce, session, reply)
    assert receiver.session_valid(session) and not receiver.session_valid(session[:-1] + b"x")
    with pytest.raises(Exception, match="replays"):
        receiver.accept(nonce, unix_ms, proof, layout_bytes)
    with pytest.raises(Exception, match="proof is wrong"):        # the proof covers the layout
        receiver.accept(auth.hello(layout_bytes)[0], unix_ms, proof, layout_bytes)
    old = int(time.time() * 1000) - 3_600_000                   # a correct proof, an hour old
    with pytest.raises(Exception, match="clock"):
        receiver.accept(bytes(16), old, peer_auth._mac(SECRET, b"hello", bytes(16), str(old).encode(), layout_bytes),
                        layout_bytes)


def test_after_a_receiver_restart_the_sender_handshakes_again_by_itself():
    async def main():
        async with serving(KVTransferServicer(PendingTransfers(), LAYOUT, auth=KVPeerAuth(SECRET))) as (_, _, a1):
            sender = GrpcKVSender(a1, auth=KVPeerAuth(SECRET))
            await sender.handshake(LAYOUT)
            stale = sender._metadata
            await sender.close()
        # "the same decode worker, restarted": same secret, a new process key
        restarted = KVTransferServicer(PendingTransfers(), LAYOUT, auth=KVPeerAuth(SECRET))
        async with serving(restarted) as (_, out, address), \
                sender_to(address, auth=KVPeerAuth(SECRET)) as sender:
            sender._metadata = stale
            out.expect(restarted.pending, "t2", 3000)
            await sender.send("t2", b"k" * 3000, first_token=1, timeout=10)
            return out

    assert run(main()).completed["t2"][0][0] == b"k" * 3000


def test_short_or_empty_secrets_are_refused(tmp_path):
    with pytest.raises(ValueError, match="at least 16 bytes"):
        load_secret("short", None)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        load_secret(None, str(tmp_path / "empty"))
    (tmp_path / "s").write_text("0123456789abcdef0123\nignored")
    assert load_secret(None, str(tmp_path / "s")) == b"0123456789abcdef0123" and load_secret(None, None) is None


class StingyReceiver(kvtransfer_pb2_grpc.KVTransferServicer):
    """Grants `window` bytes, then returns credit one chunk at a time, and only once the sender
    has gone quiet: whatever arrives unacknowledged is the sender's true bytes in flight."""

    def __init__(self, window: int):
        self.window = window
        self.max_unacked = 0
        self.received = bytearray()

    async def Handshake(self, request, context):
        return kvtransfer_pb2.HandshakeResponse(layout=LAYOUT.to_proto(), max_chunk_bytes=self.window,
                                                max_window_bytes=self.window)

    async def Push(self, request_iterator, context):
        inbox: asyncio.Queue = asyncio.Queue()

        async def pump():
            async for msg in request_iterator:
                await inbox.put(msg)
        reader = asyncio.create_task(pump())
        await inbox.get()                                    # the open
        await context.write(Ack(kind=Ack.KIND_CREDIT, credit=self.window))
        unacked: list[tuple[int, int]] = []
        while True:
            try:
                msg = await asyncio.wait_for(inbox.get(), 0.02)
            except TimeoutError:                             # the sender waits for credit
                if unacked:
                    index, n = unacked.pop(0)
                    await context.write(Ack(kind=Ack.KIND_ACK, index=index, credit=n))
                continue
            if msg.WhichOneof("control") == "done":
                await context.write(Ack(kind=Ack.KIND_DONE))
                reader.cancel()
                return
            self.received += msg.data
            unacked.append((msg.index, len(msg.data)))
            self.max_unacked = max(self.max_unacked, sum(n for _, n in unacked))


def test_sender_never_has_more_bytes_in_flight_than_the_window():
    window = 192 * KiB
    stingy = StingyReceiver(window)
    payload = random.Random(1).randbytes(MiB + 123)

    async def main():
        async with serving(stingy) as (_, _, address), sender_to(address, chunk_bytes=64 * KiB,
                                                                    window_bytes=window) as sender:
            return await sender.send("flow", payload, first_token=1, timeout=20)

    stats = run(main())
    assert bytes(stingy.received) == payload
    assert stingy.max_unacked == window                      # it filled the window, and no more
    assert stats.max_in_flight_bytes == window and stats.window_bytes == window


def test_concurrent_sends_share_one_sender_and_staging_stays_bounded():
    payloads = {f"c{i}": random.Random(i).randbytes(3 * MiB) for i in range(4)}

    async def main():
        # room to stage two payloads at a time: the other pushes wait for room, then go through
        async with serving(max_staged_bytes=6 * MiB + 1) as (pending, out, address), \
                sender_to(address, chunk_bytes=256 * KiB) as sender:
            for tid, p in payloads.items():
                out.expect(pending, tid, len(p))
            peak = 0

            async def watch():
                nonlocal peak
                while True:
                    peak = max(peak, pending.stats().staged_bytes)
                    await asyncio.sleep(0.001)
            watcher = asyncio.create_task(watch())
            await asyncio.gather(*(sender.send(tid, p, 3, timeout=20) for tid, p in payloads.items()))
            watcher.cancel()
            return pending, out, peak

    pending, out, peak = run(main())
    assert {tid: c[0][0] for tid, c in out.completed.items()} == payloads
    assert 0 < peak <= 6 * MiB + 1 and pending.stats().staged_bytes == 0


# -- the grpc backend: rejections -----------------------------------------------------------------------
def test_handshake_with_a_different_layout_fails_naming_the_field():
    async def main():
        async with serving() as (_, _, address):
            sender = GrpcKVSender(address)
            try:
                await sender.handshake(KVLayout("tiny", "LlamaForCausalLM", "bfloat16", 32, 4, 4, 64))
            finally:
                await sender.close()

    with pytest.raises(KVTransferError) as err:
        run(main())
    assert err.value.code is Code.FAILED_PRECONDITION
    assert "block_size: prefill has 32, decode has 16" in str(err.value)


def test_send_before_handshake_is_refused():
    async def main():
        sender = GrpcKVSender("127.0.0.1:1")
        try:
            await sender.send("x", b"abc", 1, timeout=1)
        finally:
            await sender.close()

    with pytest.raises(KVTransferError, match="handshake") as err:
        run(main())
    assert err.value.code is Code.FAILED_PRECONDITION


def test_unknown_transfer_id_is_not_found():
    async def main():
        async with serving() as (pending, out, address), sender_to(address) as sender:
            with pytest.raises(KVTransferError, match="unknown KV transfer id 'nobody'") as err:
                await sender.send("nobody", b"abc", 1, timeout=5)
            return err.value.code

    assert run(main()) is Code.NOT_FOUND


def test_wrong_total_size_is_rejected_and_fails_the_transfer():
    async def main():
        async with serving() as (pending, out, address), sender_to(address) as sender:
            out.expect(pending, "sz", 1000)
            with pytest.raises(KVTransferError, match="payload size 999 does not match the 1000") as err:
                await sender.send("sz", bytes(999), 1, timeout=5)
            return pending, out, err.value.code

    pending, out, code = run(main())
    assert code is Code.INVALID_ARGUMENT and out.ends("sz") == 1 and out.failed["sz"] and len(pending) == 0


def test_done_before_every_byte_arrived_is_data_loss():
    payload = bytes(range(200)) * 10

    async def main():
        async with serving() as (pending, out, address):
            out.expect(pending, "trunc", len(payload))
            msgs = full_stream("trunc", payload, 500)
            del msgs[2]                                          # chunk 1 never sent
            return *(await play(address, msgs)), out, pending

    code, details, acks, out, pending = run(main())
    assert code is Code.DATA_LOSS and "truncated transfer trunc" in details and "3 of 4 chunks" in details
    assert out.failed["trunc"] and out.ends("trunc") == 1 and len(pending) == 0


def test_stream_closed_before_done_fails_the_transfer():
    payload = bytes(2000)

    async def main():
        async with serving() as (pending, out, address):
            out.expect(pending, "cut", len(payload))
            result = await play(address, full_stream("cut", payload, 500)[:-1])
            return result, out

    (code, details, _), out = run(main())
    assert code is Code.DATA_LOSS and "closed the stream" in details and out.ends("cut") == 1


@pytest.mark.parametrize("mutate, code, words", [
    (lambda m: setattr(m, "offset", m.offset + 1), Code.INVALID_ARGUMENT, "claims byte offset 501"),
    (lambda m: setattr(m, "index", 9), Code.INVALID_ARGUMENT, "chunk index 9 is out of range"),
    (lambda m: setattr(m, "data", m.data[:-1]), Code.INVALID_ARGUMENT, "has 499 bytes; it must have 500"),
    (lambda m: setattr(m, "transfer_id", "other"), Code.INVALID_ARGUMENT, "carries one transfer"),
])
def test_a_chunk_that_does_not_fit_the_payload_is_rejected(mutate, code, words):
    payload = bytes(range(250)) * 8

    async def main():
        async with serving() as (pending, out, address):
            out.expect(pending, "bad", len(payload))
            msgs = full_stream("bad", payload, 500)
            mutate(msgs[2])                                      # chunk 1
            return *(await play(address, msgs)), out

    got, details, _, out = run(main())
    assert got is code and words in details and out.ends("bad") == 1 and out.failed["bad"]


@pytest.mark.parametrize("threaded", [False, True], ids=["inline", "threaded"])
def test_a_corrupted_chunk_is_nacked_and_resent(monkeypatch, threaded):
    monkeypatch.setattr(grpc_servicer, "THREADED_COPY_BYTES", 0 if threaded else 1 << 30)
    encode, spoiled = grpc_sender.encode_chunk, []

    def corrupt_once(tid_field, index, offset, data):
        raw = encode(tid_field, index, offset, data)
        if index == 2 and not spoiled:
            spoiled.append(index)
            raw = raw[:-10] + bytes([raw[-10] ^ 0xFF]) + raw[-9:]   # a flipped bit inside the data
        return raw
    monkeypatch.setattr(grpc_sender, "encode_chunk", corrupt_once)
    payload = random.Random(2).randbytes(100 * KiB)

    async def main():
        async with serving() as (pending, out, address), sender_to(address, chunk_bytes=16 * KiB) as sender:
            out.expect(pending, "crc", len(payload))
            return await sender.send("crc", payload, 5, timeout=5), out

    stats, out = run(main())
    assert stats.resent_chunks == 1 and out.completed["crc"][0][0] == payload and not out.failed


def test_a_chunk_corrupted_on_every_try_ends_in_data_loss(monkeypatch):
    encode, tries = grpc_sender.encode_chunk, []

    def always_corrupt(tid_field, index, offset, data):
        raw = encode(tid_field, index, offset, data)
        if index == 1:
            tries.append(index)
            raw = raw[:-10] + bytes([raw[-10] ^ 0x01]) + raw[-9:]
        return raw
    monkeypatch.setattr(grpc_sender, "encode_chunk", always_corrupt)

    async def main():
        async with serving() as (pending, out, address), sender_to(address, chunk_bytes=16 * KiB) as sender:
            out.expect(pending, "rot", 64 * KiB)
            with pytest.raises(KVTransferError, match="failed its checksum 4 times") as err:
                await sender.send("rot", bytes(64 * KiB), 5, timeout=5)
            return err.value.code, out

    code, out = run(main())
    assert code is Code.DATA_LOSS and len(tries) == 1 + grpc_servicer.MAX_CRC_RETRIES and out.ends("rot") == 1


def test_a_duplicated_chunk_is_acknowledged_without_rewriting():
    payload = bytes(range(256)) * 4

    async def main():
        async with serving() as (pending, out, address):
            out.expect(pending, "dup", len(payload))
            msgs = full_stream("dup", payload, 512)
            again = kvtransfer_pb2.KVChunk()
            again.CopyFrom(msgs[1])
            again.data = bytes(512)                              # same index and crc, other bytes
            return *(await play(address, [*msgs[:2], again, *msgs[2:]])), out

    code, _, acks, out = run(main())
    assert code is Code.OK
    assert [(a.kind, a.index) for a in acks[1:3]] == [(Ack.KIND_ACK, 0), (Ack.KIND_ACK, 0)]
    assert out.completed["dup"][0][0] == payload                # the first copy stayed


def test_a_chunk_resent_with_other_contents_is_rejected():
    payload = bytes(1024)

    async def main():
        async with serving() as (pending, out, address):
            out.expect(pending, "two", len(payload))
            msgs = full_stream("two", payload, 512)
            other = chunk_msgs("two", b"\x01" * 1024, 512)[0]
            return *(await play(address, [*msgs[:2], other])), out

    code, details, _, out = run(main())
    assert code is Code.INVALID_ARGUMENT and "different contents" in details and out.failed["two"]


def test_pushing_a_transfer_that_already_ended_is_failed_precondition():
    payload = bytes(300)

    async def main():
        async with serving() as (pending, out, address):
            out.expect(pending, "once", len(payload))
            first = await play(address, full_stream("once", payload, 100))
            again = await play(address, full_stream("once", payload, 100))
            out.expect(pending, "gone", len(payload))
            pending.fail("gone", "the request was aborted")
            failed = await play(address, full_stream("gone", payload, 100))
            return first, again, failed, out

    first, again, failed, out = run(main())
    assert first[0] is Code.OK and out.ends("once") == 1
    assert again[0] is Code.FAILED_PRECONDITION and "already completed" in again[1]
    assert failed[0] is Code.FAILED_PRECONDITION and "the request was aborted" in failed[1]


def test_a_second_stream_for_a_transfer_being_pushed_is_refused():
    payload = bytes(1000)

    async def main():
        async with serving() as (pending, out, address):
            out.expect(pending, "busy", len(payload))
            async with grpc.aio.insecure_channel(address) as channel:
                call = kvtransfer_pb2_grpc.KVTransferStub(channel).Push(timeout=5)
                await call.write(open_msg("busy", len(payload), 500))
                assert (await call.read()).kind == Ack.KIND_CREDIT
                second = await play(address, full_stream("busy", payload, 500))
                for m in full_stream("busy", payload, 500)[1:]:
                    await call.write(m)
                await call.done_writing()
                acks = []
                while (ack := await call.read()) is not grpc.aio.EOF:
                    acks.append(ack)
                assert acks[-1].kind == Ack.KIND_DONE and (await call.code()) is Code.OK
            return second, out

    second, out = run(main())
    assert second[0] is Code.FAILED_PRECONDITION and "another stream" in second[1]
    assert out.completed["busy"][0][0] == payload and out.ends("busy") == 1


def test_on_complete_raising_reports_internal_to_the_sender_and_never_calls_on_fail():
    failed = []

    def explode(*_):
        raise RuntimeError("no such request")

    async def main():
        async with serving() as (pending, _, address), sender_to(address) as sender:
            pending.expect("boom", 10, 5, explode, lambda *a: failed.append(a))
            with pytest.raises(KVTransferError, match="no such request") as err:
                await sender.send("boom", bytes(10), 1, timeout=5)
            return err.value.code, pending

    code, pending = run(main())
    assert code is Code.INTERNAL and not failed and pending.stats().completed == 1


# -- deadlines, cancellation, dead peers -----------------------------------------------------------------
def test_the_reaper_fails_an_expired_transfer_exactly_once_and_empties_the_registry():
    async def main():
        async with serving() as (pending, out, address):
            out.expect(pending, "late", 100, deadline_s=0.2)
            out.expect(pending, "kept", 100, deadline_s=5)
            await asyncio.sleep(0.4)
            snapshot = (len(pending), "late" in pending)
            late_push = await play(address, full_stream("late", bytes(100), 50))
            pending.cancel("kept")
            return snapshot, late_push, pending, out

    snapshot, late_push, pending, out = run(main())
    assert snapshot == (1, False)
    assert out.failed == {"late": ["the KV of transfer late did not arrive within its 0.2s deadline"]}
    assert late_push[0] is Code.DEADLINE_EXCEEDED
    assert len(pending) == 0 and pending.stats().failed == 1 and pending.stats().cancelled == 1


def test_a_push_that_stalls_past_the_deadline_fails_once_and_frees_staging():
    async def main():
        async with serving() as (pending, out, address), sender_to(address, chunk_bytes=64 * KiB) as sender:
            out.expect(pending, "slow", 256 * KiB, deadline_s=0.5)

            async def never_ready():
                await asyncio.sleep(30)
            started = time.monotonic()
            with pytest.raises(KVTransferError) as err:
                await sender.send(TransferDescriptor("slow", nbytes=256 * KiB), never_ready, 1, timeout=5)
            return err.value, time.monotonic() - started, pending, out

    err, took, pending, out = run(main())
    assert err.code is Code.DEADLINE_EXCEEDED and took < 2
    assert out.ends("slow") == 1 and len(pending) == 0 and pending.stats().staged_bytes == 0


def test_cancel_ends_a_transfer_without_callbacks_and_refuses_later_chunks():
    async def main():
        async with serving() as (pending, out, address):
            out.expect(pending, "ab", 100)
            assert pending.cancel("ab") and not pending.cancel("ab")
            return await play(address, full_stream("ab", bytes(100), 50)), out

    (code, details, _), out = run(main())
    assert code is Code.CANCELLED and "cancelled by the decode worker" in details and out.ends("ab") == 0


def test_expect_refuses_reused_ids():
    async def main():
        pending, out = PendingTransfers(max_staged_bytes=1000), Outcomes()
        out.expect(pending, "a", 10)
        with pytest.raises(ValueError, match="already used"):
            out.expect(pending, "a", 10)
        pending.cancel("a")

    run(main())


def test_a_payload_over_the_staging_limit_stages_alone():
    """A long prompt's KV may exceed --kv-buffer-mib: it is admitted, waits until nothing else is
    staged, then stages by itself (it used to be refused as "KV full", and a router waited for room
    that never came); what is staged stays bounded by the limit or that one payload."""
    async def main():
        pending, out = PendingTransfers(max_staged_bytes=1000), Outcomes()
        out.expect(pending, "small", 600)
        out.expect(pending, "long", 2500)
        await pending.stage(pending.lookup("small"))
        long = asyncio.ensure_future(pending.stage(pending.lookup("long")))
        await asyncio.sleep(0.05)
        waited = not long.done() and pending.stats().staged_bytes == 600
        pending.cancel("small")
        await asyncio.wait_for(long, 2)
        alone = pending.stats().staged_bytes
        pending.cancel("long")
        return waited, alone, pending.stats().staged_bytes

    assert run(main()) == (True, 2500, 0)


def test_small_payloads_do_not_pass_a_long_one_waiting_to_stage():
    """Fairness: while a long prompt's KV waits for staging to empty, a small transfer that would
    fit beside what is staged waits behind it, so a steady stream of small ones cannot starve it
    until its deadline. Each stages in turn; a waiter that times out frees its place in line."""
    async def main():
        pending, out = PendingTransfers(max_staged_bytes=1000), Outcomes()
        for tid, nbytes in (("small", 600), ("long", 2500), ("later", 300), ("doomed", 300)):
            out.expect(pending, tid, nbytes, 0.3 if tid == "doomed" else 30)
        await pending.stage(pending.lookup("small"))
        long = asyncio.ensure_future(pending.stage(pending.lookup("long")))
        await asyncio.sleep(0.02)
        later = asyncio.ensure_future(pending.stage(pending.lookup("later")))      # 600 + 300 would fit
        doomed = asyncio.ensure_future(pending.stage(pending.lookup("doomed")))
        await asyncio.sleep(0.5)
        behind = (not long.done(), not later.done(), pending.stats().staged_bytes)
        doomed_error = await asyncio.wait_for(asyncio.gather(doomed, return_exceptions=True), 2)
        pending.cancel("small")
        await asyncio.wait_for(long, 2)
        long_alone = (pending.stats().staged_bytes, later.done())
        pending.cancel("long")
        await asyncio.wait_for(later, 2)
        after = pending.stats().staged_bytes
        pending.cancel("later")
        return behind, doomed_error[0], long_alone, after, pending.stats().staged_bytes

    behind, doomed_error, long_alone, after, end = run(main())
    assert behind == (True, True, 600)                     # "later" did not pass "long"
    assert isinstance(doomed_error, TransferRejected)      # its deadline came while it waited in line
    assert long_alone == (2500, False) and after == 300 and end == 0


def test_a_sender_whose_peer_is_down_fails_within_its_timeout():
    with socket.socket() as probe:                               # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    silent = socket.create_server(("127.0.0.1", 0))             # accepts, never speaks HTTP/2

    async def attempt(address):
        sender = GrpcKVSender(address)
        started = time.monotonic()
        try:
            await sender.handshake(LAYOUT, timeout=0.5)
        except KVTransferError as exc:
            return exc.code, time.monotonic() - started
        finally:
            await sender.close()

    try:
        for address in (f"127.0.0.1:{closed}", f"127.0.0.1:{silent.getsockname()[1]}"):
            code, took = run(attempt(address))
            assert code in (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED) and took < 1.5
    finally:
        silent.close()


class HungReceiver(kvtransfer_pb2_grpc.KVTransferServicer):
    """Grants credit, then never acknowledges anything: a decode worker that froze."""

    async def Handshake(self, request, context):
        return kvtransfer_pb2.HandshakeResponse(layout=LAYOUT.to_proto())

    async def Push(self, request_iterator, context):
        await context.read()
        await context.write(Ack(kind=Ack.KIND_CREDIT, credit=64 * KiB))
        await asyncio.sleep(60)


def test_a_sender_whose_peer_hangs_mid_push_fails_within_its_timeout():
    async def main():
        async with serving(HungReceiver()) as (_, _, address), sender_to(address, chunk_bytes=16 * KiB) as sender:
            started = time.monotonic()
            with pytest.raises(KVTransferError, match="did not finish within 0.5s") as err:
                await sender.send("h", bytes(MiB), 1, timeout=0.5)
            return err.value.code, time.monotonic() - started

    code, took = run(main())
    assert code is Code.DEADLINE_EXCEEDED and took < 1.5


# -- random, garbled streams -----------------------------------------------------------------------------
MUTATIONS = ("drop", "duplicate", "swap", "flip_data", "bad_crc", "index", "offset", "truncate", "retarget",
             "total", "chunk_bytes", "num_chunks", "reopen")


def mutate(msgs: list, how: str, at: int, rnd: random.Random, ids: list[str]) -> None:
    if not msgs:
        return
    at %= len(msgs)
    m = kvtransfer_pb2.KVChunk()
    m.CopyFrom(msgs[at])
    data_msg = m.WhichOneof("control") is None
    if how == "drop":
        del msgs[at]
        return
    if how == "duplicate":
        msgs.insert(at, m)
        return
    if how == "swap" and at + 1 < len(msgs):
        msgs[at], msgs[at + 1] = msgs[at + 1], msgs[at]
        return
    if how == "flip_data" and data_msg and m.data:
        i = rnd.randrange(len(m.data))
        m.data = m.data[:i] + bytes([m.data[i] ^ 0x5A]) + m.data[i + 1:]
    elif how == "bad_crc" and data_msg:
        m.crc32 ^= 1 << rnd.randrange(32)
    elif how == "index" and data_msg:
        m.index = rnd.choice([m.index + 1, max(0, m.index - 1), rnd.randrange(1 << 32)])
    elif how == "offset" and data_msg:
        m.offset = rnd.choice([m.offset + 1, rnd.randrange(1 << 64)])
    elif how == "truncate" and data_msg:
        m.data = m.data[:rnd.randrange(len(m.data) + 1)]
    elif how == "retarget":
        m.transfer_id = rnd.choice([*ids, "unknown", ""])
    elif how == "total" and m.HasField("open"):
        m.open.total_bytes = rnd.choice([m.open.total_bytes + 1, max(0, m.open.total_bytes - 1), 1 << 62])
    elif how == "chunk_bytes" and m.HasField("open"):
        m.open.chunk_bytes = rnd.choice([0, 1, 1 << 40])
    elif how == "num_chunks" and m.HasField("done"):
        m.done.num_chunks += 1
    elif how == "reopen":
        m = open_msg(m.transfer_id, rnd.randrange(5000), 512)
        msgs.insert(at, m)
        return
    msgs[at] = m


@st.composite
def scenarios(draw):
    seed = draw(st.integers(0, 2**32 - 1))
    rnd = random.Random(seed)
    sizes = draw(st.lists(st.integers(0, 4000), min_size=1, max_size=3))
    payloads = {f"t{i}": rnd.randbytes(n) for i, n in enumerate(sizes)}
    streams = []
    for _ in range(draw(st.integers(1, 3))):
        tid = draw(st.sampled_from(sorted(payloads)))
        chunk = draw(st.sampled_from([100, 512, 4096]))
        msgs = full_stream(tid, payloads[tid], chunk)
        edits = draw(st.lists(st.tuples(st.sampled_from(MUTATIONS), st.integers(0, 50)), max_size=3))
        for how, at in edits:
            mutate(msgs, how, at, rnd, sorted(payloads))
        streams.append((tid, msgs, not edits))
    return payloads, streams


@pytest.fixture(scope="module")
def shared_server():
    """One server and event loop for every generated example (starting one per example is slow)."""
    pending = PendingTransfers(max_staged_bytes=64 * KiB)

    async def start():
        server = grpc.aio.server(options=server_options())
        KVTransferServicer(pending, LAYOUT).add_to_server(server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    loop = asyncio.new_event_loop()
    server, port = loop.run_until_complete(start())
    yield loop, pending, f"127.0.0.1:{port}"
    loop.run_until_complete(server.stop(0))
    loop.close()


_example = iter(range(1 << 30))


@pytest.fixture(scope="module")
def fuzz_tally(reliability):
    """Totals over every generated example, for the reliability report."""
    tally = collections.Counter()
    yield tally
    reliability.record("fuzz: KV-channel chunk streams (hypothesis)", None, sent=tally["transfers"],
                       completed=tally["completed"], statuses={"failed, blocks freed": tally["failed"]},
                       lost=tally["transfers"] - tally["completed"] - tally["failed"],
                       leaked_blocks=tally["staged_bytes_left"], examples=tally["examples"],
                       streams=tally["streams"], garbled_streams=tally["garbled"],
                       stream_statuses={k[7:]: v for k, v in sorted(tally.items()) if k.startswith("status:")})


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(scenario=scenarios(), threaded=st.booleans())
def test_garbled_streams_never_crash_the_server_or_deliver_wrong_bytes(shared_server, monkeypatch, fuzz_tally,
                                                                       scenario, threaded):
    monkeypatch.setattr(grpc_servicer, "THREADED_COPY_BYTES", 0 if threaded else 1 << 30)
    loop, pending, address = shared_server
    payloads, streams = scenario
    prefix = f"e{next(_example)}-"                             # transfer ids are never reused
    out = Outcomes()

    def named(msgs):
        renamed = []
        for m in msgs:
            c = kvtransfer_pb2.KVChunk()
            c.CopyFrom(m)
            if c.transfer_id:
                c.transfer_id = prefix + c.transfer_id
            renamed.append(c)
        return renamed

    async def example():
        for tid, p in payloads.items():
            out.expect(pending, prefix + tid, len(p))
        results = await asyncio.gather(*(play(address, named(msgs), timeout=10) for _, msgs, _ in streams))
        return results

    results = loop.run_until_complete(asyncio.wait_for(example(), 30))
    fuzz_tally.update(examples=1, streams=len(streams), garbled=sum(not s[2] for s in streams))
    for code, details, _ in results:
        assert code not in (Code.UNKNOWN, Code.INTERNAL), details       # a handler blew up
        event(f"stream status {code.name}")
        fuzz_tally[f"status:{code.name}"] += 1
    for tid, p in payloads.items():
        for payload, first_token, _ in out.completed.get(prefix + tid, []):
            assert payload == p and first_token == 7                    # never wrong bytes
        clean = [s for s in streams if s[0] == tid]
        mentioned = [s for s in streams if any(m.transfer_id == tid for m in s[1])]
        if len(clean) == 1 and clean[0][2] and len(mentioned) == 1:
            assert out.completed.get(prefix + tid), results             # an untouched stream succeeds
        if prefix + tid in pending:                                     # never claimed: end it here
            assert out.ends(prefix + tid) == 0
            pending.fail(prefix + tid, "example over")
        assert out.ends(prefix + tid) == 1                              # complete XOR fail, once
        event("completed" if out.completed.get(prefix + tid) else "failed")
        fuzz_tally.update(transfers=1, completed=len(out.completed.get(prefix + tid, [])),
                          failed=len(out.failed.get(prefix + tid, [])))
    fuzz_tally["staged_bytes_left"] = pending.stats().staged_bytes + len(pending)
    assert pending.stats().staged_bytes == 0 and len(pending) == 0
