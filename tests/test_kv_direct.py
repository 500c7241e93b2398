"""The device-direct KV backend: pairs, streamed and multiplexed transfers, refusals, stalls
and protocol violations.

On the CPU the collective is gloo (the same code path as NCCL/HCCL except completion
waiting); on a GPU machine `tests/test_platform_cuda.py` drives it over NCCL. Here sender and
receiver live in one process, each rank of a pair on its own thread, over a real gRPC
server on loopback; tests/test_services.py runs it between real worker processes.
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import dataclasses
import time

import grpc
import pytest
import torch
from cluster import Cluster
from reliability import Outcomes

from baton.engine import SamplingParams
from baton.engine.kv_handoff import KVPiece
from baton.engine.platforms import get_platform
from baton.engine.platforms.cpu import CpuPlatform
from baton.engine.platforms.cuda import CudaPlatform
from baton.engine.platforms.npu import NpuPlatform
from baton.engine.runner.kv_blocks import Pieces, pack_blocks_on_device, unpack_blocks
from baton.kvtransfer.backend import KVTransferError, TransferDescriptor
from baton.kvtransfer.direct_backend import DirectKVReceiver, DirectKVSender, PairGroup
from baton.kvtransfer.direct_backend import receiver as direct_receiver
from baton.kvtransfer.grpc_backend import KVTransferServicer
from baton.kvtransfer.grpc_options import server_options
from baton.kvtransfer.layout import KVLayout
from baton.kvtransfer.receiver import PendingTransfers
from baton.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc, router_pb2

Code = grpc.StatusCode
CPU = get_platform("cpu")
LAYOUT = KVLayout(model="tiny", architecture="LlamaForCausalLM", dtype="bfloat16", block_size=16,
                  num_layers=2, num_kv_heads=2, head_dim=32, backends=["direct", "grpc"])

pytestmark = pytest.mark.timeout(120)


def run(coro, timeout: float = 60.0):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(bounded())


class Landed:
    """The receiving engine: what on_complete / on_fail saw."""

    def __init__(self):
        self.completed: dict[str, tuple[torch.Tensor, int, dict]] = {}
        self.failed: dict[str, str] = {}

    def on_complete(self, tid, payload, first_token, extra):
        self.completed[tid] = (payload, first_token, extra)

    def on_fail(self, tid, reason):
        self.failed[tid] = reason


@contextlib.asynccontextmanager
async def decode_side(layout: KVLayout = LAYOUT):
    """A gRPC server with the KVTransfer handshake and KVDirect; yields (pending, landed, address, receiver)."""
    server = grpc.aio.server(options=server_options())
    pending = PendingTransfers(max_staged_bytes=1 << 30)
    KVTransferServicer(pending, layout).add_to_server(server)
    receiver = DirectKVReceiver(pending, CPU, layout.payload_nbytes(1))
    receiver.add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield pending, Landed(), f"127.0.0.1:{port}", receiver
    finally:
        await receiver.close()
        await server.stop(0)


@contextlib.asynccontextmanager
async def sender_to(address: str):
    sender = DirectKVSender(grpc.aio.insecure_channel(address), address, CPU)
    try:
        await sender.handshake(LAYOUT)
        yield sender
    finally:
        await sender.close()
        await sender.channel.close()


async def put(out, data: torch.Tensor, num_blocks: int, first_token: int | None = None, extra=None) -> None:
    """The next piece of an open transfer, as the prefill engine hands it over."""
    await out.piece(KVPiece("", out.next_block, num_blocks, data, None, first_token, extra or {}))


def kv(num_blocks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYOUT.num_layers, 2, num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return torch.randn(shape, generator=g).to(torch.bfloat16)


def test_blocks_arrive_bit_exact_with_the_first_token_over_one_reused_pair():
    src, blocks = kv(12, seed=1), [7, 2, 9, 4]
    dst, into = torch.zeros_like(src), [0, 5, 11, 3]

    async def main():
        async with decode_side() as (pending, landed, address, receiver), sender_to(address) as sender:
            for i in range(3):                                  # three transfers, one pair
                tid = f"t{i}"
                pending.expect(tid, LAYOUT.payload_nbytes(len(blocks)), 20, landed.on_complete, landed.on_fail)
                stats = await sender.send(TransferDescriptor(tid, nbytes=LAYOUT.payload_nbytes(len(blocks))),
                                          lambda: pack_blocks_on_device(src, blocks), first_token=100 + i,
                                          extra={"request_id": tid})
                assert stats.nbytes == LAYOUT.payload_nbytes(len(blocks))
            assert len(receiver.pairs) == 1 and pending.stats().active == 0 and pending.staged_bytes == 0
            return landed
    landed = run(main())
    assert sorted(landed.completed) == ["t0", "t1", "t2"] and not landed.failed
    payload, first, extra = landed.completed["t2"]
    assert first == 102 and extra == {"request_id": "t2"}
    unpack_blocks(dst, into, payload)
    assert torch.equal(dst[:, :, into], src[:, :, blocks])


def test_unknown_transfer_and_wrong_size_are_refused_without_touching_others():
    src = kv(4, seed=2)

    async def main():
        async with decode_side() as (pending, landed, address, receiver), sender_to(address) as sender:
            n = LAYOUT.payload_nbytes(2)
            pending.expect("mine", n, 20, landed.on_complete, landed.on_fail)
            with pytest.raises(KVTransferError) as unknown:
                await sender.send(TransferDescriptor("nobody", nbytes=n), lambda: pack_blocks_on_device(src, [0, 1]), 1)
            with pytest.raises(KVTransferError) as wrong:      # claims "mine" with a size it never reserved
                await sender.send(TransferDescriptor("mine", nbytes=LAYOUT.payload_nbytes(3)),
                                  lambda: pack_blocks_on_device(src, [0, 1, 2]), 1)
            with pytest.raises(KVTransferError) as partial:    # not whole blocks: refused before any call
                await sender.send(TransferDescriptor("next", nbytes=n + 2), lambda: pack_blocks_on_device(src, [0]), 1)
            pending.expect("next", n, 20, landed.on_complete, landed.on_fail)
            await sender.send(TransferDescriptor("next", nbytes=n), lambda: pack_blocks_on_device(src, [2, 3]), 5)
            return unknown.value, wrong.value, partial.value, landed, pending.stats()
    unknown, wrong, partial, landed, stats = run(main())
    assert partial.code == Code.INVALID_ARGUMENT and "whole" in str(partial)
    assert unknown.code == Code.NOT_FOUND and "unknown KV transfer" in str(unknown)
    assert wrong.code == Code.INVALID_ARGUMENT and "does not match" in str(wrong)
    assert "mine" in landed.failed and "next" in landed.completed    # the sender's next pair works
    assert stats.active == 0 and stats.staged_bytes == 0


def test_a_stalled_transfer_fails_by_its_deadline_frees_staging_and_the_next_one_reconnects(monkeypatch):
    src = kv(4, seed=3)
    n = LAYOUT.payload_nbytes(2)
    monkeypatch.setattr(direct_receiver, "DRAIN_S", 1.0)        # the bytes never come: drop the pair 1 s on

    async def main():
        async with decode_side() as (pending, landed, address, receiver), sender_to(address) as sender:
            pending.expect("stalled", n, 1.5, landed.on_complete, landed.on_fail)
            sender.stall_s = 30                                 # READY comes, the bytes never do
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(KVTransferError) as stalled:
                await sender.send(TransferDescriptor("stalled", nbytes=n), lambda: pack_blocks_on_device(src, [0, 1]),
                                  1, timeout=10)
            waited = loop.time() - t0
            first_pair_gone = not receiver.pairs
            sender.stall_s = 0
            pending.expect("after", n, 20, landed.on_complete, landed.on_fail)
            await sender.send(TransferDescriptor("after", nbytes=n), lambda: pack_blocks_on_device(src, [2, 3]), 2)
            return stalled.value, waited, first_pair_gone, landed, pending.stats()
    stalled, waited, first_pair_gone, landed, stats = run(main())
    assert "stalled" in landed.failed and "did not" in landed.failed["stalled"]
    assert stalled.code in (Code.DEADLINE_EXCEEDED, Code.FAILED_PRECONDITION, Code.UNAVAILABLE)
    assert waited < 8, f"the stall was noticed only after {waited:.1f}s (deadline 1.5s)"
    assert first_pair_gone                     # its communicator had an unmatched receive: aborted
    assert "after" in landed.completed and stats.active == 0 and stats.staged_bytes == 0


def test_bytes_that_come_after_the_deadline_fail_their_transfer_but_keep_the_pair():
    """A busy prefill worker's send can come after the decode side's deadline. That transfer fails
    (its blocks freed, the sender told), but the receive it announced still completes, so the pair
    stays in step and the next transfer goes over the same pair: other transfers on it are not lost."""
    src = kv(4, seed=5)
    n = LAYOUT.payload_nbytes(2)

    async def main():
        async with decode_side() as (pending, landed, address, receiver), sender_to(address) as sender:
            pending.expect("late", n, 1.0, landed.on_complete, landed.on_fail)
            sender.stall_s = 2.0                                # the bytes go 1 s past the deadline
            with pytest.raises(KVTransferError) as late:
                await sender.send(TransferDescriptor("late", nbytes=n), lambda: pack_blocks_on_device(src, [0, 1]),
                                  1, timeout=10)
            pairs_then = set(receiver.pairs)
            sender.stall_s = 0
            pending.expect("next", n, 20, landed.on_complete, landed.on_fail)
            await sender.send(TransferDescriptor("next", nbytes=n), lambda: pack_blocks_on_device(src, [2, 3]), 2)
            return late.value, pairs_then, set(receiver.pairs), landed, pending.stats()
    late, pairs_then, pairs_now, landed, stats = run(main())
    assert "late" in landed.failed and "late" not in landed.completed
    assert late.code in (Code.DEADLINE_EXCEEDED, Code.FAILED_PRECONDITION)
    assert len(pairs_then) == 1 and pairs_now == pairs_then            # the same pair, never closed
    payload, token, _ = landed.completed["next"]     # (its receive queued behind the late one's, on the pair)
    dst = torch.zeros_like(src)
    unpack_blocks(dst, [0, 1], payload)
    assert token == 2 and torch.equal(dst[:, :, :2], src[:, :, 2:4])
    assert stats.active == 0 and stats.staged_bytes == 0


def test_a_word_that_comes_just_after_the_senders_deadline_keeps_the_pair(monkeypatch):
    """Both sides time a transfer by the request's deadline, so the decode side's word (DONE, or
    a refusal at its own deadline) can reach the sender a moment after the sender's deadline. The
    sender's request fails at its deadline, but the pair, whose bytes all went, stays: the next
    transfer goes over it. A word that never comes still closes the pair, after the grace."""
    src, n = kv(4, seed=6), LAYOUT.payload_nbytes(2)
    land = direct_receiver._Control._land

    async def late_land(self, *args):
        await asyncio.sleep(0.8)                         # the decode side answers 0.8 s after the bytes
        return await land(self, *args)
    monkeypatch.setattr(direct_receiver._Control, "_land", late_land)

    async def main():
        async with decode_side() as (pending, landed, address, receiver), sender_to(address) as sender:
            await sender.warm(10)                # the pair built first: 0.4 s is the bytes' deadline alone
            pending.expect("late", n, 5.0, landed.on_complete, landed.on_fail)
            t0 = time.perf_counter()
            with pytest.raises(KVTransferError) as late:       # the sender's own deadline: 0.4 s
                await sender.send(TransferDescriptor("late", nbytes=n), lambda: pack_blocks_on_device(src, [0, 1]),
                                  1, timeout=0.4)
            failed_after = time.perf_counter() - t0
            pairs_then = set(receiver.pairs)
            await asyncio.sleep(1.0)                            # the word comes meanwhile
            monkeypatch.setattr(direct_receiver._Control, "_land", land)
            pending.expect("next", n, 20, landed.on_complete, landed.on_fail)
            await sender.send(TransferDescriptor("next", nbytes=n), lambda: pack_blocks_on_device(src, [2, 3]), 2)
            return late.value, failed_after, pairs_then, set(receiver.pairs), landed, sender.control
    late, failed_after, pairs_then, pairs_now, landed, control = run(main())
    assert late.code == Code.DEADLINE_EXCEEDED and failed_after < 0.7       # failed at its deadline, not later
    assert len(pairs_then) == 1 and pairs_now == pairs_then              # the same pair, never closed
    assert "next" in landed.completed and not control.verdicts


def test_a_sender_that_vanishes_after_ready_fails_the_transfer_at_once():
    async def main():
        async with decode_side() as (pending, landed, address, receiver), sender_to(address) as sender:
            n = LAYOUT.payload_nbytes(1)
            pending.expect("gone", n, 30, landed.on_complete, landed.on_fail)
            await sender.open(TransferDescriptor("gone", nbytes=n), timeout=10)     # READY came
            sender.control.call.cancel()                        # the prefill worker dies here
            for _ in range(100):
                if "gone" in landed.failed:
                    break
                await asyncio.sleep(0.05)
            return landed, pending.stats(), dict(receiver.pairs)
    landed, stats, pairs = run(main())
    assert "gone" in landed.failed and "control stream" in landed.failed["gone"]
    assert stats.active == 0 and stats.staged_bytes == 0
    assert not pairs


def test_a_pair_of_the_wrong_collective_is_refused(monkeypatch):
    async def main():
        async with decode_side() as (_, _, address, _):
            async with grpc.aio.insecure_channel(address) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await kvtransfer_pb2_grpc.KVDirectStub(ch).Connect(
                        kvtransfer_pb2.ConnectRequest(pair_id="p", collective="nccl"), timeout=5)
            return err.value
    err = run(main())
    assert err.code() == Code.FAILED_PRECONDITION and "same kind of device" in err.details()


def test_a_grpc_only_decode_worker_is_named_in_the_handshake_error():
    async def main():
        async with decode_side(dataclasses.replace(LAYOUT, backends=["grpc"])) as (_, _, address, _):
            sender = DirectKVSender(grpc.aio.insecure_channel(address), address, CPU)
            try:
                with pytest.raises(KVTransferError) as err:
                    await sender.handshake(LAYOUT)
            finally:
                await sender.channel.close()
            return err.value
    err = run(main())
    assert err.code == Code.FAILED_PRECONDITION and "--kv-backend direct" in str(err)


def test_collective_follows_the_device():
    """One device -> collective mapping, the platform's (no torch_npu or GPU needed to read it)."""
    assert (CudaPlatform.dist_backend, NpuPlatform.dist_backend, CpuPlatform.dist_backend) == ("nccl", "hccl", "gloo")
    assert PairGroup("p", CPU).collective == "gloo"


