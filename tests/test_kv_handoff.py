"""The KV ownership state machine (engine/kv_handoff.py), walked edge by edge.

Three levels: the ticket's transition table; the engine (a tiny model, stepped by hand, so
every state can be held still) with block counts after each abort; and the two services in
one process over the in-memory backend, where a peer dies (its transfer abandoned, its
receiver gone) in each state. Every path must give back every block, exactly once.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import replace

import grpc
import pytest
import torch
from helpers import Hook

from baton.engine import LLMEngine, SamplingParams
from baton.engine.config import EngineConfig
from baton.engine.kv_handoff import (
    DECODE_TRANSITIONS,
    PREFILL_TRANSITIONS,
    IllegalTransition,
    InPlace,
    KVPiece,
    KVState,
    KVTicket,
)

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
_fresh = itertools.count(100, 50)


def fresh_prompt() -> list[int]:
    """50 tokens (4 blocks of 16) no earlier test used: no prefix-cache hit changes the steps."""
    start = next(_fresh)
    return list(range(start, start + 50))


# -- the transition table -------------------------------------------------------------------
@pytest.mark.parametrize("side,table", [("prefill", PREFILL_TRANSITIONS), ("decode", DECODE_TRANSITIONS)])
def test_every_edge_of_the_table_is_taken_and_every_other_refused(side, table):
    states = list(KVState)
    for src, dst in itertools.product(states, states):
        ticket = KVTicket("r", side)
        if not _walk_to(ticket, src, table):
            continue                              # not a state of this side
        if dst in table.get(src, ()):
            ticket.advance(dst)
            assert ticket.state is dst and ticket.history[-1] is dst
        else:
            with pytest.raises(IllegalTransition, match=f"from {src.value} to {dst.value}"):
                ticket.advance(dst)
            assert ticket.state is src and not ticket.try_advance(dst)


def _walk_to(ticket: KVTicket, target: KVState, table) -> bool:
    """Move a fresh ticket to `target` along the table (breadth first); False if unreachable."""
    paths = {ticket.state: []}
    frontier = [ticket.state]
    while frontier:
        nxt = []
        for s in frontier:
            for d in table.get(s, ()):
                if d not in paths:
                    paths[d] = [*paths[s], d]
                    nxt.append(d)
        frontier = nxt
    if target not in paths:
        return False
    for s in paths[target]:
        ticket.advance(s)
    return True


def test_a_payload_landing_after_the_request_ended_is_dropped():
    ticket = KVTicket("r", "decode")
    ticket.advance(KVState.FREED)
    assert not ticket.land(b"kv", 7, {}) and ticket.payload is None and ticket.state is KVState.FREED
    landed = KVTicket("r", "decode")
    assert landed.land(b"kv", 7, {"cached_tokens": "16"}) and landed.payload == b"kv"
    landed.advance(KVState.FREED)
    assert landed.payload is None                 # the staging goes as soon as nothing needs it


# -- the engine, stepped by hand ---------------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model="tiny-llama", num_kv_blocks=32, max_num_batched_tokens=16), handoff=Hook())


@pytest.fixture
def hook(engine):
    engine.handoff = Hook()
    yield engine.handoff
    assert not engine.states, "a test left a request in the engine"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def payload_for(engine, n_blocks: int, seed: int = 0):
    """A payload of the engine's layout, as a prefill engine would pack it."""
    import torch
    g = torch.Generator().manual_seed(seed)
    kv = engine.runner.kv_cache
    return torch.randint(0, 255, (n_blocks * kv[:, :, :1].numel() * kv.element_size(),), generator=g,
                         dtype=torch.uint8)


def free(engine) -> int:
    return engine.block_manager.num_free_blocks


def test_decode_reserve_takes_the_prompts_blocks_and_an_abort_in_reserved_gives_them_back(engine, hook):
    before = free(engine)
    ticket = engine.reserve("d", fresh_prompt(), GREEDY)
    assert ticket.state is KVState.RESERVED and free(engine) == before - 4
    assert engine.step() == [] and not engine.has_work      # nothing to run until its KV lands
    engine.abort("d")
    assert ticket.history == [KVState.RESERVED, KVState.FREED] and free(engine) == before


def test_an_abort_while_receiving_frees_the_blocks(engine, hook):
    ticket = engine.reserve("d", fresh_prompt(), GREEDY)
    ticket.advance(KVState.RECEIVING)             # what the registry does when a sender claims it
    engine.abort("d")
    assert ticket.state is KVState.FREED


