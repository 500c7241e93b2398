"""Speculative decoding (engine/speculation/speculative.py): n-gram guesses verified in one step give the
tokens plain decoding gives -- greedy and seeded, token for token, on the embedded model and the
tiny architectures -- and unseeded sampling keeps the target distribution (a chi-square test).
An EAGLE-3 draft head (engine/runner/draft_head.py, models/eagle3.py; random weights: no trained head
ships here) gives plain decoding's greedy tokens too, offline, 1P1D and after a migration, and its
rejection sampler keeps the target distribution."""
from __future__ import annotations

import os

import pytest
import torch
from helpers import save_tiny_checkpoint, save_tiny_eagle3_head, tiny_hf_config

from baton.engine import LLM, SamplingParams
from baton.engine.speculation.speculative import NgramProposer, accept

DEVICE = os.environ.get("BATON_TEST_DEVICE", "cpu")
SPEC = dict(speculative_method="ngram", num_speculative_tokens=4)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_ngram_proposer_finds_the_latest_longest_match():
    p = NgramProposer(k=3)
    assert p.propose([1, 2, 3, 4, 9, 1, 2, 3], limit=10) == [4, 9, 1]      # suffix 1 2 3 seen before
    assert p.propose([5, 6, 7, 5, 6, 8, 5, 6], limit=10) == [8, 5, 6]      # the latest occurrence wins
    assert p.propose([1, 2, 3, 4, 9, 1, 2, 3], limit=2) == [4, 9]          # room left caps it
    assert p.propose([1, 2, 3], limit=5) == []                              # nothing repeats
    assert p.propose([7], limit=5) == []


def test_guesses_go_on_past_a_token_in_flight():
    """Past a plain step in flight, the n-gram match of the known tokens predicts its token and guesses
    the ones after it; past guesses in flight (as if all held), the match goes on where they end."""
    from baton.engine.scheduling.sequence import PENDING, Sequence
    from baton.engine.speculation.speculative import Speculator
    spec = Speculator("ngram", k=4, max_batch=32)
    prompt = list(range(1, 13)) + [1, 2]
    seq = Sequence("a", prompt, SamplingParams(max_tokens=30), 256)
    seq.num_computed_tokens = 14
    seq.append_pending()                                   # a plain step samples token 14 (predicted: 3)
    spec.propose([seq])
    assert seq.draft == [4, 5, 6, 7] and seq.spec_next == 8
    seq.token_ids += seq.draft                             # ...which went in as tokens, the next pending
    seq.num_unverified_tokens, seq.num_computed_tokens = 4, 19
    seq.append_pending()
    spec.propose([seq])
    assert seq.draft == [9, 10, 11, 12]                    # after 7 comes 8 (the token in flight), then these
    seq.rollback(14)
    seq.append_token(99)                                   # nothing in flight, and nothing repeats
    seq.num_computed_tokens = 14
    spec.propose([seq])
    assert seq.draft == [] and seq.spec_next is None and seq.spec_misses == 1
    assert PENDING not in seq.token_ids


def test_accept_keeps_guesses_up_to_the_first_disagreement():
    assert accept([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]                  # all held, plus the bonus
    assert accept([4, 5, 6], [4, 9, 6, 7]) == [4, 9]
    assert accept([4, 5, 6], [8, 5, 6, 7]) == [8]


@pytest.fixture(scope="module")
def copy_prompts(embedded_llm):
    """Prompts whose answers copy spans of the prompt (where n-gram guesses hold)."""
    tok = embedded_llm.tokenizer
    texts = ["Repeat this list exactly: apples, pears, plums, cherries, apples, pears, plums, cherries, apples,",
             "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(a, b):\n",
             "one two three four five one two three four five one two three"]
    return [tok(t)["input_ids"] for t in texts]


@pytest.fixture(scope="module")
def plain_greedy(embedded_llm, copy_prompts):
    """Plain decoding's greedy tokens of the copy prompts (computed once: the CPU is slow at it)."""
    return [o.token_ids for o in embedded_llm.generate(copy_prompts, GREEDY)]


@pytest.fixture(scope="module")
def spec_llm(embedded_llm):
    return LLM(embedded_llm.engine.source.name, **SPEC)


def test_greedy_and_seeded_tokens_are_plain_decodings_on_the_embedded_model(embedded_llm, spec_llm, copy_prompts,
                                                                           plain_greedy):
    params = [GREEDY, SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=3, max_tokens=24, ignore_eos=True)]
    plain = [plain_greedy, [o.token_ids for o in embedded_llm.generate(copy_prompts, params[1])]]
    spec = [[o.token_ids for o in spec_llm.generate(copy_prompts, p)] for p in params]
    assert spec == plain
    stats = spec_llm.engine.speculator.stats
    assert stats.accepted > 0 and stats.mean_accepted > 1.5, stats