# -- between real worker processes ------------------------------------------------------------
DIRECT = ["--kv-backend", "direct", "--num-kv-blocks", "128"]
PROMPTS = ["The quick brown fox", "def quicksort(arr):", "Once upon a time there was a dragon who loved tea and",
           "1, 2, 3,", "Summarize: " + "the river rose over the old stone bridge while the village slept, " * 4]


def greedy(n: int) -> router_pb2.SamplingParams:
    return router_pb2.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_direct_transfers_between_workers_give_the_colocated_engines_tokens(tmp_path, embedded_llm):
    """Streamed chunk by chunk: a 16-token prefill budget splits every longer prompt."""
    want = embedded_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    c = Cluster.launch(tmp_path, prefill=1, decode=1, worker_args=DIRECT,
                       extra={"prefill-0": ["--max-num-batched-tokens", "16"]})
    try:
        stub = c.stub()
        with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda p: [t for r in stub.Generate(router_pb2.GenerateRequest(
                text=p, sampling=greedy(12)), timeout=120) for t in r.token_ids], PROMPTS))
        assert got == [w.token_ids for w in want]
        assert c.worker("decode-0").status().kv_backends == ["direct", "grpc"]
        assert c.wait_workers_idle() == 0
    finally:
        c.stop()


def test_a_stalled_device_transfer_ends_the_request_and_frees_blocks_on_both_sides(tmp_path, reliability):
    c = Cluster.launch(tmp_path, prefill=1, decode=1, worker_args=DIRECT,
                       router_args=["--first-token-timeout", "2"],
                       extra={"prefill-0": ["--kv-fault-stall-s", "600"]})
    try:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            list(c.stub().Generate(router_pb2.GenerateRequest(text=PROMPTS[0], sampling=greedy(8)), timeout=60))
        took = time.monotonic() - t0
        # the pair closing (UNAVAILABLE), the router's deadline, or the decode side's own verdict that the KV
        # did not come in time (ABORTED): whichever deadline passes first on a loaded machine
        assert err.value.code() in (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED, Code.ABORTED), err.value
        if err.value.code() == Code.ABORTED:
            assert "did not arrive before its deadline" in err.value.details(), err.value
        assert took < 30, f"the stalled request took {took:.0f}s to end"
        leaked = c.wait_workers_idle()                # prefill's blocks and decode's reserved ones
        out = Outcomes()
        out.add(err.value, None, took, 60)
        reliability.record("device-direct KV transfer stalled (injected)", out, leaked_blocks=leaked)
        assert leaked == 0
        assert "stall" in c.worker("prefill-0").tail(200)      # the fault really was injected
    finally:
        c.stop()


