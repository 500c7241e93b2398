"""What only the nixl backend has: its control stream and NIXL notifications, against a real
receiver (its own NIXL agent) on loopback. Everything every backend must do is in
test_contract.py."""
from __future__ import annotations

import asyncio
import json

import grpc
import pytest
import torch
from harness import decode_side, layout, prefill_side

from baton.kvtransfer import registry
from baton.kvtransfer.grpc_options import channel_options
from baton.kvtransfer.nixl_backend import wire
from baton.kvtransfer.nixl_backend.agent import new_agent, page_descs
from baton.kvtransfer.peer_auth import KVPeerAuth

Code = grpc.StatusCode
pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not registry.spec("nixl").available(), reason="needs nixl-cu13 (make setup)")]


def run(coro, timeout: float = 30.0):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(bounded())


async def raw_stream(address: str, messages: list[dict], metadata=()):
    """Say `messages` on a KVNixl stream; returns (replies, status code)."""
    async with grpc.aio.insecure_channel(address, options=channel_options()) as ch:
        call = ch.stream_stream(wire.TRANSFER_METHOD, request_serializer=wire.encode,
                                response_deserializer=wire.decode)(timeout=5, metadata=metadata)
        for msg in messages:
            await call.write(msg)
        await call.done_writing()
        replies = []
        try:
            async for reply in call:
                replies.append(reply)
        except grpc.aio.AioRpcError:
            pass
        return replies, await call.code()


def test_a_stream_without_the_session_cannot_touch_a_transfer():
    async def main():
        async with decode_side("nixl", auth=KVPeerAuth(b"s" * 32)) as d:
            d.expect("t", 2)
            _, code = await raw_stream(d.address, [{"open": "t", "nbytes": 2 * 8192, "agent": "mallory"}])
            assert code == Code.UNAUTHENTICATED
            assert "t" in d.pending and not d.failed          # untouched: its sender may still come
    run(main())


@pytest.mark.parametrize("first, code", [
    ({"hello": 1}, Code.INVALID_ARGUMENT),
    ({"open": "nobody", "nbytes": 8192, "agent": "a"}, Code.NOT_FOUND),
    ({"open": "t", "nbytes": "lots", "agent": "a"}, Code.INVALID_ARGUMENT),
    ({"open": "t", "nbytes": 3 * 8192, "agent": "a"}, Code.INVALID_ARGUMENT),
], ids=["not-an-open", "unknown-transfer", "garbled-size", "wrong-size"])
def test_a_bad_open_is_refused_with_a_status_and_frees_what_it_named(first, code):
    async def main():
        async with decode_side("nixl") as d:
            d.expect("t", 2)
            replies, got = await raw_stream(d.address, [first])
            assert got == code and replies and "refused" in replies[0]
            if first.get("open") == "t":
                await d.wait_ended("t", 5)
                assert "t" in d.failed and d.blocks.all_free
    run(main())


def test_a_notification_from_another_agent_does_not_complete_a_transfer():
    async def main():
        async with decode_side("nixl") as d, prefill_side("nixl", d.address) as p:
            d.expect("t", 2, deadline_s=2.0)
            async with p.request("t", 2):
                out = await p.sender.open(p.descriptor("t", 2), 10)
                mallory = new_agent("mallory")                   # knows the receiver, not the transfer's sender
                receiver = mallory.add_remote_agent(wire.unb64(_metadata_of(d)))
                note = {"tid": "t", "first_token": 1, "blocks": 2, "extra": {}}
                mallory.send_notif(receiver, json.dumps(note).encode())
                await d.wait_ended("t", 5)                       # at its deadline, not by mallory's word
                assert "t" in d.failed and "t" not in d.landed
                out.abandon("test over")
    run(main())


def _metadata_of(d) -> str:
    receiver = next(r for r in d.receivers if r.backend == "nixl")
    return wire.b64(receiver.agent.get_agent_metadata())


def test_the_layout_names_nixl_only_where_the_worker_speaks_it():
    assert layout("nixl").backends == ["nixl", "grpc"] and layout("grpc").backends == ["grpc"]