def test_an_abort_after_landing_frees_the_blocks_and_the_payload_is_never_joined(engine, hook):
    ticket = engine.reserve("d", fresh_prompt(), GREEDY)
    ticket.advance(KVState.RECEIVING)
    hook.land(ticket, payload_for(engine, 4), first_token=5)
    engine.abort("d")                             # before the engine's next step
    assert engine.step() == [] and ticket.state is KVState.FREED and ticket.payload is None


def test_landed_kv_joins_streams_and_finishes_with_every_block_back(engine, hook):
    ticket = engine.reserve("d", fresh_prompt(), GREEDY)
    hook.land(ticket, payload_for(engine, 4), first_token=5, meta={"cached_tokens": "32"})
    assert engine.has_work
    outs = engine.step()                          # the join emits the first token at once
    assert outs[0].new_token_ids[0] == 5 and ticket.state is KVState.JOINED and ticket.joined_at
    while engine.has_unfinished:
        outs += engine.step()
    assert outs[-1].finished and outs[-1].completion_tokens == 4 and outs[-1].cached_tokens == 32
    assert ticket.history[-2:] == [KVState.JOINED, KVState.FINISHED]


def _run(engine, rid: str, until: int | None = None) -> list[int]:
    tokens = []
    while engine.sequence(rid) is not None and (until is None or len(tokens) < until):
        tokens += [t for out in engine.step() if out.request_id == rid for t in out.new_token_ids]
    return tokens


def test_a_decoding_request_paused_with_its_kv_goes_on_elsewhere_token_for_token(engine, hook):
    """LLMEngine.pause (a role switch moves streams so): the request leaves with the KV of every token
    but the last, and its blocks come back at once; another engine that reserves the continuation and
    lands that KV decodes the very tokens the first would have, computing no prompt token."""
    prompt, params = fresh_prompt(), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine.add_request(prompt, params, request_id="whole")
    whole = _run(engine, "whole")
    engine.add_request(prompt, params, request_id="m")
    assert engine.pause("m") == "it is not decoding (its prompt runs, it waits for KV or memory)"
    made = _run(engine, "m", until=4)
    piece, tokens = engine.pause("m")
    assert tokens == made == whole[:len(made)] and engine.sequence("m") is None
    assert piece.first_token == made[-1] and piece.num_blocks == -(-(len(prompt) + len(made) - 1) // 16)
    other = LLMEngine(EngineConfig(model="tiny-llama", num_kv_blocks=32, max_num_batched_tokens=16), handoff=Hook())
    computed = other.scheduler.prefill_tokens
    rest = replace(params, max_tokens=params.max_tokens - len(made) + 1, prior_output_tokens=len(made) - 1)
    ticket = other.reserve("m", prompt + made[:-1], rest)
    other.handoff.land(ticket, piece.data, piece.first_token, piece.meta)
    went_on = _run(other, "m")
    assert made[:-1] + went_on == whole
    assert other.scheduler.prefill_tokens == computed                 # no prefix computed again
    assert other.block_manager.num_free_blocks == other.block_manager.num_blocks


def test_an_abort_of_a_joined_request_finishes_it(engine, hook):
    ticket = engine.reserve("d", fresh_prompt(), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    hook.land(ticket, payload_for(engine, 4), first_token=5)
    engine.step()
    engine.step()
    engine.abort("d")
    assert ticket.history[-2:] == [KVState.JOINED, KVState.FINISHED]


def test_a_payload_of_the_wrong_size_frees_the_blocks_and_says_why(engine, hook):
    ticket = engine.reserve("d", fresh_prompt(), GREEDY)
    hook.land(ticket, payload_for(engine, 3), first_token=5)     # a block short
    (out,) = engine.step()
    assert out.finished and out.finish_reason == "abort" and "could not join" in out.error
    assert ticket.state is KVState.FREED


def test_reserve_never_shares_cached_blocks_and_a_held_abort_frees_them_only_at_release(engine, hook):
    prompt = fresh_prompt()
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1), request_id="c")
    while engine.has_unfinished:
        engine.step()                             # its 3 full blocks are now in the prefix cache
    cached = set(engine.block_manager.cached.values())
    ticket = engine.reserve("d", prompt, GREEDY)  # the same prompt: a backend may write into these blocks
    assert len(ticket.block_ids) == 4 and not set(ticket.block_ids) & cached
    assert all(engine.block_manager.blocks[b].ref_count == 1 for b in ticket.block_ids)
    before = free(engine)
    engine.abort("d", hold_as="t")                # its sender may still write: out of the pool, not freed
    assert ticket.state is KVState.FREED and free(engine) == before and engine.stats().kv_blocks_held == 4
    assert engine.release_held("t") == 4 and engine.release_held("t") == 0
    assert free(engine) == before + 4 and engine.stats().kv_blocks_held == 0


