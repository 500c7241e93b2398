"""KV that can prove what it is (engine/kv_proof.py, issue 51): a landed payload that is stale (sent
for another reservation), partial or corrupt is refused where it lands, before a token comes of it;
its request fails with "could not join the transferred KV" (the router retries it elsewhere) and its
blocks are freed exactly once. A clean transfer decodes exactly what a colocated run does, and no
clean payload, whatever its size, dtype or split into pieces, is ever refused.

Three levels: the checksum itself (engine/runner/kv_checksum.py) on random caches; two engines in
one process, stepped by hand, the payload landed by the test; and both services in one process
over each CPU backend (memory, grpc), the bytes spoiled on the prefill side after they were proven.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import random
from dataclasses import replace

import pytest
import torch
from helpers import in_triton_interpreter
from test_kv_handoff import Hook, admit, collect, core, idle, prefill_request, workers

from baton.engine import LLMEngine, SamplingParams
from baton.engine.config import EngineConfig
from baton.engine.kv_handoff import InPlace, KVState
from baton.engine.kv_proof import CHECKSUM_META, EPOCH_META, seal
from baton.engine.runner import kv_checksum
from baton.engine.runner.kv_blocks import Pieces, pack_blocks, pack_blocks_on_device, unpack_blocks

pytestmark = pytest.mark.timeout(120)
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
_fresh = itertools.count(5000, 50)


def fresh_prompt() -> list[int]:
    start = next(_fresh)
    return list(range(start, start + 50))          # 4 blocks of 16, the last partial


# -- the checksum: never a false refusal -------------------------------------------------------
def _dtypes() -> list[torch.dtype]:
    found = [torch.float16, torch.bfloat16]
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is not None:
        try:
            torch.zeros(2, dtype=fp8).view(torch.uint8)
            found.append(fp8)
        except (RuntimeError, TypeError):
            pass
    return found


def test_fifty_clean_payloads_of_every_size_dtype_and_split_are_never_refused():
    """The prefill's sum over its pieces (each proven on its own, added up) equals the decode side's
    checksum of the payload whole, in pieces, and of the blocks it was written into elsewhere."""
    rng = random.Random(51)
    dtypes = _dtypes()
    for i in range(50):
        dtype = dtypes[i % len(dtypes)]
        layers, heads, head_dim = rng.choice([1, 2, 3]), rng.choice([1, 2, 4]), rng.choice([8, 16, 32])
        n = rng.randint(1, 12)
        src = torch.randint(0, 256, (layers, 2, 16, 4, heads, head_dim * dtype.itemsize), dtype=torch.uint8)
        src = src.view(dtype)
        blocks = rng.sample(range(16), n)
        cuts = sorted(rng.sample(range(1, n), rng.randint(0, n - 1))) if n > 1 else []
        parts, total = [], None
        for first, end in zip([0, *cuts], [*cuts, n], strict=True):
            data = pack_blocks_on_device(src, blocks[first:end])
            total = kv_checksum.partial(data, 2 * layers, end - first, first) + (0 if total is None else total)
            parts.append((first, end - first, data))
        sent = kv_checksum.to_hex(total)
        whole = pack_blocks(src, blocks)
        assert kv_checksum.to_hex(kv_checksum.of_payload(whole, 2 * layers, n)) == sent
        assert kv_checksum.to_hex(kv_checksum.of_payload(bytes(whole.numpy()), 2 * layers, n)) == sent
        assert kv_checksum.to_hex(kv_checksum.of_payload(Pieces(tuple(parts)), 2 * layers, n)) == sent
        dst = torch.zeros(layers, 2, 20, 4, heads, head_dim * dtype.itemsize, dtype=torch.uint8).view(dtype)
        landed_in = rng.sample(range(20), n)
        unpack_blocks(dst, landed_in, Pieces(tuple(parts)))
        assert kv_checksum.to_hex(kv_checksum.of_blocks(dst, landed_in)) == sent, (i, dtype, n, cuts)


def test_a_flipped_byte_anywhere_a_swapped_pair_of_blocks_or_a_zeroed_block_changes_the_checksum():
    kv = torch.randint(0, 256, (2, 2, 8, 4, 2, 16), dtype=torch.uint8).view(torch.bfloat16)
    payload = pack_blocks(kv, range(6)).clone()
    good = kv_checksum.to_hex(kv_checksum.of_payload(payload, 4, 6))
    for at in random.Random(0).sample(range(payload.numel()), 64):
        bad = payload.clone()
        bad[at] ^= 1 << random.Random(at).randrange(8)
        assert kv_checksum.to_hex(kv_checksum.of_payload(bad, 4, 6)) != good
    assert kv_checksum.to_hex(kv_checksum.of_blocks(kv, [1, 0, 2, 3, 4, 5])) != good
    zeroed = kv.clone()
    zeroed[:, :, 3] = 0
    assert kv_checksum.to_hex(kv_checksum.of_blocks(zeroed, range(6))) != good


# -- the copy that takes the sums in its own pass (CUDA: triton_kernels/kv_pack.py) ---------------
def check_kv_pack_kernel(device: str) -> None:
    """kv_pack's pack and unpack against the platform's torch path (a copy, then a read), on caches of
    every dtype, rows of whole words (so the kernel runs): the same bytes where they land and the
    same checksum, bit for bit, a transfer's pieces added into one total; a row wider than one chunk;
    the cache's other blocks untouched; a flipped byte changes the checksum."""
    from baton.engine.platforms import get_platform
    from baton.engine.platforms.triton_kernels import kv_pack
    reference, rng = get_platform("cpu"), random.Random(7)

    def zeros(where=device):
        return torch.zeros(2, dtype=torch.int64, device=where)
    for i, dtype in enumerate(_dtypes() * 2):
        layers, heads, head_dim = rng.choice([1, 2, 3]), rng.choice([1, 2, 4]), rng.choice([8, 32, 64])
        block_size = 4 if i < 3 else 64              # 64 x 4 x 64 x 2 bytes: rows of 4,096 words, four chunks
        cache_blocks = 12
        raw = torch.randint(0, 256, (layers, 2, cache_blocks, block_size, heads, head_dim * dtype.itemsize),
                            dtype=torch.uint8)
        kv = raw.view(dtype).to(device)
        assert kv_pack.supported(kv)
        blocks = rng.sample(range(cache_blocks), rng.randint(2, 6))
        cut = rng.randint(1, len(blocks) - 1)
        want = zeros("cpu")
        want_data = reference.pack_kv(raw.view(dtype), torch.tensor(blocks), want, 0)
        got = zeros()
        for first, ids in ((0, blocks[:cut]), (cut, blocks[cut:])):      # two pieces (each packed on its own),
            kv_pack.pack(kv, torch.tensor(ids, device=device), got, first)     # one running total
        whole = zeros()
        data = kv_pack.pack(kv, torch.tensor(blocks, device=device), whole, 0)
        assert torch.equal(data.cpu(), want_data), (i, dtype)
        assert torch.equal(got.cpu(), want) and torch.equal(whole.cpu(), want), (i, dtype)
        assert torch.equal(kv_pack.pack(kv, torch.tensor(blocks, device=device), None, 0), data)
        into = rng.sample(range(cache_blocks), len(blocks))
        dst, landed = torch.zeros_like(kv), zeros()
        kv_pack.unpack(dst, torch.tensor(into, device=device), data, landed, 0)
        assert torch.equal(landed.cpu(), want), (i, dtype)
        assert torch.equal(dst[:, :, into].cpu().view(torch.uint8), raw[:, :, blocks]), "(bytes: random ones hold NaNs)"
        rest = [b for b in range(cache_blocks) if b not in into]
        assert not dst[:, :, rest].view(torch.uint8).any(), "blocks outside the index are untouched"
        spoiled, bad = data.clone(), zeros()
        spoiled[rng.randrange(spoiled.numel())] ^= 1 << rng.randrange(8)
        kv_pack.unpack(torch.zeros_like(kv), torch.tensor(into, device=device), spoiled, bad, 0)
        assert not torch.equal(bad.cpu(), want), "a flipped byte changes the checksum"
    # 66 rows x 125 blocks of one word: 8,250 pairs, four a program, the last program half empty
    raw = torch.randint(0, 256, (33, 2, 130, 1, 1, 8), dtype=torch.uint8)
    blocks = rng.sample(range(130), 125)
    want = zeros("cpu")
    want_data = reference.pack_kv(raw, torch.tensor(blocks), want, 3)
    got = zeros()
    data = kv_pack.pack(raw.to(device), torch.tensor(blocks, device=device), got, 3)
    assert torch.equal(data.cpu(), want_data) and torch.equal(got.cpu(), want), "several pairs a program"
    print("kv_pack kernels ok")


