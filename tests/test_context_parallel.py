"""Context-parallel prefill (engine/runner/context_parallel.py): two ranks (gloo on the CPU) split each
prefill step's tokens and give the single device's greedy tokens and KV cache."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from helpers import Hook, save_tiny_checkpoint

from baton.engine import LLM, SamplingParams
from baton.engine.config import EngineConfig
from baton.engine.runner.context_parallel import fingerprint, plan_step, zigzag_pieces
from baton.engine.runner.kv_blocks import Pieces

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
OPTIONS = dict(num_kv_blocks=96, block_size=16, max_num_batched_tokens=64, device="cpu", dtype="float32")


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def engines(request, tmp_path_factory):
    from baton.models.source import resolve_model
    tokenizer_dir = os.environ.get("BATON_TOKENIZER") or resolve_model(None).tokenizer_path
    path = save_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param), tokenizer_dir)
    single = LLM(str(path), **OPTIONS)
    cp = LLM(str(path), context_parallel_size=2, **OPTIONS)
    try:
        yield single, cp
    finally:
        cp.engine.runner.close()


def _count_sharded(llm) -> list[int]:
    """Wrap rank 0's context-parallel forward: the count of steps it split."""
    cp, calls = llm.engine.runner.executor.cp, [0]
    inner = cp.forward

    def counted(*args):
        hidden = inner(*args)
        calls[0] += hidden is not None
        return hidden
    cp.forward = counted
    return calls


def test_greedy_tokens_and_kv_cache_equal_the_single_device(engines):
    single, cp = engines
    sharded = _count_sharded(cp)
    g = torch.Generator().manual_seed(3)
    long = torch.randint(3, 49152, (301,), generator=g).tolist()       # five chunks of 64 and one of 45
    pair = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (157, 77)]
    shared = long[:160] + torch.randint(3, 49152, (51,), generator=g).tolist()   # a prefix-cache hit
    for batch in ([long], pair, [shared]):
        want = single.generate(batch, GREEDY)
        got = cp.generate(batch, GREEDY)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[0].cached_tokens >= 160                 # the shared prefix came from rank 0's cache
    assert sharded[0] >= 6, sharded                    # the long prompt's chunks at least were split
    for llm in (single, cp):
        assert llm.engine.block_manager.num_free_blocks == OPTIONS["num_kv_blocks"]
    # same requests, same blocks: rank 0's cache holds what the single device's holds. Not bit for bit: a
    # rank's matmuls see half the rows, and a CPU's BLAS may sum those in another order (one CI machine
    # differed by 2.5e-4 on values near 3). A wrong block, position or shard differs by the values' size.
    mine, theirs = cp.engine.runner.kv_cache, single.engine.runner.kv_cache
    scale = theirs.abs().max().item()
    assert scale > 0
    torch.testing.assert_close(mine, theirs, atol=1e-3 * scale, rtol=1e-3)


def test_short_steps_run_replicated_and_tiny_pieces_still_split(engines):
    """A step below CP_MIN_TOKENS runs whole on every rank; a 3-token prompt beside a 31-token one is split
    (rank 0 gets one of its tokens, rank 1 two); the ranks stay in step either way."""
    single, cp = engines
    sharded = _count_sharded(cp)
    for prompts, splits in (([[5, 6, 7, 8, 9]], 0), ([[5, 6, 7], list(range(10, 41))], 1)):
        before = sharded[0]
        assert [o.token_ids for o in cp.generate(prompts, GREEDY)] == \
            [o.token_ids for o in single.generate(prompts, GREEDY)]
        assert sharded[0] - before == splits
    with pytest.raises(RuntimeError, match="rank 0's cache only"):    # landed KV would miss rank 1's copy
        cp.engine.runner.write_kv([0], b"")




