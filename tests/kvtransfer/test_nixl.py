"""What only the nixl backend has: its control stream and NIXL notifications, against a real
receiver (its own NIXL agent) on loopback. Everything every backend must do is in
test_contract.py."""
from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from harness import decode_side, layout, prefill_side

from baton.kvtransfer import registry
from baton.kvtransfer.grpc_options import channel_options
from baton.kvtransfer.nixl_backend import wire
from baton.kvtransfer.nixl_backend.agent import new_agent
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


def test_stale_registrations_of_the_peer_are_forgotten_between_transfers_and_later_ones_still_land(monkeypatch):
    from baton.kvtransfer.nixl_backend import sender as nixl_sender
    monkeypatch.setattr(nixl_sender, "FORGET_AFTER_LOADS", 2)

    async def main():
        async with decode_side("nixl") as d, prefill_side("nixl", d.address) as p:
            for i in range(5):
                d.expect(f"t{i}", 2)
                await p.send(f"t{i}", 2, [1, 1])
                await d.wait_ended(f"t{i}", 5)
            peer = next(r for r in d.receivers if r.backend == "nixl").agent.name
            assert len(d.landed) == 5 and nixl_sender._LOADS[peer] <= 2 and nixl_sender._OPEN[peer] == 0
    run(main())