@pytest.mark.parametrize("arch,ahead", [("qwen3", False), ("llama", False), ("qwen3_moe", False), ("qwen3", True)])
def test_tiny_architectures_decode_the_same_tokens_with_guesses(tmp_path, arch, ahead):
    """A verifying step runs as a decode step of one row per token (each row its own context length
    over its sequence's blocks: the shape the decode graphs replay on CUDA). ahead: asynchronous
    scheduling, as on accelerators: a verifying step stays in flight until the next call settles
    it, and while no sequence is due to guess (backing off) plain steps are scheduled ahead."""
    from baton.models.source import resolve_model
    tokenizer_dir = os.environ.get("BATON_TOKENIZER") or resolve_model(None).tokenizer_path
    path = str(save_tiny_checkpoint(arch, tmp_path / arch, tokenizer_dir))
    g = torch.Generator().manual_seed(5)
    motif = torch.randint(3, 49152, (6,), generator=g).tolist()
    prompts = [motif * 4, torch.randint(3, 49152, (30,), generator=g).tolist(), motif * 2 + [9, 9]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    common = dict(device=DEVICE, num_kv_blocks=128, block_size=16, async_scheduling=ahead or None)
    want = [o.token_ids for o in LLM(path, **common).generate(prompts, params)]
    llm = LLM(path, **common, **SPEC)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.speculator.stats.steps > 0
    assert llm.engine.block_manager.num_free_blocks == 128


def _tokenizer_dir() -> str:
    from baton.models.source import resolve_model
    return os.environ.get("BATON_TOKENIZER") or resolve_model(None).tokenizer_path


def _lm_head(path) -> torch.Tensor:
    from safetensors.torch import load_file
    weights = load_file(str(path / "model.safetensors"))
    return weights.get("lm_head.weight", weights.get("model.embed_tokens.weight"))


@pytest.mark.parametrize("arch,ahead", [("llama", False), ("qwen3", True), ("qwen3_moe", False)])
def test_tiny_architectures_decode_the_same_tokens_with_an_eagle3_head(tmp_path, arch, ahead):
    """Guesses drafted by an EAGLE-3 head (its KV in one more cache layer, the target's hidden states of
    three layers fed to it every step) are kept only where they are the target's argmax: greedy tokens
    are plain decoding's, with guesses kept and guesses refused, every block back (the head guesses
    "the target's token again" over a draft vocabulary of the tokens in play)."""
    path = save_tiny_checkpoint(arch, tmp_path / arch, _tokenizer_dir())
    g = torch.Generator().manual_seed(5)
    motif = torch.randint(3, 49152, (6,), generator=g).tolist()
    prompts = [motif * 4, torch.randint(3, 49152, (30,), generator=g).tolist(), motif * 2 + [9, 9]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    common = dict(device=DEVICE, num_kv_blocks=128, block_size=16, async_scheduling=ahead or None)
    want = [o.token_ids for o in LLM(str(path), **common).generate(prompts, params)]
    vocab = sorted({t for w in want for t in w} | set(range(3, 300)) | set(motif))
    head = save_tiny_eagle3_head(tmp_path / "head", tiny_hf_config(arch), vocab, mimic=_lm_head(path))
    llm = LLM(str(path), **common, speculative_method="eagle3", speculative_model=str(head))
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    stats = llm.engine.speculator.stats
    assert stats.steps > 0 and 0 < stats.accepted < stats.proposed, stats
    assert llm.engine.block_manager.num_free_blocks == 128


def test_an_eagle3_heads_pass_writes_the_same_kv_captured_or_eager_and_with_or_without_its_outputs(tmp_path):
    """The head's pass over each step, as it ran (a captured graph's replay where the decode graphs ran
    the step, BATON_TEST_DEVICE=cuda:N; eager otherwise; only the head's KV where the step had more
    sequences than --speculative-max-batch), against the eager full pass over the same inputs: the same
    head KV, and the same outputs where it kept them. Speculation resumes once the batch shrinks, and
    the greedy tokens are plain decoding's."""
    from collections import Counter

    from baton.models.forward_context import ForwardContext
    path = save_tiny_checkpoint("llama", tmp_path / "llama", _tokenizer_dir())
    g = torch.Generator().manual_seed(7)
    motif = torch.randint(3, 49152, (5,), generator=g).tolist()
    prompts = [motif * 4, motif * 3 + [7], torch.randint(3, 49152, (20,), generator=g).tolist(), motif * 2]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 10, 24, 24)]
    common = dict(device=DEVICE, dtype="float32", num_kv_blocks=64, block_size=16, max_num_seqs=8)
    want = [o.token_ids for o in LLM(str(path), **common).generate(prompts, params)]
    vocab = sorted({t for w in want for t in w} | set(range(3, 300)) | set(motif))
    head = save_tiny_eagle3_head(tmp_path / "head", tiny_hf_config("llama"), vocab, mimic=_lm_head(path))
    llm = LLM(str(path), **common, speculative_method="eagle3", speculative_model=str(head), speculative_max_batch=2)
    r = llm.engine.runner
    drafts, cache, ran = r.drafts, r.kv_cache[-1], Counter()
    tol = dict(atol=1e-4, rtol=1e-3) if DEVICE.startswith("cuda") else dict(atol=0, rtol=0)
    as_run = drafts.pass_over_step

    def checked(step, sampled):
        full, before = step.draft.full, cache.clone()
        out = as_run(step, sampled)
        written = cache.clone()
        cache.copy_(before)
        ctx = ForwardContext(step.meta, r.kv_caches, r.attention, r.scale)
        eager = drafts.run_pass(drafts.next_tokens(step.draft, sampled), step.positions, step.aux, ctx, True)
        torch.testing.assert_close(written, cache, **tol)
        if full:
            torch.testing.assert_close(out, eager, **tol)
        else:
            assert out is None
        ran[step.graphs is not None, full] += 1
        return out

    drafts.pass_over_step = checked
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    graphed = DEVICE.startswith("cuda")
    assert ran[graphed, False] > 0 and ran[graphed, True] > 0, ran        # KV only at 4 and 3 sequences, full at 2
    assert llm.engine.speculator.stats.steps > 0
    assert llm.engine.block_manager.num_free_blocks == 64