def test_pieces_streamed_while_another_transfer_goes_through_land_bit_exact():
    """a streams in three pieces, the first token riding on the last; b is sent whole, then FINISH."""
    src = kv(10, seed=4)
    a_blocks, b_blocks = [9, 0, 4, 7, 2, 5], [1, 3]
    dst, a_into, b_into = torch.zeros_like(src), [0, 1, 2, 3, 4, 5], [8, 9]

    async def main():
        async with decode_side() as (pending, landed, address, receiver), sender_to(address) as sender:
            na, nb = LAYOUT.payload_nbytes(len(a_blocks)), LAYOUT.payload_nbytes(len(b_blocks))
            pending.expect("a", na, 20, landed.on_complete, landed.on_fail)
            pending.expect("b", nb, 20, landed.on_complete, landed.on_fail)
            a = await sender.open(TransferDescriptor("a", nbytes=na), timeout=20)   # before its KV exists
            b = await sender.open(TransferDescriptor("b", nbytes=nb), timeout=20)
            await put(a, pack_blocks_on_device(src, a_blocks[:2]), 2)            # chunk 1 of a's prefill
            await put(b, pack_blocks_on_device(src, b_blocks), 2)                # b, all at once
            b_stats = await b.finish(7)
            await put(a, pack_blocks_on_device(src, a_blocks[2:5]), 3)
            await put(a, pack_blocks_on_device(src, a_blocks[5:]), 1, first_token=8, extra={"request_id": "a"})
            a_stats = await a.done()                           # no FINISH: the token came with the bytes
            return landed, a_stats, b_stats, list(receiver.pairs), pending.stats()
    landed, a_stats, b_stats, pairs, stats = run(main())
    assert sorted(landed.completed) == ["a", "b"] and not landed.failed and len(pairs) == 1
    payload, first, extra = landed.completed["a"]
    assert isinstance(payload, Pieces) and [p[:2] for p in payload.parts] == [(0, 2), (2, 3), (5, 1)]
    assert first == 8 and extra == {"request_id": "a"} and (a_stats.chunks, b_stats.chunks) == (3, 1)
    unpack_blocks(dst, a_into, payload)
    unpack_blocks(dst, b_into, landed.completed["b"][0])
    assert torch.equal(dst[:, :, a_into], src[:, :, a_blocks]) and torch.equal(dst[:, :, b_into], src[:, :, b_blocks])
    assert stats.active == 0 and stats.staged_bytes == 0


