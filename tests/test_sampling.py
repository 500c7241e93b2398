"""Sampling and streaming semantics on the embedded model: seeds, top-k/top-p, stops, UTF-8."""
from __future__ import annotations

import pytest
import torch

from baton.engine import SamplingParams
from baton.engine.runner.sampler import hashed_uniform


def test_same_seed_same_tokens_whatever_the_batch(embedded_llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = embedded_llm.generate(["Tell me a story"], p)[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = embedded_llm.generate(["Something else", "Tell me a story", "More"], [others, p, others])
    assert batch[1].token_ids == alone
    different = embedded_llm.generate(["Tell me a story"], SamplingParams(
        temperature=1.0, top_p=0.9, seed=4321, max_tokens=16, ignore_eos=True))[0].token_ids
    assert different != alone


def test_n_samples_of_a_prompt_are_seeded_requests_of_their_own(embedded_llm):
    """vLLM's `n` offline: `outputs` holds n samples, the first the request as sent, each other one
    the request with a seed derived from the prompt's (the OpenAI API's `n` derives them alike), so
    they differ yet repeat; a bad `n` is refused before anything is queued."""
    from baton.engine.requests.sampling_params import sample_seed
    p = SamplingParams(temperature=0.9, max_tokens=10, seed=11, n=3, ignore_eos=True)
    first, other = embedded_llm.generate(["Tell me a story", "Name a colour"], p)
    assert [s.index for s in first.outputs] == [0, 1, 2] and len(other.outputs) == 3
    assert len({tuple(s.token_ids) for s in first.outputs}) == 3                   # they differ
    for j, sample in enumerate(first.outputs):
        alone = SamplingParams(temperature=0.9, max_tokens=10, seed=sample_seed(11, j), ignore_eos=True)
        assert sample.token_ids == embedded_llm.generate("Tell me a story", alone)[0].token_ids
        assert sample.prompt_token_ids == first.prompt_token_ids and sample.finish_reason == "length"
    greedy = embedded_llm.generate("Hi", SamplingParams(temperature=0, max_tokens=6, n=2))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    free = embedded_llm.engine.block_manager.num_free_blocks
    for bad in (0, 129, 2.0):
        with pytest.raises(ValueError, match="n must be an integer in"):
            embedded_llm.generate("Hi", SamplingParams(n=bad))
    assert embedded_llm.engine.block_manager.num_free_blocks == free and not embedded_llm.engine.has_unfinished


def test_top_k_one_is_greedy(embedded_llm):
    greedy = embedded_llm.generate(["The weather today"], SamplingParams(temperature=0, max_tokens=12))
    topk1 = embedded_llm.generate(["The weather today"], SamplingParams(temperature=0.8, top_k=1, max_tokens=12,
                                                                       seed=5))
    assert greedy[0].token_ids == topk1[0].token_ids


def test_hashed_uniform_is_uniform_and_position_dependent():
    u = hashed_uniform(torch.tensor([7, 7]), torch.tensor([0, 1]), 50_000)
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01
    assert not torch.equal(u[0], u[1])


def test_hashed_uniform_never_reaches_one():
    """The largest hash rounds to 1 - 2^-24, not 1.0 (whose noise, -log 1 = 0, would make its token win
    every draw: seeded sampling then emitted a token regardless of its probability, and under a
    structured-output mask one the grammar forbids, ~0.3 % of rows a step on a 49k vocabulary)."""
    u = hashed_uniform(torch.tensor([15]), torch.tensor([50]), 49_152)     # token 19504's hash is the largest
    assert 0.0 < u.min().item() and u[0, 19504].item() == u.max().item() < 1.0
    assert (-torch.log(u)).min().item() > 0.0


def test_stop_string_is_cut_from_text_and_ends_with_stop(embedded_llm):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base = embedded_llm.generate(["1, 2, 3, 4,"], params)[0]
    assert " 7" in base.text
    cut = embedded_llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                              stop=[" 7"]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == base.text[:base.text.index(" 7")]


def test_stop_token_ids_and_max_tokens(embedded_llm):
    base = embedded_llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 10
    stop_at = base.token_ids[3]
    cut = embedded_llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                              stop_token_ids=[stop_at]))[0]
    assert cut.finish_reason == "stop"
    assert cut.token_ids == base.token_ids[:base.token_ids.index(stop_at) + 1]


def test_streamed_text_is_whole_utf8_and_sums_to_full_text(embedded_llm):
    engine = embedded_llm.engine
    tok = embedded_llm.tokenizer
    ids = tok("Emoji and 日本語: 🎉🚀", add_special_tokens=False)["input_ids"]
    # feed the prompt's own tokens as "generated" ones to force characters split across tokens
    from baton.engine.requests.detokenizer import make_detokenizer
    d = make_detokenizer(tok, [])
    deltas = [d.add(t) for t in ids] + [d.flush()]
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) == tok.decode(ids)
    engine.stream_text = True               # what the services do (LLM itself decodes once at the end)
    try:
        rid = engine.add_request("Say something in Japanese:", SamplingParams(temperature=0, max_tokens=24))
    finally:
        engine.stream_text = False
    text, tokens = "", []
    while engine.has_unfinished:
        for out in engine.step():
            assert out.request_id == rid
            text += out.new_text
            tokens += out.new_token_ids
    assert text == tok.decode(tokens, skip_special_tokens=True)