def test_an_eagle3_head_that_does_not_fit_is_refused_with_the_reason(tmp_path):
    from baton.engine.config import EngineConfig
    with pytest.raises(ValueError, match="needs one"):
        EngineConfig(model="tiny-llama", speculative_method="eagle3").validate()
    with pytest.raises(ValueError, match="only for"):
        EngineConfig(model="tiny-llama", speculative_method="ngram", speculative_model=str(tmp_path)).validate()
    for refused in (dict(tp_size=2), dict(kv_cache_dtype="fp8")):
        with pytest.raises(ValueError, match="for now"):
            EngineConfig(model="tiny-llama", speculative_method="eagle3", speculative_model="x", **refused).validate()
    with pytest.raises(ValueError, match="no config.json"):
        LLM("tiny-llama", num_kv_blocks=8, speculative_method="eagle3", speculative_model=str(tmp_path))
    other = save_tiny_eagle3_head(tmp_path / "qwen3", tiny_hf_config("qwen3"), list(range(8)))
    with pytest.raises(ValueError, match="KV heads"):        # head_dim 32: tiny-llama's is 16
        LLM("tiny-llama", num_kv_blocks=8, speculative_method="eagle3", speculative_model=str(other))


def test_an_eagle3_head_loads_as_its_trainers_store_it(tmp_path):
    """Names under `model.layers.0.` (as some trainers write them) instead of `midlayer.`, the head's own
    embedding, and no d2t / t2d where the draft vocabulary is the target's: it loads, and greedy tokens
    are plain decoding's."""
    from baton.models.eagle3 import random_head, save_head
    from baton.models.presets import PRESETS
    tensors, config = random_head(PRESETS["tiny-llama"])
    tensors = {("model." + n.replace("midlayer.", "layers.0.")): t for n, t in tensors.items() if n not in ("d2t", "t2d")}
    tensors["embed_tokens.weight"] = torch.randn(config["vocab_size"], config["hidden_size"]) * 0.1
    head = save_head(tmp_path / "head", tensors, config)
    prompts, params = [list(range(2000, 2006)) * 3], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = LLM("tiny-llama", num_kv_blocks=16).generate(prompts, params)[0].token_ids
    llm = LLM("tiny-llama", num_kv_blocks=16, speculative_method="eagle3", speculative_model=str(head))
    assert llm.generate(prompts, params)[0].token_ids == want
    loaded = llm.engine.runner.head
    assert loaded.embed_tokens is not None and not loaded.d2t.any() and llm.engine.speculator.stats.proposed > 0


