"""Decode-side prefix reuse in disaggregated serving (issue 51): a decode worker keeps its own
prefix cache, so turn 2 of a conversation reuses turn 1's blocks there (its answer included) and
the prefill worker sends only the KV after them (the admission's `skip_blocks`).

Two levels, as tests/test_kv_handoff.py: a prefill and a decode engine stepped by hand (tokens the
same with and without reuse, the checksum of the subset sent, every abort and refusal of a request
sharing cached blocks giving each block back once); and both services in one process over the
in-memory backend (the handshake's fields, bytes sent, mixed versions).
"""
from __future__ import annotations

import asyncio

import pytest
from test_kv_handoff import PROMPT, Hook, collect, core, idle, payload_for, workers

from baton.engine import LLMEngine, SamplingParams
from baton.engine.config import EngineConfig
from baton.engine.kv_handoff import InPlace, KVState
from baton.engine.kv_proof import seal
from baton.engine.runner.kv_blocks import Pieces
from baton.engine.scheduling.block_manager import KVCacheFull

BS = 16
TURN1 = list(range(300, 340))                      # 40 tokens: 2 full blocks and a partial one
ANSWER = 10                                        # turn 1's answer fills the third block


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def new_engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny-llama", num_kv_blocks=32, max_num_batched_tokens=16), handoff=Hook())


@pytest.fixture(scope="module")
def pd():
    return new_engine(), new_engine()


def run(engine, rid: str) -> list[int]:
    tokens = []
    while engine.sequence(rid) is not None:
        tokens += [t for out in engine.step() if out.request_id == rid for t in out.new_token_ids]
    return tokens


def prefill(p: LLMEngine, rid: str, prompt: list[int], skip: int = 0):
    """The prompt's pieces, as a prefill worker packs them for a decode side that has `skip` blocks."""
    p.handoff = Hook()
    p.add_request(prompt, greedy(1), request_id=rid, hand_off_kv=True, skip_blocks=skip)
    run(p, rid)
    return p.handoff.pieces


def land(d: LLMEngine, ticket, pieces, epoch: str = "e") -> None:
    """Land the pieces as one payload, sealed (engine/kv_proof.py) for `epoch`."""
    ticket.epoch = epoch
    last = seal(pieces[-1], epoch)
    d.handoff.land(ticket, Pieces(tuple((x.first_block, x.num_blocks, x.data) for x in pieces)), last.first_token,
                   last.meta)


def pd_turn(p: LLMEngine, d: LLMEngine, rid: str, prompt: list[int], n: int, reuse: bool):
    """One disaggregated request: the decode side reserves (reusing its cache or not), the prefill
    side sends what it lacks; (tokens, decode ticket, pieces)."""
    ticket = d.reserve(rid, prompt, greedy(n), reuse_prefix=reuse)
    pieces = prefill(p, rid, prompt, ticket.skip_blocks)
    land(d, ticket, pieces)
    return run(d, rid), ticket, pieces


def all_back(engine: LLMEngine) -> bool:
    bm = engine.block_manager
    return bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def test_turn_two_reuses_turn_ones_blocks_answer_included_token_for_token(pd):
    p, d = pd
    d.block_manager.take_kv_events()                               # (the record starts)
    first, t1, _ = pd_turn(p, d, "t1", TURN1, ANSWER, reuse=True)
    assert t1.skip_blocks == 0                                     # a cold cache: everything is sent
    turn2 = TURN1 + first + list(range(700, 720))                  # 70 tokens, 5 blocks
    cached = [d.block_manager.cached[h] for h in _hashes(turn2[:3 * BS])]
    stored = {h for was_stored, h in d.block_manager.take_kv_events()[0] if was_stored}
    assert set(_hashes(turn2[:3 * BS])) <= stored                  # KV events a router's prefix index follows
    reused, t2, pieces = pd_turn(p, d, "t2", turn2, 8, reuse=True)
    assert t2.skip_blocks == 3 and not set(t2.block_ids) & set(cached) and len(t2.block_ids) == 2
    assert pieces[0].first_block == 0 and sum(x.num_blocks for x in pieces) == 2     # the checksum held: it joined
    assert t2.history[-2:] == [KVState.JOINED, KVState.FINISHED]
    plain, t3, pieces = pd_turn(p, d, "t3", turn2, 8, reuse=False)
    assert t3.skip_blocks == 0 and sum(x.num_blocks for x in pieces) == 5
    assert reused == plain
    assert all_back(p) and all_back(d)


def _hashes(tokens: list[int]) -> list[int]:
    from baton.engine.requests.prefix_hash import prompt_block_hashes
    return prompt_block_hashes(tokens + [0], BS)