@pytest.mark.timeout(300)
def test_the_kv_pack_kernel_matches_the_torch_path_in_the_interpreter():
    in_triton_interpreter("import test_kv_integrity; test_kv_integrity.check_kv_pack_kernel('cpu')",
                          "kv_pack kernels ok", "the KV pack kernel", timeout=240)


# -- two engines, stepped by hand ---------------------------------------------------------------
@pytest.fixture(scope="module")
def engines():
    config = dict(model="tiny-llama", num_kv_blocks=32, max_num_batched_tokens=16)
    return LLMEngine(EngineConfig(**config), handoff=Hook()), LLMEngine(EngineConfig(**config), handoff=Hook())


@pytest.fixture
def pair(engines):
    prefill, decode = engines
    prefill.handoff, decode.handoff = Hook(), Hook()
    unrefs = collections.Counter()
    unref = decode.block_manager._unref
    decode.block_manager._unref = lambda b: unrefs.update([b]) or unref(b)
    yield prefill, decode, unrefs
    del decode.block_manager._unref
    for e in engines:
        assert not e.states, "a test left a request in an engine"
        assert e.block_manager.num_free_blocks == e.block_manager.num_blocks


def prefilled(prefill: LLMEngine, prompt: list[int], epoch: str):
    """The prompt's KV as the prefill engine hands it off (pieces, as chunked prefill made them
    final), sealed for `epoch` as the sender does; (payload, first token, meta)."""
    prefill.add_request(prompt, SamplingParams(temperature=0, max_tokens=1), request_id="p", hand_off_kv=True)
    while prefill.has_unfinished:
        prefill.step()
    pieces = prefill.handoff.pieces
    assert len(pieces) > 1 and pieces[-1].last
    last = seal(pieces[-1], epoch)
    return Pieces(tuple((p.first_block, p.num_blocks, p.data) for p in pieces)), last.first_token, last.meta