def test_the_rejection_sampler_keeps_the_target_distribution():
    """Guesses d drawn from q over a draft vocabulary (4 of 6 ids, as `d2t` maps them), accepted with
    probability min(1, p(d)/q(d)), else a draw from max(0, p - q): the tokens come out distributed
    as p (temperature 0.7, top-k 5). 100k draws, chi-square; false-failure rate: the threshold is
    p < 1e-4. A guess is never redrawn on rejection, and a seed gives the same tokens twice."""
    from baton.engine.runner.draft_head import DraftChecks, DraftHead
    from baton.engine.runner.sampler import SamplingBatch, probabilities
    n, vocab = 100_000, 6
    head = DraftHead.__new__(DraftHead)
    head.targets = torch.tensor([0, 2, 3, 5])
    logits = torch.tensor([1.0, 0.2, -0.5, 0.9, 0.1, -2.0]).repeat(n, 1)
    q_draft = torch.tensor([0.1, 0.5, 0.1, 0.3])
    guesses = head.targets[torch.multinomial(q_draft, n, replacement=True, generator=torch.Generator().manual_seed(1))]

    def batch(seeded: bool) -> SamplingBatch:
        return SamplingBatch(temperatures=torch.full((n,), 0.7), top_ks=torch.full((n,), 5), top_ps=torch.ones(n),
                             seeds=torch.arange(n), has_seed=torch.full((n,), seeded),
                             positions=torch.full((n,), 40), all_greedy=False, any_greedy=False, any_top_k=True,
                             any_top_p=False, any_seed=seeded)
    checks = DraftChecks(torch.arange(n).numpy(), guesses.numpy(), q_draft.repeat(n, 1))
    out = head.reject(logits, batch(False), torch.full((n,), -1), checks)
    p = probabilities(logits[:1], torch.tensor([0.7]), torch.tensor([5]), torch.tensor([1.0]))[0].double()
    counts = torch.bincount(out, minlength=vocab).double()
    keep = p * n >= 5                               # (top-k 5 gives one id no mass: it must never come)
    assert counts[~keep].sum() == 0
    stat = float(((counts[keep] - p[keep] * n) ** 2 / (p[keep] * n)).sum())
    dof = int(keep.sum()) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))
    assert p_value > 1e-4, (stat, dof, p_value)
    q_full = torch.zeros(vocab).index_put_((head.targets,), q_draft)
    rejected = out != guesses
    assert 0 < rejected.float().mean() < 1 and bool((out[rejected] != guesses[rejected]).all())
    assert float(1 - rejected.double().mean()) == pytest.approx(float(torch.minimum(p, q_full.double()).sum()), abs=0.01)
    seeded = [head.reject(logits, batch(True), torch.full((n,), -1), checks) for _ in range(2)]
    assert torch.equal(seeded[0], seeded[1])


def test_deterministic_mode_with_guesses_gives_its_plain_tokens(tmp_path):
    """--deterministic computes a verified row as a decoded one: the same bits, so the same tokens
    on any device (on a GPU without it, bf16 near-ties may flip)."""
    from baton.models.source import resolve_model
    tokenizer_dir = os.environ.get("BATON_TOKENIZER") or resolve_model(None).tokenizer_path
    path = str(save_tiny_checkpoint("qwen3", tmp_path / "q", tokenizer_dir))
    g = torch.Generator().manual_seed(6)
    motif = torch.randint(3, 49152, (5,), generator=g).tolist()
    prompts = [motif * 5, motif * 3 + [7]]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    common = dict(device=DEVICE, num_kv_blocks=64, deterministic=True)
    want = [o.token_ids for o in LLM(path, **common).generate(prompts, params)]
    llm = LLM(path, **common, **SPEC)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.speculator.stats.accepted > 0