def test_every_end_of_a_request_sharing_cached_blocks_gives_each_block_back_once(pd):
    """Four requests share a cached prefix: one aborted while its KV arrives, one whose KV is refused
    (a block short), one held for a late in-place write then released, one refused at admission for
    want of room. Every shared block is pinned once per request and unpinned once."""
    p, d = pd
    prompt = list(range(900, 950))
    pd_turn(p, d, "warm", prompt, 1, reuse=True)                    # 3 full blocks cached on the decode side
    shared = [d.block_manager.cached[h] for h in _hashes(prompt[:3 * BS])]
    a, b, c = (d.reserve(rid, prompt, greedy(4), reuse_prefix=True) for rid in "abc")
    assert [t.skip_blocks for t in (a, b, c)] == [3] * 3
    assert all(d.block_manager.blocks[x].ref_count == 3 for x in shared)
    a.advance(KVState.RECEIVING)
    d.abort("a")
    d.handoff.land(b, payload_for(d, 2), first_token=5)           # a block more than it lacks: refused
    (out,) = d.step()
    assert out.error and "could not join" in out.error and b.state is KVState.FREED and b.refused == "partial"
    d.abort("c", hold_as="late")                                   # its sender may still write its own blocks
    assert all(d.block_manager.blocks[x].ref_count == 1 for x in shared)
    free = d.block_manager.num_free_blocks                         # 28: the held request keeps 4
    with pytest.raises(KVCacheFull):                               # its 3 cached blocks and 29 more
        d.reserve("big", prompt[:3 * BS] + list(range(2000, 2000 + 29 * BS - 1)), greedy(1), reuse_prefix=True)
    assert d.block_manager.num_free_blocks == free and d.sequence("big") is None
    assert all(d.block_manager.blocks[x].ref_count == 1 for x in shared)
    assert d.release_held("late") == 4 and d.release_held("late") == 0
    assert all_back(p) and all_back(d)


def test_kv_written_in_place_after_the_reused_blocks_proves_itself_and_decodes_alike(pd):
    """nixl's way: the sender writes the blocks the decode side lacks straight into `block_ids`; the
    checksum of those blocks is the one the prefill side computed over the pieces it sent."""
    p, d = pd
    prompt = list(range(1500, 1550))
    pd_turn(p, d, "warm", prompt, 1, reuse=True)
    longer = prompt + list(range(1600, 1630))                      # 80 tokens: 3 blocks reused, 2 written
    ticket = d.reserve("w", longer, greedy(6), reuse_prefix=True)
    pieces = prefill(p, "w", longer, ticket.skip_blocks)
    d.runner.write_kv(list(ticket.block_ids), Pieces(tuple((x.first_block, x.num_blocks, x.data) for x in pieces)))
    ticket.epoch = "e"
    last = seal(pieces[-1], "e")
    d.handoff.land(ticket, InPlace(ticket.block_ids, 0), last.first_token, last.meta)
    in_place = run(d, "w")
    assert ticket.skip_blocks == 3 and ticket.state is KVState.FINISHED
    assert in_place == pd_turn(p, d, "plain", longer, 6, reuse=False)[0]
    assert all_back(p) and all_back(d)


def test_a_skip_past_the_cacheable_blocks_is_refused_and_changes_nothing(pd):
    p, _ = pd
    with pytest.raises(ValueError, match="skip_blocks must be in"):
        p.add_request(list(range(50)), greedy(1), request_id="x", hand_off_kv=True, skip_blocks=4)   # 3 at most
    assert p.sequence("x") is None and not p.scheduler.has_work and all_back(p)


# -- both services in one process --------------------------------------------------------------
def admit(decode, rid: str, prompt: list[int], reuse: bool, max_tokens: int = 4):
    from baton.serving.wire import sampling_to_proto
    from baton.v1 import decode_pb2
    return decode.admit(decode_pb2.AdmitRequest(request_id=rid, prompt_token_ids=prompt, reuse_prefix=reuse,
                                                sampling=sampling_to_proto(greedy(max_tokens)), timeout_ms=20_000))


def prefill_request(rid: str, prompt: list[int], admitted, skip: int | None = None):
    from baton.serving.wire import sampling_to_proto
    from baton.v1 import prefill_pb2
    handoff = prefill_pb2.Handoff(decode_address=admitted.kv_address, transfer_id=admitted.transfer_id,
                                  backend=admitted.backend,
                                  skip_blocks=admitted.skip_blocks if skip is None else skip)
    return prefill_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling_to_proto(greedy(4)),
                                      handoff=handoff)


async def turn(prefill, decode, rid: str, prompt: list[int], reuse: bool = True, max_tokens: int = 4):
    admitted = await admit(decode, rid, prompt, reuse, max_tokens)
    stream = asyncio.ensure_future(collect(decode, rid))
    reply = await prefill.prefill(prefill_request(rid, prompt, admitted))
    return admitted, reply, await stream


def test_services_send_only_the_blocks_the_decode_worker_lacks_and_count_them():
    async def main():
        async with workers() as (prefill, decode):
            _, r1, first = await turn(prefill, decode, "t1", PROMPT)
            turn2 = PROMPT + first + list(range(1200, 1210))       # 64 tokens: 3 full blocks cached
            a2, r2, second = await turn(prefill, decode, "t2", turn2)
            a3, r3, plain = await turn(prefill, decode, "t3", turn2, reuse=False)    # a router that never asks
            await idle(prefill, decode)
            reused = decode.metrics.registry.get_sample_value("baton_pd_reused_tokens_total")
            per_block = core(decode).layout.payload_nbytes(1)
            return r1, (a2, r2, second), (a3, r3, plain), reused, per_block
    r1, (a2, r2, second), (a3, r3, plain), reused, per_block = asyncio.run(main())
    assert r1.transfer_bytes == 4 * per_block
    assert a2.skip_blocks == 3 and a2.num_blocks == 1 and r2.transfer_bytes == per_block
    assert a3.skip_blocks == 0 and r3.transfer_bytes == 4 * per_block
    assert second == plain and reused == 3 * BS


