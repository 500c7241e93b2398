"""Penalties, logit_bias, min_tokens and min_p (engine/runner/logits_processing.py): the same logits as
transformers' logits processors (or a plain loop, where transformers has none) on the same rows;
on the embedded model, greedy tokens equal transformers' generate() with the same processors, the
first token (prefill) and the later ones (decode) alike, with the asynchronous scheduler too."""
from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from baton.engine import SamplingParams
from baton.engine.runner.logits_processing import apply_logits_processing, host_inputs, to_device
from baton.engine.scheduling.sequence import PENDING, Sequence

VOCAB = 50
EOS = [0]


def seq(prompt: list[int], output: list[int], **params) -> Sequence:
    s = Sequence("r", prompt, SamplingParams(**params), 4096)
    s.token_ids += output
    return s


def process(seqs: list[Sequence], logits: torch.Tensor, temperatures=None, input_ids=None, starts=None):
    host = host_inputs(seqs, starts or [0] * len(seqs), EOS)
    proc = to_device([torch.from_numpy(a) for a in host.arrays()])
    temps = torch.tensor(temperatures or [1.0] * len(seqs))
    return apply_logits_processing(logits, proc, temps, input_ids if input_ids is not None else torch.zeros(1, dtype=torch.long))


def test_no_processing_builds_nothing():
    assert host_inputs([seq([1, 2], [3], temperature=0.7, top_k=5)], [0], EOS) is None


def test_repetition_penalty_is_transformers_over_prompt_and_output():
    torch.manual_seed(0)
    logits = torch.randn(2, VOCAB) * 3
    rows = [seq([5, 6, 7, 5], [8, 9], repetition_penalty=1.3), seq([1, 2], [2, 3, 40], repetition_penalty=0.7)]
    got = process(rows, logits)
    for i, r in enumerate(rows):
        ref = RepetitionPenaltyLogitsProcessor(r.params.repetition_penalty)(
            torch.tensor([r.token_ids]), logits[i:i + 1].clone())
        torch.testing.assert_close(got[i:i + 1], ref)


def test_presence_and_frequency_penalties_count_the_output_only():
    torch.manual_seed(1)
    logits = torch.randn(1, VOCAB)
    r = seq([4, 4, 4], [9, 9, 9, 11], presence_penalty=0.5, frequency_penalty=0.25)
    ref = logits.clone()
    for t in set(r.token_ids[3:]):
        ref[0, t] -= 0.5 + 0.25 * r.token_ids[3:].count(t)            # the prompt's 4 is untouched
    torch.testing.assert_close(process([r], logits), ref)


def test_a_resumed_request_counts_its_earlier_output_as_output():
    torch.manual_seed(2)
    logits = torch.randn(1, VOCAB)
    fresh = seq([4, 5], [9, 9, 12], frequency_penalty=1.0, repetition_penalty=1.2)
    resumed = seq([4, 5, 9, 9], [12], frequency_penalty=1.0, repetition_penalty=1.2, prior_output_tokens=2)
    torch.testing.assert_close(process([fresh], logits), process([resumed], logits))


def test_logit_bias_is_transformers_sequence_bias():
    torch.manual_seed(3)
    logits = torch.randn(1, VOCAB)
    bias = {3: 5.0, 17: -100.0, 49: 0.5}
    ref = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})(torch.tensor([[1, 2]]), logits.clone())
    torch.testing.assert_close(process([seq([1, 2], [], logit_bias=bias)], logits), ref)


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    torch.manual_seed(4)
    logits = torch.randn(3, VOCAB)
    rows = [seq([1, 2], [5], min_tokens=3, stop_token_ids=[7]),          # 1 of 3: masked
            seq([1, 2], [5, 6, 8], min_tokens=3, stop_token_ids=[7]),    # reached: not
            seq([1, 2], [5], min_tokens=3, ignore_eos=True)]             # eos does not stop it: not masked
    got = process(rows, logits)
    ref = MinNewTokensLengthLogitsProcessor(2, 3, [0, 7])(torch.tensor([[1, 2, 5]]), logits[:1].clone())
    torch.testing.assert_close(got[:1], ref)
    torch.testing.assert_close(got[1:], logits[1:])


def test_min_p_keeps_what_transformers_keeps_at_the_rows_temperature():
    torch.manual_seed(5)
    logits = torch.randn(3, VOCAB)
    rows = [seq([1], [], min_p=0.1), seq([1], [], min_p=0.3, temperature=0.5), seq([1], [], temperature=0.5)]
    got = process(rows, logits, temperatures=[1.0, 0.5, 0.5])
    for i, t in ((0, 1.0), (1, 0.5)):
        ref = MinPLogitsWarper(rows[i].params.min_p)(torch.tensor([[1]]), logits[i:i + 1] / t)
        assert torch.equal(torch.isinf(got[i:i + 1]), torch.isinf(ref))
        assert 1 < int(torch.isfinite(ref).sum()) < VOCAB                # the test means something
    torch.testing.assert_close(got[2], logits[2])


def test_rows_that_use_nothing_are_untouched_beside_rows_that_do():
    torch.manual_seed(6)
    logits = torch.randn(2, VOCAB, dtype=torch.bfloat16)
    got = process([seq([1, 2], [3]), seq([1, 2], [3], repetition_penalty=2.0)], logits)
    assert torch.equal(got[0], logits[0].float())
    assert not torch.equal(got[1], logits[1].float())