def decoded(decode: LLMEngine, rid: str, prompt: list[int], epoch: str, payload, first_token: int, meta):
    """Reserve, land, step to the end: (outputs, the ticket)."""
    ticket = decode.reserve(rid, prompt, GREEDY)
    ticket.epoch = epoch                           # what the decode core sets at admission
    decode.handoff.land(ticket, payload, first_token, meta)
    outs = []
    while decode.has_work or decode.has_unfinished:
        outs += decode.step()
    return outs, ticket


def colocated(engine: LLMEngine, prompt: list[int]) -> list[int]:
    engine.add_request(prompt, GREEDY, request_id="c")
    tokens = []
    while engine.has_unfinished:
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    return tokens


def assert_refused(outs, ticket, unrefs, reason: str) -> None:
    (out,) = outs
    assert out.finished and out.new_token_ids == [] and f"could not join the transferred KV: {reason}" in out.error
    assert ticket.refused == reason and ticket.history[-2:] == [KVState.LANDED, KVState.FREED]
    assert sorted(unrefs) == sorted(ticket.block_ids) and set(unrefs.values()) == {1}, "blocks freed once each"


def test_a_clean_transfer_decodes_exactly_what_a_colocated_run_does(pair):
    prefill, decode, _ = pair
    prompt = fresh_prompt()
    payload, first, meta = prefilled(prefill, prompt, "e1")
    assert meta[EPOCH_META] == "e1" and len(meta[CHECKSUM_META]) == 32
    outs, ticket = decoded(decode, "d", prompt, "e1", payload, first, meta)
    assert ticket.history[-2:] == [KVState.JOINED, KVState.FINISHED] and ticket.refused is None
    assert [t for out in outs for t in out.new_token_ids] == colocated(prefill, prompt)