def test_services_free_every_block_once_when_transfers_sharing_a_prefix_fail():
    """Requests that share the decode worker's cached prefix: one aborted mid-transfer, one whose
    prefill sends every block where fewer were reserved (a prefill worker that ignores skip_blocks),
    one whose skip is refused as bad input. Both workers end with every block free."""
    from baton.engine.kv_handoff import KVPiece
    from baton.kvtransfer.backend import TransferDescriptor
    from baton.kvtransfer.memory_backend import MemoryKVSender

    async def main():
        async with workers() as (prefill, decode):
            await turn(prefill, decode, "warm", PROMPT)
            nbytes = core(decode).layout.payload_nbytes
            # aborted mid-transfer: the first of the 3 blocks it lacks sent
            cut = await admit(decode, "cut", PROMPT + list(range(1300, 1340)), reuse=True)
            sender = MemoryKVSender(cut.kv_address)
            await sender.handshake(core(decode).layout)
            out = await sender.open(TransferDescriptor(cut.transfer_id, nbytes(cut.num_blocks)))
            await out.piece(KVPiece("cut", 0, 1, bytes(nbytes(1)), None))
            decode.abort_request("cut", "the client went away")
            # a prefill that sends all 4 blocks where 1 was reserved: refused
            full = await admit(decode, "full", PROMPT, reuse=True)
            with pytest.raises(Exception, match="KV push"):
                await prefill.prefill(prefill_request("full", PROMPT, full, skip=0))
            decode.abort_request("full")
            # a skip past the prompt's cacheable blocks: refused before anything starts
            bad = await admit(decode, "bad", PROMPT, reuse=True)
            with pytest.raises(ValueError, match="skip_blocks"):
                await prefill.prefill(prefill_request("bad", PROMPT, bad, skip=4))
            decode.abort_request("bad")
            await idle(prefill, decode)
            refs = [b.ref_count for w in (prefill, decode) for b in core(w).llm.block_manager.blocks]
            return refs, (cut, full, bad)
    refs, admitted = asyncio.run(main())
    assert [a.skip_blocks for a in admitted] == [3, 3, 3] and not any(refs)


def test_the_router_asks_for_reuse_only_of_a_prefill_worker_that_can_skip():
    """Mixed versions: a prefill worker that predates `skip_blocks` (its status does not report
    kv_skip_blocks) would send every block whatever the decode side holds, so the router admits
    with reuse_prefix off and the decode side reserves every block; one that reports it gets turn 2
    with turn 1's blocks reused. The tokens are the same."""
    from fake_worker import FakeContext

    from baton.router.config import RouterConfig
    from baton.router.registry import Registry
    from baton.router.server import RouterService
    from baton.v1 import router_pb2

    async def conversation(skips: bool) -> tuple[list[tuple[bool, int]], list[list[int]]]:
        async with workers() as (prefill, decode):
            if not skips:
                status = prefill.status
                prefill.status = lambda: _without_skip(status())
            reg = Registry([prefill.server.address], [decode.server.address], [], "tiny-llama")
            await reg.start()
            try:
                svc = RouterService(reg, None, router_pb2.ModelInfo(name="tiny-llama", max_model_len=2048,
                                                                      vocab_size=32_000),
                                    RouterConfig(prefill=["p"], decode=["d"]))
                d = next(w for w in reg.workers if w.role == "decode")
                admits, stub_admit = [], d.decode_stub.Admit

                async def admit(req, **kw):
                    reply = await stub_admit(req, **kw)
                    admits.append((req.reuse_prefix, reply.skip_blocks))
                    return reply
                d.decode_stub.Admit = admit
                answers, prompt = [], TURN1
                for _ in range(2):
                    req = router_pb2.GenerateRequest(tokens=router_pb2.TokenIds(ids=prompt),
                                                     sampling=router_pb2.SamplingParams(temperature=0, max_tokens=12,
                                                                                        ignore_eos=True))
                    answers.append([t async for r in svc.generate(req, FakeContext()) for t in r.token_ids])
                    prompt = prompt + answers[-1] + list(range(1200, 1206))
                await idle(prefill, decode)
                return admits, answers
            finally:
                await reg.stop()
    new, new_answers = asyncio.run(conversation(skips=True))
    old, old_answers = asyncio.run(conversation(skips=False))
    assert new == [(True, 0), (True, (len(TURN1) + 12 - 1) // BS)]      # turn 1's blocks, its answer's too
    assert old == [(False, 0), (False, 0)] and old_answers == new_answers


def _without_skip(status):
    status.kv_skip_blocks = False
    return status
