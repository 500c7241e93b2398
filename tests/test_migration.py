"""The router's migration ledger, seam by seam: whatever token a worker dies after, the client
gets the fault-free tokens and text (half-sent UTF-8 characters, held-back text and stop
strings straddling the two workers included). The end-to-end cases, with real processes
killed under real streams, are in test_chaos.py."""
from __future__ import annotations

import pytest

from baton.engine.requests.detokenizer import make_detokenizer
from baton.engine.requests.sampling_params import SamplingParams
from baton.engine.requests.tokenizer import encode_text, load_tokenizer
from baton.router.migration import Ledger
from baton.v1 import decode_pb2, router_pb2

TEXT = " Zürich → 東京: 12 km. The end of it. And more."


@pytest.fixture(scope="module")
def tokenizer(embedded_source):
    return load_tokenizer(embedded_source)


def chunk(ids, text="", finish=router_pb2.FINISH_REASON_UNSPECIFIED, usage=None):
    c = decode_pb2.TokenChunk(token_ids=ids, text=text, finish_reason=finish)     # what a worker streams
    if usage is not None:
        c.usage.CopyFrom(usage)
    return c


def first_worker_chunks(tokenizer, prompt, ids, stop):
    """What a live worker streams for `ids`: its text held back as the engine holds it."""
    detok = make_detokenizer(tokenizer, prompt)
    holdback = max((len(s) for s in stop), default=1) - 1
    sent = 0
    for t in ids:
        detok.add(t)
        end = max(sent, len(detok.text) - holdback)
        yield chunk([t], detok.text[sent:end])
        sent = end


def run(tokenizer, prompt, ids, seam, stop=()):
    params = SamplingParams(temperature=0, max_tokens=len(ids), stop=list(stop), ignore_eos=True)
    ledger = Ledger(prompt, params, tokenizer, limit=3)
    out = []
    for c in list(first_worker_chunks(tokenizer, prompt, ids, stop))[:seam]:
        out.append(ledger.relay("r", c))
        if out[-1].finish_reason:
            return out, ledger
    ledger.migrate()
    resumed, rest = ledger.request()
    assert resumed == prompt + ids[:seam] and rest.max_tokens == len(ids) - seam
    for i, t in enumerate(ids[seam:]):        # the survivor's text is not what the client gets
        last = seam + i == len(ids) - 1
        out.append(ledger.relay("r", chunk([t], "\ufffdjunk", router_pb2.FINISH_REASON_LENGTH if last else 0,
                                           router_pb2.Usage(prompt_tokens=len(resumed), completion_tokens=i + 1)
                                           if last else None)))
        if out[-1].finish_reason:
            break
    return out, ledger


def test_any_seam_gives_the_fault_free_tokens_text_and_usage(tokenizer):
    prompt = encode_text(tokenizer, "Say it:")
    ids = encode_text(tokenizer, TEXT)
    full = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    for seam in range(1, len(ids)):
        out, ledger = run(tokenizer, prompt, ids, seam)
        assert [t for r in out for t in r.token_ids] == ids, seam
        assert "".join(r.text for r in out) == full, seam
        assert out[-1].finish_reason == router_pb2.FINISH_REASON_LENGTH
        assert (out[-1].usage.prompt_tokens, out[-1].usage.completion_tokens) == (len(prompt), len(ids))
        assert ledger.migrations == 1


def test_a_stop_string_across_the_seam_still_stops_the_stream(tokenizer):
    prompt = encode_text(tokenizer, "Say it:")
    ids = encode_text(tokenizer, TEXT)
    stop = "The end"
    upto = next(k for k in range(1, len(ids) + 1)
                if stop in tokenizer.decode(ids[:k], skip_special_tokens=True, clean_up_tokenization_spaces=False))
    for seam in range(1, upto):
        out, _ = run(tokenizer, prompt, ids, seam, stop=[stop])
        assert "".join(r.text for r in out) == " Zürich → 東京: 12 km. ", seam
        assert [t for r in out for t in r.token_ids] == ids[:upto], seam
        assert out[-1].finish_reason == router_pb2.FINISH_REASON_STOP


def test_the_migration_limit_and_a_spent_budget(tokenizer):
    params = SamplingParams(temperature=0, max_tokens=2)
    ledger = Ledger([1, 2], params, tokenizer, limit=1)
    assert ledger.why_not() is None
    ledger.relay("r", chunk([5]))
    ledger.relay("r", chunk([6]))
    ledger.migrate()
    assert "--max-migrations" in ledger.why_not()
    last = ledger.out_of_budget("r")       # every token was sent, only the finish was lost
    assert last.finish_reason == router_pb2.FINISH_REASON_LENGTH and last.usage.completion_tokens == 2
    assert "off" in Ledger([1], params, tokenizer, limit=0).why_not()


def test_logprobs_are_relayed_and_cut_with_the_tokens(tokenizer):
    ids = tokenizer(" one two three four", add_special_tokens=False)["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=len(ids), logprobs=1, prompt_logprobs=0, stop=[" three"],
                            ignore_eos=True)
    ledger = Ledger([1, 2, 3], params, tokenizer, limit=3)

    def with_logprobs(c, values, prompt=()):
        c.logprobs.extend(router_pb2.TokenLogprob(token_id=t, logprob=v) for t, v in zip(c.token_ids, values, strict=True))
        c.prompt_logprobs.extend(router_pb2.TokenLogprob(token_id=t, logprob=-1.0) for t in prompt)
        return c
    first = ledger.relay("r", with_logprobs(chunk(ids[:1], tokenizer.decode(ids[:1])), [-0.5], prompt=[2, 3]))
    assert [e.logprob for e in first.logprobs] == [-0.5] and [e.token_id for e in first.prompt_logprobs] == [2, 3]
    ledger.migrate()
    prompt, resumed = ledger.request()
    assert resumed.prompt_logprobs is None and resumed.logprobs == 1 and resumed.prior_output_tokens == 1
    rest = ledger.relay("r", with_logprobs(chunk(ids[1:], "junk"), [-0.25] * (len(ids) - 1)))
    assert rest.finish_reason == router_pb2.FINISH_REASON_STOP            # " three" ends it, across the seam
    assert len(rest.logprobs) == len(rest.token_ids) < len(ids) - 1 and not rest.prompt_logprobs


def test_min_tokens_holds_off_a_stop_string_across_the_seam(tokenizer):
    ids = tokenizer(" 5, 6, 7", add_special_tokens=False)["input_ids"]          # ' ', '5', ',', ' ', '6', ',', ...
    params = SamplingParams(temperature=0, max_tokens=len(ids), stop=[","], min_tokens=4, ignore_eos=True)
    ledger = Ledger([1], params, tokenizer, limit=1)
    sent = [ledger.relay("r", chunk(ids[:2], " 5"))]
    ledger.migrate()
    assert ledger.request()[1].min_tokens == 2
    for t in ids[2:]:
        sent.append(ledger.relay("r", chunk([t], "junk")))
        if sent[-1].finish_reason:
            break
    assert "".join(r.text for r in sent) == " 5, 6" and sent[-1].finish_reason == router_pb2.FINISH_REASON_STOP