def test_transfers_in_flight_share_control_writes_and_all_land_bit_exact():
    """Under load the control stream coalesces: OPENs, PIECEs and acks queued while a write is
    under way go out together, in order, and every transfer still lands on its own bytes."""
    src = kv(32, seed=11)
    n = LAYOUT.payload_nbytes(2)

    async def main():
        async with decode_side() as (pending, landed, address, receiver), sender_to(address) as sender:
            for i in range(16):
                pending.expect(f"t{i}", n, 30, landed.on_complete, landed.on_fail)
            await asyncio.gather(*(sender.send(TransferDescriptor(f"t{i}", nbytes=n),
                                               pack_blocks_on_device(src, [2 * i, 2 * i + 1]), first_token=i)
                                   for i in range(16)))
            assert len(receiver.pairs) == 1
            return landed, sender.control.outbox, pending.stats()
    landed, outbox, stats = run(main())
    assert sorted(landed.completed) == sorted(f"t{i}" for i in range(16)) and not landed.failed
    for i in (0, 7, 15):
        payload, first, _ = landed.completed[f"t{i}"]
        dst = torch.zeros_like(src)
        unpack_blocks(dst, [0, 1], payload)
        assert first == i and torch.equal(dst[:, :, :2], src[:, :, 2 * i:2 * i + 2])
    assert outbox.messages == 32 and outbox.writes < outbox.messages      # 16 OPENs + 16 PIECEs
    assert stats.active == 0 and stats.staged_bytes == 0