def test_without_a_kv_cache_transfers_are_staged_and_stale_registrations_are_forgotten(monkeypatch):
    """The fallback (no cache to write into): a buffer registered per transfer, copied at the join."""
    from baton.kvtransfer.nixl_backend import sender as nixl_sender
    monkeypatch.setattr(nixl_sender, "FORGET_AFTER_LOADS", 2)

    async def main():
        async with decode_side("nixl", pages=False) as d, prefill_side("nixl", d.address) as p:
            for i in range(5):
                d.expect(f"t{i}", 2)
                await p.send(f"t{i}", 2, [1, 1])
                await d.wait_ended(f"t{i}", 5)
                assert torch.equal(d.kv[:, :, d.held[f"t{i}"]], p.kv[:, :, p.blocks.free[-2:]].to(d.kv.device))
            peer = next(r for r in d.receivers if r.backend == "nixl").agent.name
            assert len(d.landed) == 5 and nixl_sender._LOADS[peer] <= 2 and nixl_sender._OPEN[peer] == 0
            assert (d.unpacked, d.in_place) == (5, 0)
    run(main())


def test_blocks_a_dead_sender_wrote_into_are_held_for_the_quarantine_then_freed_once():
    async def main():
        async with decode_side("nixl") as d, prefill_side("nixl", d.address) as p:
            d.expect("t", 3)
            async with p.request("t", 3) as ids:
                out = await p.sender.open(p.descriptor("t", 3), 20)
                await out.piece(p.pieces(ids, [1, 2])[0])
                await p.die()                                    # no abandon: its writes may still land
            for _ in range(100):
                if "t" in d.failed:
                    break
                await asyncio.sleep(0.02)
            assert d.pending.held("t") and len(d.blocks.free) == d.blocks.total - 3
            await d.wait_ended("t", 2)                           # the quarantine (0.5 s here) ends the hold
            assert d.blocks.all_free and d.blocks.frees["t"] == 1 and not d.pending.held("t")
    run(main())


def test_page_descriptors_coalesce_consecutive_block_ids_per_row():
    rows, block_row = 4, 8
    src = torch.zeros(rows * 5 * block_row, dtype=torch.uint8)       # a piece of 5 blocks
    pages = [9, 5, 6, 7, 2, 3, 1]                                    # its blocks are the transfer's 2..6
    local, remote = page_descs(src, 1000, 0, rows, 10, pages, 2, 5)
    base = src.data_ptr()
    # runs: blocks 6,7 (piece 0..1) and 2,3 (piece 2..3) and 1 (piece 4), in each of 4 rows of a 10-block cache
    assert local[:3].tolist() == [[base, 16, 0], [base + 16, 16, 0], [base + 32, 8, 0]]
    assert remote[:3].tolist() == [[1000 + 6 * 8, 16, 0], [1000 + 2 * 8, 16, 0], [1000 + 8, 8, 0]]
    assert remote[3].tolist() == [1000 + 80 + 6 * 8, 16, 0] and local[3].tolist() == [base + 40, 16, 0]
    assert len(local) == len(remote) == rows * 3


def _users(key) -> int:
    from baton.kvtransfer.nixl_backend.sender import _REGISTERED
    held = _REGISTERED._held.get(key)
    return 0 if held is None else held[1]


def test_one_payload_in_several_transfers_at_once_is_registered_once_and_released():
    """The same piece memory written by four transfers at once (as when one prefill's KV goes to
    several decode workers): NIXL holds one registration of it while any write uses it (a second
    registration, deregistered first, crashed a later post on the GPU), none once all landed."""
    tids = [f"same-{i}" for i in range(4)]

    async def main():
        async with decode_side("nixl") as d, prefill_side("nixl", d.address) as p:
            for tid in tids:
                d.expect(tid, 2)
            blocks = {tid: list(d.held[tid]) for tid in tids}
            async with p.request("src", 2) as ids:
                piece = p.pieces(ids, [2], first_token=5)[0]
                key = (piece.data.data_ptr(), piece.data.numel(), str(piece.data.device))
                # another test's abandoned write may still hold memory the allocator has since handed to this
                # piece (the same address and size): its users are counted apart from this test's
                others = _users(key)
                outs = [await p.sender.open(p.descriptor(tid, 2), 20) for tid in tids]
                for out in outs:
                    await out.piece(piece)
                assert _users(key) >= others + 1    # one registration, however many writes use it
                await asyncio.gather(*(out.done() for out in outs))
                await asyncio.gather(*(d.wait_ended(tid, 5) for tid in tids))
                for tid in tids:
                    assert d.landed[tid][0] == 5
                    assert torch.equal(d.kv[:, :, blocks[tid]], p.kv[:, :, ids].to(d.kv.device))
            assert _users(key) == others                    # this test's writes let go of it
    run(main())