def test_a_pending_token_is_read_from_the_steps_inputs():
    """Asynchronous scheduling: the last sampled token is still on the device when the next step's
    inputs are built; its history entry points at the step's input that holds it."""
    torch.manual_seed(7)
    logits = torch.randn(1, VOCAB)
    known = seq([4, 5], [9, 13], frequency_penalty=1.5)
    pending = seq([4, 5], [9, PENDING], frequency_penalty=1.5)
    pending.num_pending_tokens = 1
    pending.num_computed_tokens = 3                     # this step feeds token 3 (the pending one)...
    inputs = torch.tensor([21, 22, 13])                 # ...at input position 2 (after another row's two)
    got = process([pending], logits, input_ids=inputs, starts=[2 - 3])
    torch.testing.assert_close(got, process([known], logits))


# -- on the embedded model --------------------------------------------------------------------------
PROMPT = "Write a list of fruits: apple, banana,"


@pytest.mark.parametrize("params, hf", [
    (dict(repetition_penalty=1.5), dict(repetition_penalty=1.5)),
    (dict(min_tokens=10), dict(min_new_tokens=10)),
    (dict(logit_bias={28: 8.0}), dict(sequence_bias={(28,): 8.0})),
])
def test_greedy_tokens_equal_transformers_generate(embedded_llm, hf_embedded, params, hf):
    ids = embedded_llm.tokenizer(PROMPT)["input_ids"]
    out = embedded_llm.generate([ids], SamplingParams(temperature=0, max_tokens=12, **params))[0]
    with torch.no_grad():
        ref = hf_embedded.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12, num_beams=1,
                                   pad_token_id=embedded_llm.tokenizer.eos_token_id, **hf)[0, len(ids):].tolist()
    assert out.token_ids == ref


def test_penalised_sampling_is_the_same_with_the_asynchronous_scheduler(embedded_llm):
    params = [SamplingParams(temperature=0, max_tokens=8, frequency_penalty=1.0, presence_penalty=0.5),
              SamplingParams(temperature=0.8, seed=7, max_tokens=8, repetition_penalty=1.3, min_p=0.05),
              SamplingParams(temperature=0, max_tokens=8)]
    prompts = [PROMPT, "1, 2, 3,", "The quick brown fox"]
    sync = [o.token_ids for o in embedded_llm.generate(prompts, params)]
    engine = embedded_llm.engine
    engine.look_ahead = True                # step N+1 launched before step N's tokens are back
    try:
        assert [o.token_ids for o in embedded_llm.generate(prompts, params)] == sync
    finally:
        engine.look_ahead = False


def test_a_migrated_request_goes_on_as_if_never_moved(embedded_llm):
    """The router resumes a request elsewhere with prompt + output so far (router/migration.py): the
    penalties still count that output as output, so the survivor continues with the same tokens."""
    from baton.router.migration import Ledger
    ids = embedded_llm.tokenizer(PROMPT)["input_ids"]
    params = SamplingParams(temperature=0.9, seed=5, max_tokens=10, min_tokens=8, frequency_penalty=1.2,
                            presence_penalty=0.4, repetition_penalty=1.1, ignore_eos=True)
    whole = embedded_llm.generate([ids], params)[0].token_ids
    ledger = Ledger(ids, params, None, limit=1)
    ledger.tokens = whole[:4]
    prompt, resumed = ledger.request()
    assert resumed.prior_output_tokens == 4 and resumed.min_tokens == 4 and resumed.max_tokens == 6
    assert embedded_llm.generate([prompt], resumed)[0].token_ids == whole[4:]


def test_no_stop_string_ends_the_text_before_min_tokens(embedded_llm):
    """As vLLM: min_tokens holds off stop strings too (" 5, 6," comes as ' ', '5', ',', ' ', '6', ',')."""
    def text(min_tokens: int) -> str:
        return embedded_llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=12, stop=[","],
                                                                     min_tokens=min_tokens))[0].text
    assert text(0) == text(3) == " 5"            # the comma is the third token: it may stop
    assert text(4) == " 5, 6"                    # the first comma is too early: the next one stops


def test_sampling_params_take_vllms_spellings_of_none_and_one_stop_string(embedded_llm):
    """stop / stop_token_ids / logit_bias of None mean none, and one stop string may come bare, as
    vLLM's SamplingParams takes them; the output is what the list spelling gives."""
    bare = SamplingParams(temperature=0, max_tokens=12, stop=" 5", stop_token_ids=None, logit_bias=None)
    assert (bare.stop, bare.stop_token_ids, bare.logit_bias) == ([" 5"], [], {})
    listed = SamplingParams(temperature=0, max_tokens=12, stop=[" 5"])
    nothing = SamplingParams(temperature=0, max_tokens=4, stop=None)
    got = embedded_llm.generate(["1, 2, 3,", "1, 2, 3,", "Hi"], [bare, listed, nothing])
    assert got[0].text == got[1].text and got[0].finish_reason == "stop", got[0]
    assert nothing.stop == [] and len(got[2].token_ids) == 4