def test_a_first_token_before_the_last_piece_is_refused_and_the_transfer_freed():
    src = kv(3, seed=8)
    n = LAYOUT.payload_nbytes(3)

    async def main():
        async with decode_side() as (pending, landed, address, receiver), sender_to(address) as sender:
            pending.expect("early", n, 20, landed.on_complete, landed.on_fail)
            out = await sender.open(TransferDescriptor("early", nbytes=n))
            with pytest.raises(KVTransferError) as early:
                await put(out, pack_blocks_on_device(src, [0, 1]), 2, first_token=4)
            for _ in range(200):                                 # the abandon reaches the receiver
                if "early" in landed.failed:
                    break
                await asyncio.sleep(0.01)
            return early.value, landed, pending.stats()
    early, landed, stats = run(main())
    assert early.code == Code.INVALID_ARGUMENT and "first token goes with the last piece" in str(early)
    assert "early" in landed.failed and stats.active == 0 and stats.staged_bytes == 0


def test_abandoned_cancelled_and_short_transfers_free_at_once_and_the_pair_stays_in_step():
    src = kv(6, seed=6)
    n = LAYOUT.payload_nbytes(3)

    async def main():
        async with decode_side() as (pending, landed, address, receiver), sender_to(address) as sender:
            for tid in ("abandoned", "cancelled", "short", "after"):
                pending.expect(tid, n, 20, landed.on_complete, landed.on_fail)
            gone = await sender.open(TransferDescriptor("abandoned", nbytes=n))
            await put(gone, pack_blocks_on_device(src, [0]), 1)
            gone.abandon("the prefill was aborted")            # the receiver frees it now, not at 20 s
            cancelled = await sender.open(TransferDescriptor("cancelled", nbytes=n))
            await put(cancelled, pack_blocks_on_device(src, [0]), 1)
            pending.cancel("cancelled")                         # the decode side gave up (client gone)
            await put(cancelled, pack_blocks_on_device(src, [1, 2]), 2)   # received into scratch
            with pytest.raises(KVTransferError) as refused:
                await cancelled.finish(1)
            short = await sender.open(TransferDescriptor("short", nbytes=n))
            with pytest.raises(KVTransferError) as broken_promise:       # 2 blocks' bytes, 3 announced
                await put(short, pack_blocks_on_device(src, [1, 3]), 3)
            for _ in range(200):                                 # the receiver hears of them asynchronously
                if {"abandoned", "short"} <= set(landed.failed):
                    break
                await asyncio.sleep(0.01)
            pair_before = sender.pair.pair_id
            await sender.send(TransferDescriptor("after", nbytes=n), pack_blocks_on_device(src, [3, 4, 5]), 3)
            return landed, refused.value, broken_promise.value, pair_before, sender.pair.pair_id, pending.stats()
    landed, refused, broken_promise, pair_before, pair_after, stats = run(main())
    assert "gave it up" in landed.failed["abandoned"] and "short" in landed.failed
    assert "cancelled" not in landed.failed and "cancelled" not in landed.completed   # cancel: no callback
    assert refused.code == Code.CANCELLED and "cancelled by the decode worker" in str(refused)
    assert broken_promise.code == Code.INVALID_ARGUMENT and "promised" in str(broken_promise)
    assert pair_after == pair_before and "after" in landed.completed            # still in step
    assert stats.active == 0 and stats.staged_bytes == 0


