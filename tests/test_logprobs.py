"""Logprobs: of each sampled token (with its top N) and of the prompt's tokens (`echo`), offline,
over gRPC and over the OpenAI API (whole and streamed) through router + prefill + decode; every
value equals the log-softmax of transformers' logits on the embedded model (the first token's
is computed on the prefill worker, the prompt's over its prefill chunks, the rest on decode)."""
from __future__ import annotations

import math

import grpc
import openai
import pytest
import torch

from baton.engine import SamplingParams
from baton.engine.requests.tokenizer import encode_text, render_chat
from baton.v1 import router_pb2, router_pb2_grpc

MODEL = "smollm2-135m-instruct"
PROMPT = ("The capital of France is Paris, the capital of Germany is Berlin, the capital of Spain is Madrid, "
          "and the capital of Italy is")        # 3 of the PD prefill worker's 16-token chunks: each chunk scored
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOL = 2e-3


@pytest.fixture(scope="module")
def reference(hf_embedded):
    """ids -> [len(ids), vocab] log-softmax of transformers' logits (row i predicts token i + 1)."""
    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf_embedded(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return logprobs


@pytest.fixture(scope="module")
def client(pd_cluster):
    return openai.OpenAI(base_url=pd_cluster.http_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def stub(pd_cluster):
    return router_pb2_grpc.RouterStub(grpc.insecure_channel(pd_cluster.router.address))


def close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL


def check_top(ref_row: torch.Tensor, top: list[tuple[int, float]], n: int) -> None:
    values, ids = ref_row.topk(n)
    assert [round(v, 3) for _, v in top] == pytest.approx([round(v, 3) for v in values.tolist()], abs=TOL)
    assert {t for t, _ in top} == set(ids.tolist()) or len(set(values.tolist())) < n    # (ties may swap)


def test_offline_logprobs_equal_transformers(embedded_llm, reference):
    ids = encode_text(embedded_llm.tokenizer, PROMPT)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=6, logprobs=3, prompt_logprobs=2,
                            repetition_penalty=1.3, ignore_eos=True)     # raw logprobs: before the penalty
    out = embedded_llm.generate([ids], params)[0]
    ref = reference(ids + out.token_ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for i in range(1, len(ids)):
        e = out.prompt_logprobs[i]
        assert e.token_id == ids[i] and close(e.logprob, ref[i - 1, ids[i]].item())
        check_top(ref[i - 1], e.top, 2)
    for k, (t, e) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert e.token_id == t and close(e.logprob, ref[len(ids) + k - 1, t].item())
        check_top(ref[len(ids) + k - 1], e.top, 3)
    assert embedded_llm.generate([ids], SamplingParams(temperature=0, max_tokens=2))[0].logprobs is None


def test_grpc_logprobs_equal_transformers(stub, embedded_llm, reference):
    ids = encode_text(embedded_llm.tokenizer, PROMPT)
    tokens, logprobs, prompt = [], [], []
    for r in stub.Generate(router_pb2.GenerateRequest(tokens=router_pb2.TokenIds(ids=ids), sampling=router_pb2.SamplingParams(
            temperature=0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=1)), timeout=60):
        tokens += r.token_ids
        logprobs += r.logprobs
        prompt += r.prompt_logprobs
    ref = reference(ids + tokens)
    assert [p.token_id for p in prompt] == ids[1:] and [e.token_id for e in logprobs] == tokens
    for i, p in enumerate(prompt):
        assert close(p.logprob, ref[i, ids[i + 1]].item()) and len(p.top) == 1
    for k, e in enumerate(logprobs):
        assert close(e.logprob, ref[len(ids) + k - 1, e.token_id].item())
        assert e.top[0].token_id == e.token_id and len(e.top) == 2        # greedy: the top one


def test_completions_logprobs_with_echo_whole_and_streamed(client, embedded_llm, reference):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, echo=True)
    choice = r.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT) and "".join(lp.tokens) == choice.text
    ids = encode_text(embedded_llm.tokenizer, PROMPT)
    tok = embedded_llm.tokenizer
    all_ids = ids + tok(choice.text[len(PROMPT):], add_special_tokens=False)["input_ids"]
    assert len(lp.tokens) == len(ids) + 6
    ref = reference(all_ids[:len(lp.tokens)])
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(lp.tokens)):
        assert close(lp.token_logprobs[i], ref[i - 1].max().item() if i >= len(ids) else ref[i - 1, ids[i]].item())
        assert len(lp.top_logprobs[i]) <= 3 and max(lp.top_logprobs[i].values()) == pytest.approx(
            ref[i - 1].max().item(), abs=TOL)
        assert lp.top_logprobs[i][lp.tokens[i]] == lp.token_logprobs[i]     # the chosen token among them (2 + 1)
    assert lp.text_offset[:3] == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2,
                                              echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    values = [v for c in streamed if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert values[0] is None and values[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)
    offsets = [v for c in streamed if c.choices[0].logprobs for v in c.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset


def test_echo_with_max_tokens_zero_scores_the_prompt_alone(client, reference, embedded_llm):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, logprobs=0, echo=True)
    ids = encode_text(embedded_llm.tokenizer, PROMPT)
    ref = reference(ids)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == PROMPT and r.usage.completion_tokens == 0 and len(lp.tokens) == len(ids)
    assert lp.top_logprobs[1] == {lp.tokens[1]: lp.token_logprobs[1]}    # logprobs=0: the chosen token's alone
    total = sum(lp.token_logprobs[1:])              # what lm-eval's loglikelihood adds up
    assert math.isclose(total, sum(ref[i - 1, ids[i]].item() for i in range(1, len(ids))), abs_tol=len(ids) * TOL)
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, logprobs=0, echo=True,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == PROMPT
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True)     # no logprobs asked
    assert plain.choices[0].text == PROMPT and plain.choices[0].logprobs is None


