"""The device-direct KV backend: pairs, transfers, refusals and stalls.

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
import types

import grpc
import pytest
import torch
from baton.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc, router_pb2
from cluster import Cluster
from reliability import Outcomes

from engine import SamplingParams
from kvtransfer import direct_backend
from kvtransfer.backend import KVTransferError, TransferDescriptor
from kvtransfer.blocks import pack_blocks_on_device, unpack_blocks
from kvtransfer.direct_backend import DirectKVReceiver, DirectKVSender
from kvtransfer.grpc_backend import KVTransferServicer
from kvtransfer.grpc_options import server_options
from kvtransfer.layout import KVLayout
from kvtransfer.receiver import PendingTransfers

Code = grpc.StatusCode
CPU = torch.device("cpu")
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
    receiver = DirectKVReceiver(pending, CPU)
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
                await sender.send(TransferDescriptor("mine", nbytes=n + 2), lambda: pack_blocks_on_device(src, [0]), 1)
            pending.expect("next", n, 20, landed.on_complete, landed.on_fail)
            await sender.send(TransferDescriptor("next", nbytes=n), lambda: pack_blocks_on_device(src, [2, 3]), 5)
            return unknown.value, wrong.value, landed, pending.stats()
    unknown, wrong, landed, stats = run(main())
    assert unknown.code == Code.NOT_FOUND and "unknown KV transfer" in str(unknown)
    assert wrong.code == Code.INVALID_ARGUMENT and "does not match" in str(wrong)
    assert "mine" in landed.failed and "next" in landed.completed    # the sender's next pair works
    assert stats.active == 0 and stats.staged_bytes == 0


def test_a_stalled_transfer_fails_by_its_deadline_frees_staging_and_the_next_one_reconnects(monkeypatch):
    src = kv(4, seed=3)
    n = LAYOUT.payload_nbytes(2)

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


def test_a_sender_that_vanishes_after_ready_fails_the_transfer_at_once():
    async def main():
        async with decode_side() as (pending, landed, address, receiver), sender_to(address) as sender:
            n = LAYOUT.payload_nbytes(1)
            pending.expect("gone", n, 30, landed.on_complete, landed.on_fail)
            pair = await sender._connect(10)
            call = kvtransfer_pb2_grpc.KVDirectStub(sender.channel).Transfer(timeout=10)
            await call.write(kvtransfer_pb2.DirectMessage(open=kvtransfer_pb2.DirectOpen(
                transfer_id="gone", pair_id=pair.pair_id, total_bytes=n, first_token=1)))
            ack = await call.read()
            call.cancel()                                       # the prefill worker dies here
            for _ in range(100):
                if "gone" in landed.failed:
                    break
                await asyncio.sleep(0.05)
            pair.close("test over")
            return ack, landed, pending.stats(), dict(receiver.pairs)
    ack, landed, stats, pairs = run(main())
    assert ack.kind == kvtransfer_pb2.DirectAck.KIND_READY
    assert "gone" in landed.failed and stats.active == 0 and stats.staged_bytes == 0
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
    assert direct_backend.collective_for(torch.device("cuda", 1)) == "nccl"
    assert direct_backend.collective_for(types.SimpleNamespace(type="npu")) == "hccl"   # no torch_npu here
    assert direct_backend.collective_for(CPU) == "gloo"


# -- between real worker processes ------------------------------------------------------------
DIRECT = ["--kv-backend", "direct", "--num-kv-blocks", "128"]
PROMPTS = ["The quick brown fox", "def quicksort(arr):", "Once upon a time there was a dragon who loved tea and",
           "1, 2, 3,"]


def greedy(n: int) -> router_pb2.SamplingParams:
    return router_pb2.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_direct_transfers_between_workers_give_the_colocated_engines_tokens(tmp_path, embedded_llm):
    want = embedded_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    c = Cluster.launch(tmp_path, prefill=1, decode=1, worker_args=DIRECT)
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
                       router_args=["--first-token-timeout", "4"],
                       worker_env={"prefill-0": {direct_backend.STALL_ENV: "600"}})
    try:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            list(c.stub().Generate(router_pb2.GenerateRequest(text=PROMPTS[0], sampling=greedy(8)), timeout=60))
        took = time.monotonic() - t0
        assert err.value.code() in (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED), err.value
        assert took < 30, f"the stalled request took {took:.0f}s to end"
        leaked = c.wait_workers_idle()                # prefill's held blocks and decode's reserved ones
        out = Outcomes()
        out.add(err.value, None, took, 60)
        reliability.record("device-direct KV transfer stalled (injected)", out, leaked_blocks=leaked)
        assert leaked == 0
        assert "stall" in c.worker("prefill-0").tail(200)      # the fault really was injected
    finally:
        c.stop()


def test_held_blocks_are_packed_by_the_sender_and_a_broken_promise_is_refused():
    src = kv(6, seed=4)
    n = LAYOUT.payload_nbytes(3)

    async def main():
        async with decode_side() as (pending, landed, address, receiver), sender_to(address) as sender:
            pending.expect("held", n, 20, landed.on_complete, landed.on_fail)
            await sender.send(TransferDescriptor("held", nbytes=n), direct_backend.HeldBlocks(src, (5, 0, 2)), 9)
            pending.expect("short", n, 20, landed.on_complete, landed.on_fail)
            with pytest.raises(KVTransferError) as short:               # two blocks where three were promised
                await sender.send(TransferDescriptor("short", nbytes=n), direct_backend.HeldBlocks(src, (1, 3)), 9)
            for _ in range(200):                                 # the receiver hears of it asynchronously
                if pending.stats().active == 0:
                    break
                await asyncio.sleep(0.01)
            return landed, short.value, pending.stats()
    landed, short, stats = run(main())
    dst = torch.zeros_like(src)
    unpack_blocks(dst, [0, 1, 2], landed.completed["held"][0])
    assert torch.equal(dst[:, :, [0, 1, 2]], src[:, :, [5, 0, 2]])
    assert short.code == Code.INVALID_ARGUMENT and "promised" in str(short)
    assert "short" in landed.failed and stats.active == 0 and stats.staged_bytes == 0


def test_a_receiver_that_forgot_the_pair_is_reconnected_to_without_failing_the_transfer():
    src = kv(4, seed=5)
    n = LAYOUT.payload_nbytes(2)

    async def main():
        async with decode_side() as (pending, landed, address, receiver), sender_to(address) as sender:
            pending.expect("first", n, 20, landed.on_complete, landed.on_fail)
            await sender.send(TransferDescriptor("first", nbytes=n), direct_backend.HeldBlocks(src, (0, 1)), 1)
            first_pair = sender.pair.pair_id
            for pair in list(receiver.pairs.values()):           # as a restart or an idle eviction would
                receiver._drop(pair, "forgotten", wait=5.0)
            pending.expect("second", n, 20, landed.on_complete, landed.on_fail)
            await sender.send(TransferDescriptor("second", nbytes=n), direct_backend.HeldBlocks(src, (2, 3)), 2)
            return first_pair, sender.pair.pair_id, landed, list(receiver.pairs)
    first_pair, second_pair, landed, pairs = run(main())
    assert sorted(landed.completed) == ["first", "second"] and not landed.failed
    assert second_pair != first_pair and pairs == [second_pair]