def _piece(**fields):
    return kvtransfer_pb2.DirectMessage(piece=kvtransfer_pb2.DirectPiece(transfer_id="victim", **fields))


@pytest.mark.parametrize("message, says", [
    (_piece(first_block=1, num_blocks=1), "blocks [1, 2)"),                           # skips block 0
    (_piece(first_block=0, num_blocks=1, first_token=3), "not with the last"),       # token before the end
    (kvtransfer_pb2.DirectMessage(batch=kvtransfer_pb2.DirectBatch(messages=[          # only the stream's first
        kvtransfer_pb2.DirectMessage(hello=kvtransfer_pb2.DirectHello(pair_id="x"))])), "in a batch"),
])
def test_a_malformed_control_message_closes_the_pair_and_fails_its_transfers(message, says):
    n = LAYOUT.payload_nbytes(2)

    async def main():
        async with decode_side() as (pending, landed, address, receiver), sender_to(address) as sender:
            pending.expect("victim", n, 20, landed.on_complete, landed.on_fail)
            pending.expect("next", n, 20, landed.on_complete, landed.on_fail)
            await sender.open(TransferDescriptor("victim", nbytes=n))
            sender.control.send(message)
            for _ in range(200):                                 # both ends hear of it asynchronously
                if "victim" in landed.failed and sender.control.lost is not None:
                    break
                await asyncio.sleep(0.01)
            lost = sender.control.lost
            await sender.send(TransferDescriptor("next", nbytes=n), pack_blocks_on_device(kv(2, seed=7), [0, 1]), 1)
            return landed, lost, pending.stats()
    landed, lost, stats = run(main())
    assert "victim" in landed.failed and lost is not None and says in str(lost)
    assert "next" in landed.completed and stats.active == 0 and stats.staged_bytes == 0