def test_a_flipped_byte_is_refused_at_the_join_and_the_blocks_freed_once(pair):
    prefill, decode, unrefs = pair
    payload, first, meta = prefilled(prefill, fresh_prompt(), "e1")
    first_block, n, data = payload.parts[1]
    spoiled = data.clone()
    spoiled[spoiled.numel() // 3] ^= 0x10
    payload = Pieces((payload.parts[0], (first_block, n, spoiled), *payload.parts[2:]))
    outs, ticket = decoded(decode, "d", fresh_prompt(), "e1", payload, first, meta)
    assert_refused(outs, ticket, unrefs, "corrupt")


def test_kv_written_in_place_is_checked_in_the_blocks_it_was_written_into(pair):
    prefill, decode, unrefs = pair
    prompt = fresh_prompt()
    payload, first, meta = prefilled(prefill, prompt, "e1")
    ticket = decode.reserve("d", prompt, GREEDY)
    ticket.epoch = "e1"
    decode.runner.write_kv(list(ticket.block_ids), payload)            # what NIXL does, from afar
    decode.runner.kv_cache[0, 1, ticket.block_ids[2], 5] = 0           # ... and a stale block row
    decode.handoff.land(ticket, InPlace(ticket.block_ids, len(payload)), first, meta)
    assert_refused(decode.step(), ticket, unrefs, "corrupt")


@pytest.mark.parametrize("how", ["earlier-reservation", "no-proof"])
def test_a_stale_or_unproven_payload_is_refused(pair, how):
    prefill, decode, unrefs = pair
    payload, first, meta = prefilled(prefill, fresh_prompt(), "e1")
    if how == "no-proof":
        meta = {k: v for k, v in meta.items() if k not in (EPOCH_META, CHECKSUM_META)}
    outs, ticket = decoded(decode, "d", fresh_prompt(), "e2", payload, first, meta)   # re-admitted: e2
    assert_refused(outs, ticket, unrefs, "stale" if how == "earlier-reservation" else "unproven")


@pytest.mark.parametrize("how", ["a-block-short", "a-piece-missing"])
def test_a_truncated_payload_is_refused(pair, how):
    prefill, decode, unrefs = pair
    payload, first, meta = prefilled(prefill, fresh_prompt(), "e1")
    if how == "a-block-short":
        whole = torch.cat([data for _, _, data in payload.parts])
        payload = whole[: whole.numel() * 3 // 4]
    else:
        payload = Pieces(payload.parts[:1] + payload.parts[2:])
    outs, ticket = decoded(decode, "d", fresh_prompt(), "e1", payload, first, meta)
    assert_refused(outs, ticket, unrefs, "partial")


class NotYet:
    """A device event the device has not passed (what a step in flight leaves ahead of a checksum)."""

    def __init__(self):
        self.waited = False

    def query(self) -> bool:
        return self.waited

    def synchronize(self) -> None:
        self.waited = True


@pytest.mark.parametrize("then", ["joins", "is-aborted"])
def test_while_a_step_runs_the_checksum_is_read_at_the_next_join_not_waited_for(pair, monkeypatch, then):
    prefill, decode, unrefs = pair
    prompt = fresh_prompt()
    payload, first, meta = prefilled(prefill, prompt, "e1")
    land, events = decode.runner.land_kv, []

    def land_on_a_busy_device(*args):
        proof = land(*args)
        proof.ready = NotYet()
        events.append(proof.ready)
        return proof
    monkeypatch.setattr(decode.runner, "land_kv", land_on_a_busy_device)
    ticket = decode.reserve("d", prompt, GREEDY)
    ticket.epoch = "e1"
    decode.handoff.land(ticket, payload, first, meta)
    decode.in_flight = object()                    # a step on the device
    try:
        assert decode.kv.join_landed(decode) == [] and not events[0].waited
        assert ticket.state is KVState.LANDED and decode.has_work      # an idle engine steps again for it
        if then == "is-aborted":
            decode.abort("d")
            assert sorted(unrefs) == sorted(ticket.block_ids) and set(unrefs.values()) == {1}
        outs = decode.kv.join_landed(decode)       # the step it was queued behind has ended
    finally:
        decode.in_flight = None
    if then == "is-aborted":
        assert outs == [] and ticket.state is KVState.FREED and not decode.kv.proving
        assert set(unrefs.values()) == {1}, "freed once"
        return
    assert events[0].waited and [o.new_token_ids for o in outs] == [[first]] and ticket.state is KVState.JOINED
    while decode.has_unfinished:
        decode.step()


# -- both services in one process, over each CPU backend -----------------------------------------
def spoiling(piece):
    """The last piece's bytes changed after the engine proved them (between the pack and the wire:
    a buffer freed and reused, a bad copy)."""
    if piece.last:
        data = piece.data.clone()
        data[data.numel() // 2] ^= 0x01
        piece = replace(piece, data=data)
    return piece


def refusals(decode_worker, reason: str) -> float:
    value = decode_worker.metrics.registry.get_sample_value("baton_kv_transfer_failures_total", {"reason": reason})
    return value or 0.0


@pytest.mark.parametrize("backend", ["memory", "grpc", "direct"])
def test_over_each_backend_only_the_clean_transfer_reaches_the_client(backend, monkeypatch):
    """Clean, then a flipped byte, then a payload sealed for an earlier reservation of the same
    request id (a replay, or a late payload): the clean one streams its tokens, the others fail
    before the first token with every block back, counted by reason; then a clean one again."""
    from baton.serving.grpc_server import ServiceError
    from baton.serving.worker import kv_push

    async def attempt(prefill, decode, rid, how="clean"):
        if how == "stale":
            earlier = await admit(decode, rid)
            decode.abort_request(rid, "the router retried it")
            await idle(decode)
            monkeypatch.setattr(kv_push, "seal", lambda piece, epoch: seal(piece, earlier.transfer_id))
        admitted = await admit(decode, rid)
        assert admitted.backend == backend
        handoff = core(prefill).handoff
        if how == "corrupt":
            hand = handoff.on_prompt_kv
            handoff.on_prompt_kv = lambda piece: hand(spoiling(piece))
        stream = asyncio.ensure_future(collect(decode, rid))
        try:
            await prefill.prefill(prefill_request(rid, admitted))
            return await stream
        except ServiceError as exc:
            return exc
        finally:
            monkeypatch.setattr(kv_push, "seal", seal)
            vars(handoff).pop("on_prompt_kv", None)
            await idle(prefill, decode)

    async def main():
        flags = ("--kv-backend", backend, "--no-engine-process")
        async with workers(flags, flags) as (prefill, decode):
            got = {how: await attempt(prefill, decode, f"r-{how}", how) for how in ("clean", "corrupt", "stale")}
            got["again"] = await attempt(prefill, decode, "r-again")
            counts = {reason: refusals(decode, reason) for reason in ("corrupt", "stale", "partial", "unproven")}
            return got, counts
    got, counts = asyncio.run(main())
    assert isinstance(got["clean"], list) and len(got["clean"]) == 4 and got["again"] == got["clean"]
    for how in ("corrupt", "stale"):
        assert isinstance(got[how], ServiceError) and f"could not join the transferred KV: {how}" in str(got[how])
    assert counts == {"corrupt": 1, "stale": 1, "partial": 0, "unproven": 0}
