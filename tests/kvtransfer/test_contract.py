"""The contract every KV backend keeps, run against each one the registry lists (memory, grpc,
direct over gloo on the CPU, nixl over UCX on the CPU), both ends built as the services build
them, on a real loopback gRPC server.

Whatever happens to a transfer -- it lands, the sender abandons it at any point, a piece comes
out of order or short, a peer dies, the receiver is slow -- the decode side's blocks are freed
exactly once (through PendingTransfers' one callback) and the prefill side's exactly once, and
no block stays held: counted by each side's block pool. Backend-specific behaviour (chunk
checksums, pair reuse, NCCL) is tested in tests/test_kvtransfer.py and tests/test_kv_direct.py.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time

import grpc
import pytest
import torch
from harness import decode_side, prefill_side

from baton.kvtransfer import registry
from baton.kvtransfer.backend import KVTransferError
from baton.kvtransfer.peer_auth import KVPeerAuth

Code = grpc.StatusCode
pytestmark = pytest.mark.timeout(60)


def _backends(cross_process_only: bool = False) -> list:
    out = []
    for spec in registry.SPECS.values():
        if cross_process_only and spec.in_process:
            continue                  # both ends in one process: a peer cannot die alone
        missing = pytest.mark.skipif(not spec.available(), reason=f"{spec.name} needs one of {spec.requires} "
                                     "(make setup installs it)")
        out.append(pytest.param(spec.name, marks=missing))
    return out


BACKENDS = _backends()
CROSS_PROCESS = _backends(cross_process_only=True)
IN_PLACE = ("nixl",)          # backends that write the KV straight into the decode side's reserved blocks


def run(coro, timeout: float = 40.0):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(bounded())


def assert_all_freed_once(d, p, tids) -> None:
    assert d.blocks.all_free and p.blocks.all_free, "a block stayed held"
    assert all(d.blocks.frees[t] == 1 and p.blocks.frees[t] == 1 for t in tids), (d.blocks.frees, p.blocks.frees)
    assert d.pending.stats().active == 0 and d.pending.staged_bytes == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sizes", [[4], [1, 2, 1]], ids=["one-piece", "three-pieces"])
def test_pieces_in_order_land_bit_exact_with_the_first_token(backend, sizes):
    async def main():
        async with decode_side(backend) as d, prefill_side(backend, d.address) as p:
            d.expect("t", 4)
            stats = await p.send("t", 4, sizes, first_token=42, extra={"prefill_done_unix": "1.5"})
            await d.wait_ended("t", 5)
            assert stats.nbytes == 4 * 8192 and d.landed["t"] == (42, {"prefill_done_unix": "1.5"})
            sent = p.kv[:, :, p.blocks.free[-4:]]            # the prefill's 4 blocks, given back last
            assert torch.equal(d.kv[:, :, d.blocks.free[-4:]], sent.to(d.kv.device))
            assert_all_freed_once(d, p, ["t"])
            if backend in IN_PLACE:                          # written straight into the blocks: no staging copy
                assert (d.in_place, d.unpacked, d.pending.stats().in_place) == (1, 0, 1)
    run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_warmed_sender_sets_nothing_up_on_its_first_transfer(backend):
    """`warm` (before any request: Prefill.ConnectKV) does the one-time set-up the first transfer
    would; the first transfer then lands on what it built."""
    async def main():
        async with decode_side(backend) as d, prefill_side(backend, d.address) as p:
            await p.sender.warm(10)
            built = _set_up(p.sender)
            d.expect("t", 2)
            await p.send("t", 2, [1, 1])
            await d.wait_ended("t", 5)
            assert "t" in d.landed and _set_up(p.sender) == built
            assert_all_freed_once(d, p, ["t"])
    run(main())


def _set_up(sender):
    """What a backend sets up once per peer: the direct pair (live), NIXL's loaded peer metadata."""
    if sender.backend == "direct":
        assert sender.pair is not None and sender.control.alive
        return id(sender.pair)
    if sender.backend == "nixl":
        from baton.kvtransfer.nixl_backend import sender as nixl_sender
        assert nixl_sender._KNOWN, "the warm-up loaded no peer metadata"
        return dict(nixl_sender._LOADS)
    return None


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_piece_out_of_order_is_refused_and_frees_both_sides(backend):
    async def main():
        async with decode_side(backend) as d, prefill_side(backend, d.address) as p:
            d.expect("t", 3)
            async with p.request("t", 3) as ids:
                out = await p.sender.open(p.descriptor("t", 3), 20)
                first, second, _ = p.pieces(ids, [1, 1, 1])
                with pytest.raises(KVTransferError) as err:
                    await out.piece(second)                  # block 1 where block 0 is due
                assert err.value.code == Code.INVALID_ARGUMENT and "was due" in str(err.value)
            await d.wait_ended("t", 5)                       # at once, not at its 20 s deadline
            assert "t" in d.failed
            assert_all_freed_once(d, p, ["t"])
    run(main())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("state", ["admitted", "opened", "mid-pieces", "after-last-piece"])
def test_abandon_at_each_state_frees_both_sides_exactly_once(backend, state):
    async def main():
        async with decode_side(backend) as d, prefill_side(backend, d.address) as p:
            d.expect("t", 3, deadline_s=2.0 if state == "admitted" else 20.0)
            async with p.request("t", 3) as ids:
                if state != "admitted":                      # (admitted: the prefill never comes)
                    out = await p.sender.open(p.descriptor("t", 3), 20)
                    pieces = p.pieces(ids, [1, 2])
                    for piece in pieces[:{"opened": 0, "mid-pieces": 1, "after-last-piece": 2}[state]]:
                        await out.piece(piece)
                    out.abandon("the request was cancelled")
            started = time.monotonic()
            await d.wait_ended("t", 5)
            if state in ("opened", "mid-pieces"):
                assert "t" in d.failed and time.monotonic() - started < 3, "abandon must free at once"
            await asyncio.sleep(0.2)                         # nothing ends it a second time
            assert_all_freed_once(d, p, ["t"])
    run(main())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["descriptor-too-big", "piece-short", "last-piece-early"])