def test_kv_written_in_place_joins_without_a_copy_into_its_own_blocks_only(engine, hook, monkeypatch):
    def no_copy(*_):
        raise AssertionError("an in-place payload was copied")
    monkeypatch.setattr(engine.runner, "write_kv", no_copy)
    ticket = engine.reserve("d", fresh_prompt(), GREEDY)
    hook.land(ticket, InPlace(ticket.block_ids, 4), first_token=5)
    assert engine.step()[0].new_token_ids == [5] and ticket.state is KVState.JOINED
    while engine.has_unfinished:
        engine.step()
    other = engine.reserve("e", fresh_prompt(), GREEDY)
    hook.land(other, InPlace(ticket.block_ids, 4), first_token=5)     # blocks not its own
    (out,) = engine.step()
    assert out.finish_reason == "abort" and "not the request's" in out.error and other.state is KVState.FREED


def test_prefill_pieces_walk_queued_prefilling_prefilled(engine, hook):
    engine.add_request(fresh_prompt(), SamplingParams(temperature=0, max_tokens=1), request_id="p", hand_off_kv=True)
    ticket = engine.kv_ticket("p")
    assert ticket.state is KVState.QUEUED
    engine.step()                                 # 16 of 50 tokens: one full block
    assert ticket.state is KVState.PREFILLING and [p.num_blocks for p in hook.pieces] == [1]
    while engine.has_unfinished:
        engine.step()
    assert ticket.state is KVState.PREFILLED and hook.pieces[-1].last
    assert sum(p.num_blocks for p in hook.pieces) == 4


@pytest.mark.parametrize("steps", [0, 1, 2], ids=["queued", "prefilling", "prefilling-later"])
def test_a_prefill_aborted_before_its_last_piece_frees_its_blocks(engine, hook, steps):
    engine.add_request(fresh_prompt(), SamplingParams(temperature=0, max_tokens=1), request_id="p", hand_off_kv=True)
    ticket = engine.kv_ticket("p")
    for _ in range(steps):
        engine.step()
    engine.abort("p")
    assert ticket.state is KVState.FREED


def test_a_failing_hook_ends_the_prefill_with_its_blocks_freed(engine, hook):
    hook.fail_pieces = True
    engine.add_request(fresh_prompt(), SamplingParams(temperature=0, max_tokens=1), request_id="p", hand_off_kv=True)
    ticket = engine.kv_ticket("p")
    (out,) = engine.step()
    assert out.finished and "could not be handed off" in out.error and ticket.state is KVState.FREED


def test_packed_kv_over_its_bound_holds_new_prompts_until_it_is_sent(engine):
    """The prefill worker's bound on packed, unsent KV (device memory outside the cache): past it
    no new prompt starts, the one running goes on, and the engine idles (no busy loop) until
    the sends drain it; then the held prompt runs. Every block comes back."""
    from baton.prefill_service.core import PrefillHandoff
    handoff = engine.handoff = PrefillHandoff()
    handoff.loop = asyncio.new_event_loop()
    woken = []
    handoff.wake = lambda: woken.append(True)
    handoff.limit = 1                                  # one packed block is over it
    try:
        for rid in ("a", "b"):
            handoff.open(rid)
            engine.add_request(fresh_prompt(), SamplingParams(temperature=0, max_tokens=1), request_id=rid,
                               hand_off_kv=True)
        a, b = engine.kv_ticket("a"), engine.kv_ticket("b")
        while a.state is not KVState.PREFILLED:
            engine.step()
        assert b.state is KVState.QUEUED and handoff.unsent_bytes > 0 and handoff.holding
        assert not engine.has_work, "a held prompt must not make the engine spin"
        assert not woken
        handoff.forget("a")                            # a's pieces went out (or it ended)
        assert woken and engine.has_work and handoff.unsent_bytes == 0
        while engine.has_unfinished:
            engine.step()
        assert b.state is KVState.PREFILLED
        handoff.forget("b")
        assert handoff.unsent_bytes == 0 and not handoff.unsent
    finally:
        handoff.loop.close()
        engine.handoff = Hook()
    assert free(engine) == engine.block_manager.num_blocks