def test_a_request_with_logprobs_beside_one_that_guesses_keeps_its_records(embedded_llm, spec_llm, copy_prompts):
    """Requests with logprobs decode a token a step; in a step where another verifies guesses they
    still get one record per token, the plain run's."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with_lp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = [copy_prompts[2], copy_prompts[2]]
    want = embedded_llm.generate(prompts, [greedy, with_lp])
    before = spec_llm.engine.speculator.stats.accepted
    got = spec_llm.generate(prompts, [greedy, with_lp])
    assert spec_llm.engine.speculator.stats.accepted > before
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [(e.token_id, round(e.logprob, 4)) for e in got[1].logprobs] == \
        [(e.token_id, round(e.logprob, 4)) for e in want[1].logprobs]


def test_stops_inside_the_guesses_end_where_plain_decoding_ends(embedded_llm, spec_llm, copy_prompts):
    """max_tokens, a stop token and a stop string met in the middle of kept guesses."""
    tok = embedded_llm.tokenizer
    plain = embedded_llm.generate(copy_prompts[2:], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    ids = plain.token_ids
    llm = spec_llm
    cases = [SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[ids[9]]),
             SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[tok.decode(ids[10:12]).strip()])]
    for params in cases:
        want = embedded_llm.generate(copy_prompts[2:], params)[0]
        got = llm.generate(copy_prompts[2:], params)[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_guesses_scheduled_ahead_stay_or_roll_back_and_void_the_steps_past_them():
    """advance(ahead=True) puts a verifying step's guesses in as tokens (unverified: not emitted, not
    cached), so the next step is scheduled before its tokens are back; resolving keeps them when all
    held, else rolls the sequence back to those that did and voids the steps scheduled past them."""
    from baton.engine.scheduling.block_manager import BlockManager
    from baton.engine.scheduling.scheduler import Scheduler, SchedulerConfig
    from baton.engine.scheduling.sequence import PENDING, Sequence
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(8, 64, 256), bm, {0})
    seq = Sequence("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=30, ignore_eos=True), 256)
    sched.add(seq)
    out = sched.schedule()
    sched.resolve(out, sched.advance(out, ahead=True), [9])                 # the prefill samples 9

    def launch(draft):
        seq.draft = list(draft)
        out = sched.schedule(preempt=False)
        return out, sched.advance(out, ahead=True)
    n = launch([6, 7, 8])
    assert seq.token_ids[5:] == [9, 6, 7, 8, PENDING] and seq.num_computed_tokens == 9
    n1 = launch([10, 11])                                                    # past it: as if all held
    assert seq.completion_token_ids == [9] and seq.num_unverified_tokens == 5 and seq.num_pending_tokens == 2
    sched.resolve_many(*n, [[6, 7, 8, 12]])                                 # all held: n1 stands
    assert seq.completion_token_ids == [9, 6, 7, 8, 12] and seq.num_unverified_tokens == 2
    n2 = launch([20])
    sched.resolve_many(*n1, [[10, 13]])                                     # 11 failed: roll back to 10, 13
    assert seq.token_ids[5:] == [9, 6, 7, 8, 12, 10, 13] and seq.num_computed_tokens == seq.num_tokens - 1
    assert (seq.num_pending_tokens, seq.num_unverified_tokens, seq.spec_epoch) == (0, 0, 1)
    sched.resolve_many(*n2, [[20, 21]])                                     # void: nothing changes
    assert seq.token_ids[5:] == [9, 6, 7, 8, 12, 10, 13] and not seq.is_finished
    assert seq.num_hashed_blocks * 4 <= seq.num_known_tokens                 # only verified tokens cached
    n3 = launch([14, 15])                                                    # goes on from the rollback
    assert seq.token_ids[-4:] == [13, 14, 15, PENDING]
    sched.resolve_many(*n3, [[14, 15, 16]])
    assert seq.completion_token_ids[-4:] == [13, 14, 15, 16]
    sched.abort(seq)
    assert bm.num_free_blocks == 64
    seq = Sequence("b", [1, 2, 3], SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[7]), 256)
    sched.add(seq)
    out = sched.schedule()
    sched.resolve(out, sched.advance(out, ahead=True), [5])
    m = launch([6, 7, 8])
    m1 = launch([8, 8])
    sched.resolve_many(*m, [[6, 7, 8, 9]])                                  # a stop token inside held guesses
    assert seq.is_finished and seq.token_ids == [1, 2, 3, 5, 6, 7] and seq.num_known_tokens == 6
    sched.resolve_many(*m1, [[8, 8, 8]])                                    # past the stop: void
    assert seq.token_ids == [1, 2, 3, 5, 6, 7] and bm.num_free_blocks == 64


@pytest.fixture(scope="module")
def ahead_llm(embedded_llm):
    """Asynchronous scheduling, as on accelerators: the step after a verifying one is queued before its
    tokens are back, as if all its guesses held (the sequences that kept fewer roll back)."""
    return LLM(embedded_llm.engine.source.name, async_scheduling=True, **SPEC)


def test_scheduled_ahead_the_tokens_and_stops_are_plain_decodings(embedded_llm, ahead_llm, copy_prompts,
                                                                  plain_greedy):
    """A verifying step stays in flight while the next is queued past it, and its outputs are emitted
    after that, so a stop (string, token, EOS, max_tokens) found then ends a sequence that step already
    holds; sequences backing off decode a step ahead. Greedy and seeded tokens are plain decoding's."""
    llm = ahead_llm
    assert [o.token_ids for o in llm.generate(copy_prompts, GREEDY)] == plain_greedy
    stats = llm.engine.speculator.stats
    assert stats.ahead > 0 and stats.steps > 0 and stats.mean_accepted > 1.5, stats
    ids = plain_greedy[2]
    cases = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                            stop=[embedded_llm.tokenizer.decode(ids[10:12]).strip()]),
             SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[ids[9]]),
             SamplingParams(temperature=0, max_tokens=40)]                       # (ends at its EOS)
    for params in cases:
        want, got = embedded_llm.generate(copy_prompts[2:], params)[0], llm.generate(copy_prompts[2:], params)[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=3, max_tokens=16, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(copy_prompts[:2], seeded)] == \
        [o.token_ids for o in embedded_llm.generate(copy_prompts[:2], seeded)]
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_settling_a_step_that_is_back_before_guessing_past_it_gives_the_same_tokens(ahead_llm, copy_prompts,
                                                                                    plain_greedy, monkeypatch):
    """On a device a step whose tokens are back when the next is built is settled first (no void step);
    one still running is guessed past. Mixed in every order, the tokens are plain decoding's."""
    import itertools

    from baton.engine.runner.step import LaunchedStep
    back = itertools.cycle([True, False, False, True, True, False])
    monkeypatch.setattr(LaunchedStep, "ready", lambda self: next(back))
    stats = ahead_llm.engine.speculator.stats
    before = (stats.steps, stats.ahead)
    assert [o.token_ids for o in ahead_llm.generate(copy_prompts, GREEDY)] == plain_greedy
    assert stats.steps - before[0] > stats.ahead - before[1] > 0        # both ways taken
    assert ahead_llm.engine.block_manager.num_free_blocks == ahead_llm.engine.block_manager.num_blocks