def test_a_cp_prefill_hands_off_rank_0s_kv_and_decode_elsewhere_gives_the_same_tokens(engines):
    """The prefill role: rank 0's pieces, landed in a single-device engine, decode as that engine's
    own prefill would."""
    single, cp = engines
    prompt = torch.randint(3, 49152, (203,), generator=torch.Generator().manual_seed(4)).tolist()
    want = single.generate([prompt], GREEDY)[0].token_ids
    sent, got = cp.engine.handoff, single.engine.handoff
    cp.engine.handoff, single.engine.handoff = Hook(), Hook()
    try:
        cp.engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1), request_id="p", hand_off_kv=True)
        while cp.engine.has_unfinished:
            cp.engine.step()
        pieces = cp.engine.handoff.pieces
        assert pieces and pieces[-1].last and sum(p.num_blocks for p in pieces) == -(-len(prompt) // 16)
        ticket = single.engine.reserve("d", prompt, GREEDY)
        payload = Pieces(tuple((p.first_block, p.num_blocks, p.data) for p in pieces))
        assert ticket.land(payload, pieces[-1].first_token, pieces[-1].meta)
        single.engine.handoff.landed.append(ticket)
        tokens = []
        while single.engine.has_unfinished:
            tokens += [t for out in single.engine.step() for t in out.new_token_ids]
    finally:
        cp.engine.handoff, single.engine.handoff = sent, got
    assert tokens == want
    for llm in (single, cp):
        assert llm.engine.block_manager.num_free_blocks == OPTIONS["num_kv_blocks"]


def test_prompt_logprobs_and_sampled_logprobs_match(engines):
    """Every prompt row's hidden state comes back to rank 0 (all-gathered), so prompt logprobs match."""
    single, cp = engines
    prompt = torch.randint(3, 49152, (150,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    want, got = single.generate([prompt], params)[0], cp.generate([prompt], params)[0]
    assert got.token_ids == want.token_ids
    assert len(got.prompt_logprobs) == len(prompt) and got.prompt_logprobs[0] is None
    for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_the_weights_fingerprint_sees_one_changed_weight():
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 8))
    before = fingerprint(model).item()
    assert fingerprint(model).item() == before
    with torch.no_grad():
        model[0].weight[0, 0] += 0.5                   # index 0 is in every sample
    assert fingerprint(model).item() != before


def test_zigzag_pieces_cover_every_token_once():
    for n in (1, 2, 5, 16, 45, 64, 301):
        for world in (2, 3):
            covered = sorted(t for r in range(world) for a, b in zigzag_pieces(n, world, r) for t in range(a, b))
            assert covered == list(range(n))
    assert zigzag_pieces(64, 2, 0) == [(0, 16), (48, 64)]
    assert zigzag_pieces(64, 2, 1) == [(16, 32), (32, 48)]


def test_plan_keys_end_at_each_piece():
    from types import SimpleNamespace
    inputs = SimpleNamespace(is_decode=False, num_decode_rows=0, mrope_positions=None, draft=None,
                             input_ids=np.zeros(45, np.int64), slots=np.arange(100, 145, dtype=np.int64),
                             query_starts=np.array([0, 20, 45], np.int32), seq_lens=np.array([20, 125], np.int32),
                             block_tables=np.arange(16, dtype=np.int32).reshape(2, 8))
    plans = [plan_step(inputs, 2, r) for r in range(2)]
    assert plans[0].rows.tolist() == [*range(0, 5), *range(15, 20), *range(20, 26), *range(38, 45)]
    # sequence 1 has 100 cached tokens: its first piece on rank 0 ends at token 106
    assert plans[0].seq_lens.tolist() == [5, 20, 106, 125]
    assert plans[0].query_starts.tolist() == [0, 5, 10, 16, 23]
    gathered = plans[0].gathered_slots
    assert sorted(gathered[gathered >= 0].tolist()) == list(range(100, 145))
    assert (plans[0].gathered_slots[plans[0].order] == inputs.slots).all()


@pytest.mark.parametrize("options,match", [
    (dict(context_parallel_size=2, tp_size=2), "not combined with tensor"),
    (dict(context_parallel_size=0), "context_parallel_size must be >= 1"),
    (dict(context_parallel_size=2, kv_offloading_size=1.0), "kv-offloading-size"),
    (dict(context_parallel_size=2, deterministic=True), "deterministic"),
    (dict(context_parallel_size=2, async_scheduling=True), "async-scheduling"),
])
def test_bad_combinations_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**options).validate()


def test_more_ranks_than_devices_is_refused():
    from baton.engine.runner.tensor_parallel import check_devices
    with pytest.raises(ValueError, match="devices"):
        check_devices(["cuda:0", "cuda:1"], available=1)
    check_devices(["cpu", "cpu"], available=0)


def test_decode_role_refuses_context_parallelism():
    from baton.serving.worker.worker_config import build_parser, worker_config_from_args
    args = build_parser("decode").parse_args(["--context-parallel-size", "2"])
    with pytest.raises(ValueError, match="decode worker"):
        worker_config_from_args(args, "decode")
    for role in ("prefill", "colocated"):
        args = build_parser(role).parse_args(["--context-parallel-size", "2"])
        assert worker_config_from_args(args, role).engine.context_parallel_size == 2