def test_a_piece_packed_as_its_request_ends_is_dropped_not_counted_forever():
    """The engine thread packs a piece while the event loop ends its request: counted and then
    settled by forget(), or dropped; never left in the bound's count (which would hold every
    later prompt once enough such races piled up)."""
    from baton.prefill_service.core import PrefillHandoff
    handoff = PrefillHandoff()
    handoff.loop = asyncio.new_event_loop()
    try:
        piece = KVPiece("r", 0, 1, torch.zeros(64, dtype=torch.uint8))
        handoff.open("r")
        handoff.on_prompt_kv(piece)
        assert handoff.unsent_bytes == 64
        handoff.forget("r")
        assert handoff.unsent_bytes == 0
        handoff.on_prompt_kv(piece)                 # packed after its request ended
        assert handoff.unsent_bytes == 0 and not handoff.unsent and "r" in handoff.dropped
    finally:
        handoff.loop.close()


# -- both services in one process, over the in-memory backend ---------------------------------
def core(worker):
    """A worker's engine core (on this event loop: the in-memory backend keeps both in one process)."""
    return worker.core.core


@contextlib.asynccontextmanager
async def workers(prefill_args: tuple[str, ...] = (), decode_args: tuple[str, ...] = ()):
    """A decode and a prefill worker (tiny-llama, CPU) serving on loopback, in this process; each
    role's extra flags after the common ones."""
    from baton.decode_service.server import DecodeWorker
    from baton.prefill_service.server import PrefillWorker
    from baton.serving.worker.worker_config import parse_worker_args
    common = ["--model", "tiny-llama", "--port", "0", "--kv-backend", "memory", "--num-kv-blocks", "32",
              "--max-num-batched-tokens", "16"]
    decode = DecodeWorker(parse_worker_args("decode", [*common, *decode_args]))
    prefill = PrefillWorker(parse_worker_args("prefill", [*common, *prefill_args]))
    await decode.start()
    await prefill.start()
    try:
        yield prefill, decode
    finally:
        for w in (prefill, decode):
            await w.server.drain_and_stop(0)
            await w.stop()


PROMPT = list(range(1000, 1050))     # each service test starts fresh workers: no cache carried over