def test_an_abort_while_guesses_are_scheduled_ahead_frees_its_blocks_once(ahead_llm, copy_prompts, plain_greedy):
    """Aborted while a step verifying its guesses as if they all held is in flight (the step before it
    settled): its blocks are freed once, the others' tokens are plain decoding's."""
    engine = ahead_llm.engine
    ids = [engine.add_request(p, GREEDY) for p in copy_prompts]
    tokens = {rid: [] for rid in ids}
    for _ in range(200):
        flight = engine.in_flight
        if flight is not None and ids[0] in engine.states and any(
                item.ahead and item.seq.request_id == ids[0] for item in flight.out.scheduled):
            engine.abort(ids[0])
        if not engine.has_unfinished and not engine.has_work:
            break
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
    assert ids[0] not in engine.states and len(tokens[ids[0]]) < GREEDY.max_tokens
    assert [tokens[rid] for rid in ids[1:]] == plain_greedy[1:]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_1p1d_and_after_a_migration_the_guessing_decode_worker_gives_the_plain_tokens(embedded_source, tmp_path,
                                                                                     method):
    """A decode worker with --speculative-method ngram (asynchronous scheduling on, as on accelerators)
    guesses from its first step on KV a prefill worker handed off (tiny-llama, CPU, the in-memory
    backend; n-gram guesses need only the tokens, so nothing more travels), and after a migration --
    the router's ledger resubmits the prompt and the tokens streamed so far -- it guesses again from
    those tokens: greedy tokens are plain decoding's (a request that opts out, on the same workers),
    token for token, every block back. (tiny-llama's random weights repeat the last token, so its
    guesses hold: this checks the hand-off, the seam and max_tokens inside kept guesses; the token
    parity of real text is the embedded model's, above.)

    eagle3: both workers run the head; the prefill worker's pass over the prompt writes the head's KV
    into the prompt's blocks (one more cache layer), which travel as they are, and its last state rides
    with the first token: the decode worker drafts at its first step, for the first request and for
    the migrated one (the head guesses "the target's token again", a draft vocabulary with decoys)."""
    import asyncio
    import dataclasses

    from test_kv_handoff import core, idle, workers

    from baton.engine.requests.tokenizer import load_tokenizer
    from baton.router.migration import Ledger
    from baton.serving.wire import sampling_to_proto
    from baton.v1 import decode_pb2, prefill_pb2
    prompt = list(range(2000, 2007)) * 5
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    async def pd(prefill, decode, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
        admitted = await decode.admit(decode_pb2.AdmitRequest(request_id=rid, prompt_token_ids=prompt,
                                                              sampling=sampling_to_proto(params), timeout_ms=20_000))

        async def collect():
            return [t async for chunk in decode.stream(rid, 20_000) for t in chunk.token_ids]
        stream = asyncio.ensure_future(collect())
        try:
            await prefill.prefill(prefill_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt,
                                                             sampling=sampling_to_proto(params),
                                                             handoff=prefill_pb2.Handoff(
                decode_address=admitted.kv_address, transfer_id=admitted.transfer_id, backend=admitted.backend)))
            return await asyncio.wait_for(stream, 30)
        finally:
            stream.cancel()

    head_args: tuple[str, ...] = ()
    if method == "eagle3":
        from baton.models.presets import PRESETS
        target = LLM("tiny-llama", num_kv_blocks=8).engine.runner.model.lm_head.weight
        head = save_tiny_eagle3_head(tmp_path / "head", PRESETS["tiny-llama"], [*range(3, 40), *prompt], mimic=target)
        head_args = ("--speculative-method", "eagle3", "--speculative-model", str(head))
    first_draft: dict[str, tuple[int, torch.Tensor]] = {}   # request -> (its output tokens, the head's KV
    #                                                         of its prompt) when the head first drafted for it

    def spy(runner):
        drafts = runner.drafts
        draft, cache = drafts.draft, runner.kv_cache[-1]               # the head's cache layer

        def recording(seqs, counts):
            for seq in seqs:
                kv = cache[:, seq.block_table].flatten(1, 2)[:, :len(prompt)].clone()
                first_draft.setdefault(seq.request_id, (seq.num_completion_tokens, kv))
            return draft(seqs, counts)
        drafts.draft = recording

    async def main():
        async with workers(prefill_args=head_args,
                           decode_args=(head_args or ("--speculative-method", "ngram")) + ("--async-scheduling",)) \
                as (prefill, decode):
            if method == "eagle3":
                spy(core(decode).llm.runner)
            want = await pd(prefill, decode, "plain", prompt, dataclasses.replace(params, speculative=False))
            before = core(decode).stats().spec_verified
            first = await pd(prefill, decode, "a", prompt, params)
            seam = 9                                   # the worker "died" after streaming 9 tokens
            ledger = Ledger(prompt, params, load_tokenizer(embedded_source), limit=1)
            for t in first[:seam]:
                ledger.relay("a", decode_pb2.TokenChunk(token_ids=[t]))
            ledger.migrate()
            resumed, rest = ledger.request()
            second = await pd(prefill, decode, "b", resumed, rest)
            await idle(prefill, decode)
            assert core(decode).stats().spec_verified > before
            nonlocal accepted
            accepted = core(decode).stats().spec_accepted_tokens
            return want, first, first[:seam] + second
    accepted = 0
    want, first, migrated = asyncio.run(main())
    assert len(want) == 24 and first == want and migrated == want
    if method == "eagle3":       # from the first step: only the prefill worker's token before (b: its prompt
        assert {rid: n for rid, (n, _) in first_draft.items()} == {"a": 1, "b": 1}     # is a's + 9 tokens)
        assert accepted > 0
        # the head's KV the decode worker drafted over is the prompt's, as one engine computes it alone
        offline = LLM("tiny-llama", num_kv_blocks=32, max_num_batched_tokens=16, speculative_method="eagle3",
                      speculative_model=str(head))
        spy(offline.engine.runner)
        offline.generate([prompt], params)
        local = first_draft["req-0"][1]
        assert local.abs().amax() > 0 and torch.allclose(first_draft["a"][1], local, atol=1e-6)


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_unseeded_sampling_keeps_the_target_distribution(tmp_path, method):
    """Three sampled tokens after a prompt that repeats itself (the first is sampled by the prefill,
    the next two by a step verifying an n-gram guess, or guesses an EAGLE-3 head drew from its q over
    a draft vocabulary of 4 of the 6 ids: rejection sampling): their joint frequencies over 4000 runs
    against p(t1) p(t2 | t1) p(t3 | t1 t2) from transformers, by chi-square with the rare cells
    pooled (expected counts >= 5). False-failure rate: the threshold is p < 1e-4."""
    from transformers import AutoModelForCausalLM

    from baton.models.source import resolve_model
    vocab = 6
    tokenizer_dir = os.environ.get("BATON_TOKENIZER") or resolve_model(None).tokenizer_path
    path = save_tiny_checkpoint("qwen3", tmp_path / "v6", tokenizer_dir, vocab_size=vocab, bos_token_id=0,
                                eos_token_id=1)
    prompt = [2, 3, 4, 5, 2, 3, 4, 5, 2, 3, 4]        # whatever comes next, a guess is found
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def probs(ids):
        with torch.no_grad():
            return torch.softmax(hf(torch.tensor([ids])).logits[0, -1].double(), -1)

    joint = torch.zeros(vocab, vocab, vocab, dtype=torch.float64)
    p1 = probs(prompt)
    for a in range(vocab):
        p2 = probs(prompt + [a])
        for b in range(vocab):
            joint[a, b] = p1[a] * p2[b] * probs(prompt + [a, b])
    n = 4000
    spec = SPEC if method == "ngram" else dict(
        speculative_method="eagle3", num_speculative_tokens=2, speculative_model=str(save_tiny_eagle3_head(
            tmp_path / "head", tiny_hf_config("qwen3", vocab_size=vocab), [0, 2, 3, 5], std=0.3)))
    llm = LLM(str(path), num_kv_blocks=2048, max_num_seqs=n, speculative_max_batch=n, **spec)
    outs = llm.generate([prompt] * n, SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True))
    assert llm.engine.speculator.stats.accepted > 100, llm.engine.speculator.stats
    counts = torch.zeros(vocab ** 3, dtype=torch.float64)
    for o in outs:
        a, b, c = o.token_ids
        counts[(a * vocab + b) * vocab + c] += 1
    expected = joint.flatten() * n
    keep = expected >= 5                                  # the rare cells pooled into one
    obs = torch.cat([counts[keep], counts[~keep].sum().reshape(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().reshape(1)])
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))
    assert p_value > 1e-4, (stat, dof, p_value)