def test_a_receiver_that_forgot_the_pair_is_reconnected_to_without_failing_the_transfer():
    src = kv(4, seed=5)
    n = LAYOUT.payload_nbytes(2)

    async def main():
        async with decode_side() as (pending, landed, address, receiver), sender_to(address) as sender:
            pending.expect("first", n, 20, landed.on_complete, landed.on_fail)
            await sender.send(TransferDescriptor("first", nbytes=n), pack_blocks_on_device(src, (0, 1)), 1)
            first_pair = sender.pair.pair_id
            for pair in list(receiver.pairs.values()):           # as a restart or an idle eviction would
                receiver.drop(pair, "forgotten", wait=5.0)
            pending.expect("second", n, 20, landed.on_complete, landed.on_fail)
            await sender.send(TransferDescriptor("second", nbytes=n), pack_blocks_on_device(src, (2, 3)), 2)
            return first_pair, sender.pair.pair_id, landed, list(receiver.pairs)
    first_pair, second_pair, landed, pairs = run(main())
    assert sorted(landed.completed) == ["first", "second"] and not landed.failed
    assert second_pair != first_pair and pairs == [second_pair]


def test_dead_peers_mid_stream_end_with_a_status_and_the_survivors_serve(tmp_path, embedded_llm, reliability):
    """Direct backend, 2 prefill + 2 decode workers. prefill-0 wedges every transfer after
    announcing its first piece (a stalled device link) and is SIGKILLed with transfers open;
    then decode-1 is SIGKILLed with streams in flight. Every request ends with the known answer
    or a status, the survivors answer correctly, and no survivor holds a block."""
    from reliability import Load
    want = {p: o.token_ids for p, o in zip(PROMPTS, embedded_llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)), strict=True)}
    c = Cluster.launch(tmp_path, prefill=2, decode=2, worker_args=DIRECT,
                       router_args=["--policy", "round_robin", "--first-token-timeout", "6"],
                       extra={"prefill-0": ["--kv-fault-stall-s", "600"]})
    try:
        stub = c.stub()
        wedged = Load(stub, workers=8)
        for i in range(8):
            p = PROMPTS[i % len(PROMPTS)]
            wedged.submit(router_pb2.GenerateRequest(text=p, sampling=greedy(8)), want[p], 60)
        time.sleep(2.0)                                  # prefill-0's transfers are open and wedged
        c.worker("prefill-0").kill()
        out = wedged.wait()
        streams = Load(stub, workers=6)
        for i in range(6):
            streams.submit(router_pb2.GenerateRequest(text=f"Story {i}: once upon a time", sampling=greedy(60)),
                           None, 120)
        streams.wait_streaming(3)                        # streams under way on both decode workers
        c.worker("decode-1").kill()
        during = Load(stub, workers=4)
        for p in PROMPTS[:4]:
            during.submit(router_pb2.GenerateRequest(text=p, sampling=greedy(8)), want[p], 60)
        s_out, d_out = streams.wait(), during.wait()
        for o in (out, s_out, d_out):
            o.assert_clean()
        assert out.completed == out.sent, out.summary()          # retried on prefill-1
        assert set(s_out.statuses) <= {"UNAVAILABLE"} and s_out.completed > 0, s_out.summary()
        assert d_out.completed == d_out.sent, d_out.summary()    # the survivors answer correctly
        leaked = c.wait_workers_idle()
        out.merge(s_out)
        out.merge(d_out)
        reliability.record("device-direct: SIGKILL of a wedged prefill, then of a decode mid-stream", out,
                           leaked_blocks=leaked)
        assert leaked == 0
    finally:
        c.stop()