def test_truncated_or_oversized_payloads_are_refused_and_free_both_sides(backend, how):
    async def main():
        async with decode_side(backend) as d, prefill_side(backend, d.address) as p:
            d.expect("t", 3)
            async with p.request("t", 3) as ids:
                with pytest.raises(KVTransferError) as err:
                    if how == "descriptor-too-big":          # more bytes than the decode worker reserved
                        await p.sender.open(p.descriptor("t", 4), 20)
                    out = await p.sender.open(p.descriptor("t", 3), 20)
                    piece = p.pieces(ids, [3])[0]
                    if how == "piece-short":
                        piece = dataclasses.replace(piece, data=piece.data[:-100])
                    else:                                    # the first token with 2 of 3 blocks
                        piece = p.pieces(ids, [2])[0]
                    try:
                        await out.piece(piece)
                        await out.done()
                    finally:
                        out.abandon("failed")
                assert err.value.code in (Code.INVALID_ARGUMENT, Code.DATA_LOSS), err.value
            await d.wait_ended("t", 5)
            assert "t" in d.failed and "t" not in d.landed
            assert_all_freed_once(d, p, ["t"])
    run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_prefill_worker_dying_mid_transfer_frees_the_decode_side(backend):
    async def main():
        async with decode_side(backend) as d, prefill_side(backend, d.address) as p:
            d.expect("t", 3, deadline_s=3.0)
            async with p.request("t", 3) as ids:
                out = await p.sender.open(p.descriptor("t", 3), 20)
                await out.piece(p.pieces(ids, [1, 2])[0])
                await p.die()                                # its connections close; no abandon
            await d.wait_ended("t", 6)                       # the stream's end, or at worst the deadline
            assert "t" in d.failed
            assert_all_freed_once(d, p, ["t"])
    run(main())


@pytest.mark.parametrize("backend", CROSS_PROCESS)
def test_the_decode_worker_dying_mid_transfer_fails_the_sender_within_its_timeout(backend):
    async def main():
        async with decode_side(backend) as d, prefill_side(backend, d.address) as p:
            d.expect("t", 3)
            async with p.request("t", 3) as ids:
                out = await p.sender.open(p.descriptor("t", 3), 5)
                first, last = p.pieces(ids, [1, 2])
                await out.piece(first)
                await d.stop()                               # its server and receivers go away
                started = time.monotonic()
                with pytest.raises(KVTransferError):
                    await out.piece(last)
                    await out.done()
                assert time.monotonic() - started < 6
            await d.wait_ended("t", 2)                       # (blocks written in place: after their hold)
            assert d.blocks.frees["t"] == 1 and p.blocks.frees["t"] == 1
    run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_slow_receiver_holds_the_second_transfer_until_staging_frees_and_both_land(backend):
    async def main():
        async with decode_side(backend, max_staged_bytes=2 * 8192) as d, prefill_side(backend, d.address) as p:
            d.expect("a", 2)
            d.expect("b", 2)
            await asyncio.gather(p.send("a", 2, [1, 1]), p.send("b", 2, [2]))
            await asyncio.gather(d.wait_ended("a", 5), d.wait_ended("b", 5))
            assert set(d.landed) == {"a", "b"} and not d.failed
            assert_all_freed_once(d, p, ["a", "b"])
    run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_concurrent_transfers_land_bit_exact(backend):
    plan = {"c0": [1], "c1": [2, 1], "c2": [1, 1, 1], "c3": [4], "c4": [2, 2]}

    async def main():
        async with decode_side(backend) as d, prefill_side(backend, d.address) as p:
            for tid, sizes in plan.items():
                d.expect(tid, sum(sizes))
            before = {tid: list(d.held[tid]) for tid in plan}
            taken = {}

            async def one(tid, sizes):
                async with p.request(tid, sum(sizes)) as ids:
                    taken[tid] = list(ids)
                    out = await p.sender.open(p.descriptor(tid, sum(sizes)), 20)
                    for piece in p.pieces(ids, sizes, first_token=int(tid[1:])):
                        await out.piece(piece)
                    await out.done()
            await asyncio.gather(*(one(tid, sizes) for tid, sizes in plan.items()))
            await asyncio.gather(*(d.wait_ended(tid, 5) for tid in plan))
            for tid in plan:
                assert d.landed[tid][0] == int(tid[1:])
                assert torch.equal(d.kv[:, :, before[tid]], p.kv[:, :, taken[tid]].to(d.kv.device)), tid
            assert_all_freed_once(d, p, list(plan))
    run(main())


@pytest.mark.parametrize("backend", CROSS_PROCESS)
def test_with_a_shared_secret_peers_transfer_and_a_stranger_is_refused_at_the_handshake(backend):
    async def main():
        async with decode_side(backend, auth=KVPeerAuth(b"s" * 32)) as d:
            async with prefill_side(backend, d.address, auth=KVPeerAuth(b"s" * 32)) as p:
                d.expect("t", 2)
                await p.send("t", 2, [1, 1])
                await d.wait_ended("t", 5)
                assert "t" in d.landed
            with pytest.raises(KVTransferError) as err:
                async with prefill_side(backend, d.address, auth=KVPeerAuth(b"x" * 32)):
                    pass
            assert err.value.code == Code.UNAUTHENTICATED
    run(main())