def test_decode_graphs_cover_the_rows_of_a_verifying_step():
    """A verifying step is a decode step of a row per token: the graphs go up to the speculating batch
    times its guesses + 1 rows, not just --max-num-seqs (a small one would run every verifying step
    eager); and 256 rows past --max-num-seqs for steps with short prompt chunks (within the token
    budget; none under --deterministic). Each sequence guesses k while k x the batch fits GUESS_ROWS
    (128), fewer beyond, at least one."""
    from baton.engine.config import EngineConfig
    from baton.engine.runner.graph_runner import graph_rows
    from baton.engine.speculation.speculative import guesses_each
    assert [guesses_each(n, 8) for n in (1, 16, 17, 32, 64, 128, 256)] == [8, 8, 7, 4, 2, 1, 1]
    # k unset: 16 for n-gram lookup, 4 for a draft head (a pass of the head a guess)
    assert EngineConfig(speculative_method="ngram").speculative_tokens == 16
    assert EngineConfig(speculative_method="eagle3", speculative_model="head").speculative_tokens == 4
    assert graph_rows(EngineConfig(max_num_seqs=16, deterministic=True)) == 16
    assert graph_rows(EngineConfig(max_num_seqs=16, max_num_batched_tokens=64)) == 64
    assert graph_rows(EngineConfig(max_num_seqs=16)) == 272
    assert graph_rows(EngineConfig(max_num_seqs=16, max_num_batched_tokens=64, **SPEC)) == 80
    assert graph_rows(EngineConfig(max_num_seqs=512, speculative_max_batch=32, **SPEC)) == 768
    # 64 sequences guess 2 each (128 // 64): 192 rows, more than the 128 of the token budget
    assert graph_rows(EngineConfig(max_num_seqs=64, speculative_max_batch=96, max_num_batched_tokens=128,
                                   **SPEC)) == 192