def admit(decode, rid: str, timeout_ms: int = 20_000, max_tokens: int = 4):
    from baton.serving.wire import sampling_to_proto
    from baton.v1 import decode_pb2
    sampling = sampling_to_proto(SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return decode.admit(decode_pb2.AdmitRequest(request_id=rid, prompt_token_ids=PROMPT, sampling=sampling,
                                                timeout_ms=timeout_ms))


def prefill_request(rid: str, admitted, max_tokens: int = 4):
    """The prefill of what `admit` admitted: the same prompt and (greedy) sampling, so the prefill
    worker's first token is the one plain decoding gives."""
    from baton.serving.wire import sampling_to_proto
    from baton.v1 import prefill_pb2
    sampling = sampling_to_proto(SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return prefill_pb2.PrefillRequest(request_id=rid, prompt_token_ids=PROMPT, sampling=sampling, handoff=prefill_pb2.Handoff(
        decode_address=admitted.kv_address, transfer_id=admitted.transfer_id, backend=admitted.backend))


async def idle(*ws, timeout: float = 10.0) -> None:
    """Until every worker holds no block and nothing is pending (a failing assert otherwise)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        stats = [w.status() for w in ws]
        if all(s.kv_blocks_free == s.kv_blocks_total and s.running == s.waiting == 0 for s in stats) \
                and all(len(core(w).pending) == 0 for w in ws if hasattr(core(w), "pending")):
            return
        assert loop.time() < end, f"blocks still held: {stats}"
        await asyncio.sleep(0.05)


async def collect(decode, rid: str) -> list[int]:
    return [t async for chunk in decode.stream(rid, 20_000) for t in chunk.token_ids]


def test_a_memory_handoff_runs_every_state_and_gives_back_every_block():
    async def main():
        async with workers() as (prefill, decode):
            admitted = await admit(decode, "r")
            ticket = core(decode).reservations["r"].ticket
            stream = asyncio.ensure_future(collect(decode, "r"))
            reply = await prefill.prefill(prefill_request("r", admitted))
            tokens = await stream
            await idle(prefill, decode)
            return admitted, ticket, reply, tokens
    admitted, ticket, reply, tokens = asyncio.run(main())
    assert admitted.backend == "memory" and len(tokens) == 4 and tokens[0] == reply.first_token
    assert ticket.history == [KVState.RESERVED, KVState.RECEIVING, KVState.LANDED, KVState.JOINED,
                              KVState.FINISHED]


def test_prompts_held_by_the_packed_kv_bound_all_finish_with_every_block_back():
    """Four prefills at once through a bound of one byte: all four stream their tokens, and
    nothing stays packed or held. (Whether a prompt had to wait depends on whether the engine
    thread stepped before the event loop sent the last piece: the hold itself is proven by
    the engine-level test above, stepped by hand.)"""
    async def main():
        async with workers() as (prefill, decode):
            core(prefill).handoff.limit = 1
            rids = [f"h{i}" for i in range(4)]
            admitted = [await admit(decode, rid) for rid in rids]
            streams = [asyncio.ensure_future(collect(decode, rid)) for rid in rids]
            replies = await asyncio.gather(*(prefill.prefill(prefill_request(rid, a))
                                             for rid, a in zip(rids, admitted, strict=True)))
            tokens = await asyncio.gather(*streams)
            await idle(prefill, decode)
            return replies, tokens, core(prefill).handoff
    replies, tokens, handoff = asyncio.run(main())
    assert [len(t) for t in tokens] == [4] * 4 and [t[0] for t in tokens] == [r.first_token for r in replies]
    assert handoff.unsent_bytes == 0 and not handoff.unsent
    assert not handoff.holding


async def admitted_with_sender(decode, rid: str):
    """Admit `rid` on the decode worker and handshake a memory sender to it, as a prefill would."""
    from baton.kvtransfer.memory_backend import MemoryKVSender
    admitted = await admit(decode, rid)
    sender = MemoryKVSender(admitted.kv_address)
    await sender.handshake(core(decode).layout)
    return admitted, core(decode).reservations[rid].ticket, sender


@pytest.mark.parametrize("state", ["reserved", "receiving"])
def test_a_decode_abort_before_the_kv_landed_frees_it_and_refuses_the_late_sender(state):
    from baton.kvtransfer.backend import KVTransferError, TransferDescriptor

    async def main():
        async with workers() as (prefill, decode):
            admitted, ticket, sender = await admitted_with_sender(decode, "r")
            nbytes = core(decode).layout.payload_nbytes(admitted.num_blocks)
            out = await sender.open(TransferDescriptor(admitted.transfer_id, nbytes)) if state == "receiving" else None
            decode.abort_request("r", "the client went away")
            await idle(decode)
            with pytest.raises(KVTransferError):
                if out is None:
                    await sender.open(TransferDescriptor(admitted.transfer_id, nbytes))
                else:
                    await out.piece(KVPiece("r", 0, 1, b"", None))
            return ticket
    ticket = asyncio.run(main())
    assert ticket.state is KVState.FREED


def test_a_prefill_peer_that_dies_mid_transfer_frees_the_decode_blocks_and_fails_the_stream():
    """The prefill side opens the transfer, sends part of the KV, and dies (its stream is cut:
    the transfer is abandoned): the decode side frees everything and the stream ends UNAVAILABLE."""
    from baton.kvtransfer.backend import TransferDescriptor
    from baton.serving.grpc_server import ServiceError

    async def main():
        async with workers() as (prefill, decode):
            admitted, ticket, sender = await admitted_with_sender(decode, "r")
            out = await sender.open(TransferDescriptor(admitted.transfer_id,
                                                       core(decode).layout.payload_nbytes(admitted.num_blocks)))
            await out.piece(KVPiece("r", 0, 1, payload_for(core(decode).llm, 1), None))
            stream = asyncio.ensure_future(collect(decode, "r"))
            out.abandon("the prefill worker died")
            with pytest.raises(ServiceError) as err:
                await stream
            await idle(decode)
            return ticket, err.value
    ticket, err = asyncio.run(main())
    assert ticket.history == [KVState.RESERVED, KVState.RECEIVING, KVState.FREED]
    assert err.code is grpc.StatusCode.ABORTED and "gave it up" in str(err)


def test_a_reservation_nobody_fills_is_reclaimed_at_its_deadline():
    async def main():
        async with workers() as (prefill, decode):
            await admit(decode, "r", timeout_ms=300)
            ticket = core(decode).reservations["r"].ticket
            await asyncio.sleep(0.6)
            await idle(decode)
            return ticket
    assert asyncio.run(main()).state is KVState.FREED


def test_a_decode_peer_that_disappears_ends_the_prefill_with_its_blocks_freed():
    async def main():
        async with workers() as (prefill, decode):
            admitted = await admit(decode, "r")
            for receiver in core(decode).receivers:     # the decode worker is gone (its receivers with it)
                await receiver.close()
            with pytest.raises(Exception) as err:
                await prefill.prefill(prefill_request("r", admitted))
            decode.abort_request("r")
            await idle(prefill, decode)
            return err.value
    err = asyncio.run(main())
    assert "no in-memory KV receiver" in str(err)