def test_chat_logprobs_and_top_logprobs_whole_and_streamed(client, embedded_llm, reference):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert "".join(c.token for c in content) == r.choices[0].message.content or r.choices[0].finish_reason == "stop"
    ids = render_chat(embedded_llm.tokenizer, QUESTION)
    out = embedded_llm.generate([ids], SamplingParams(temperature=0, max_tokens=8))[0].token_ids
    ref = reference(ids + out)
    assert len(content) == len(out)
    for k, c in enumerate(content):
        assert close(c.logprob, ref[len(ids) + k - 1, out[k]].item()) and len(c.top_logprobs) == 3
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-6)     # greedy
        assert c.bytes == list(c.token.encode())
    streamed = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0,
                                                   logprobs=True, top_logprobs=3, stream=True))
    got = [c for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
           for c in chunk.choices[0].logprobs.content]
    assert [c.logprob for c in got] == pytest.approx([c.logprob for c in content], abs=1e-6)
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
    assert plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, top_logprobs=2)
    assert err.value.body["param"] == "top_logprobs"


def test_a_colocated_worker_serves_the_same_logprobs_and_penalties(colocated_cluster, embedded_llm, stub):
    """One worker doing both roles (the session's colocated stack): no hand-off, the same values as the
    disaggregated stack's."""
    c = colocated_cluster
    colocated = router_pb2_grpc.RouterStub(grpc.insecure_channel(c.router.address))
    ids = encode_text(embedded_llm.tokenizer, PROMPT)
    request = router_pb2.GenerateRequest(tokens=router_pb2.TokenIds(ids=ids), sampling=router_pb2.SamplingParams(
        temperature=0.7, seed=9, max_tokens=6, ignore_eos=True, logprobs=1, prompt_logprobs=0,
        presence_penalty=1.0, min_p=0.05))

    def answer(router) -> tuple[list[int], list[float], list[float]]:
        tokens, logprobs, prompt = [], [], []
        for r in router.Generate(request, timeout=60):
            tokens += r.token_ids
            logprobs += [e.logprob for e in r.logprobs]
            prompt += [e.logprob for e in r.prompt_logprobs]
        return tokens, logprobs, prompt
    here, there = answer(colocated), answer(stub)
    assert here[0] == there[0] and len(here[2]) == len(ids) - 1
    assert here[1] == pytest.approx(there[1], abs=TOL) and here[2] == pytest.approx(there[2], abs=TOL)
    offline = embedded_llm.generate([ids], SamplingParams(temperature=0.7, seed=9, max_tokens=6, ignore_eos=True,
                                                          presence_penalty=1.0, min_p=0.05))[0]
    assert offline.token_ids == here[0]