def test_worker_metrics_count_guesses_from_the_cores_totals():
    """The front turns the engine core's running totals into Prometheus counters and the histogram of
    tokens per verified step (by their growth)."""
    from prometheus_client import generate_latest

    from baton.serving.metrics import Metrics
    m = Metrics("decode")
    m.observe_engine(1, 0, 10, 5, (8, 5, 2), (1, 0, 0, 0, 1))      # one step kept no guess, one kept 4
    m.observe_engine(1, 0, 10, 5, (8, 5, 2), (1, 0, 0, 0, 1))      # no new step: no change
    m.observe_engine(1, 0, 10, 5, (12, 6, 3), (1, 1, 0, 0, 1))     # one more, which kept 1
    text = generate_latest(m.registry).decode()
    assert "baton_spec_draft_tokens_total 12.0" in text
    assert "baton_spec_accepted_tokens_total 6.0" in text
    assert "baton_spec_verified_sequences_total 3.0" in text
    assert "baton_spec_acceptance_length_count 3.0" in text and "baton_spec_acceptance_length_sum 8.0" in text
    assert 'baton_spec_acceptance_length_bucket{le="2.0"} 2.0' in text


def test_the_engine_core_reports_its_speculation_totals(spec_llm):
    from baton.serving.worker.engine_core import EngineCore
    core = EngineCore.__new__(EngineCore)              # only what stats() reads
    core.engine = spec_llm.engine
    stats = core.stats()
    spec = spec_llm.engine.speculator.stats
    assert (stats.spec_draft_tokens, stats.spec_accepted_tokens, stats.spec_verified) == \
        (spec.proposed, spec.accepted, sum(spec.accepted_lengths))
    assert stats.spec_accepted_lengths == tuple(spec.accepted_lengths)


def test_the_per_request_opt_out_travels_the_openai_api_and_the_wire():
    """`speculative: false` (OpenAI body, or baton.v1 sampling.speculative) reaches the engine's
    SamplingParams on every worker; unset means true; anything but a boolean is a 400."""
    from baton.router.openai.errors import HTTPError
    from baton.router.openai.sampling import sampling
    from baton.serving.wire import sampling_from_proto, sampling_to_proto
    from baton.v1 import router_pb2
    proto, _ = sampling({"speculative": False}, chat=True)
    assert sampling_from_proto(proto).speculative is False
    assert sampling_from_proto(router_pb2.SamplingParams()).speculative is True
    assert sampling_from_proto(sampling_to_proto(SamplingParams(speculative=False))).speculative is False
    with pytest.raises(HTTPError, match="speculative"):
        sampling({"speculative": "no"}, chat=True)


def test_a_request_that_opts_out_is_never_given_guesses(spec_llm, copy_prompts):
    before = spec_llm.engine.speculator.stats.proposed
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, speculative=False)
    plain = spec_llm.generate(copy_prompts[:1], params)[0].token_ids
    assert spec_llm.engine.speculator.stats.proposed == before and len(plain) == 12
