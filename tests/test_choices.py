"""n > 1 over the OpenAI API (router + prefill + decode): n choices per prompt in OpenAI's order,
each its own request; with a seed the choices differ from one another yet come back the same for
the same seed, choice 0 being the n=1 answer; streamed choices equal whole ones; a prompt counts
once in usage; a client that leaves frees every choice's blocks."""
from __future__ import annotations

import openai
import pytest

MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def client(pd_cluster):
    return openai.OpenAI(base_url=pd_cluster.http_url, api_key="unused", max_retries=0, timeout=60)


def test_seeded_choices_differ_and_repeat(client):
    kw = dict(model=MODEL, prompt="Once upon a time", temperature=1.0, max_tokens=8, seed=7,
              extra_body={"ignore_eos": True})
    r = client.completions.create(n=3, **kw)
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(texts)) == 3
    assert [c.text for c in client.completions.create(n=3, **kw).choices] == texts
    assert client.completions.create(**kw).choices[0].text == texts[0]
    single = client.completions.create(**kw).usage
    assert r.usage.prompt_tokens == single.prompt_tokens and r.usage.completion_tokens == 3 * 8


def test_several_prompts_times_n_in_openais_order(client):
    prompts = ["The capital of France is", "1, 2, 3,"]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, temperature=0, max_tokens=5)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts):
        alone = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=5).choices[0].text
        assert r.choices[2 * p].text == r.choices[2 * p + 1].text == alone     # greedy: n equal choices
    # streamed, as vLLM streams several prompts: each chunk names its choice, the texts join up to the whole ones
    texts, reasons, usage = {}, {}, None
    for chunk in client.completions.create(model=MODEL, prompt=prompts, n=2, temperature=0, max_tokens=5,
                                           stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
        usage = chunk.usage or usage
    assert texts == {c.index: c.text for c in r.choices} and set(reasons.values()) == {"length"}
    assert usage.prompt_tokens == r.usage.prompt_tokens and usage.completion_tokens == 4 * 5


def test_streamed_chat_choices_equal_the_whole_ones(client):
    kw = dict(model=MODEL, messages=QUESTION, temperature=0.9, max_tokens=10, seed=11, n=3)
    whole = client.chat.completions.create(**kw)
    texts = {c.index: "" for c in whole.choices}
    reasons, usage = {}, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_a_client_that_leaves_frees_every_choice(client, pd_cluster):
    start = pd_cluster.worker("decode-0").status()
    stream = client.completions.create(model=MODEL, prompt="Tell me a very long story.", max_tokens=3000, n=3,
                                       temperature=1.0, extra_body={"ignore_eos": True}, stream=True)
    seen = set()
    for chunk in stream:
        seen |= {c.index for c in chunk.choices}
        if seen == {0, 1, 2}:
            break
    assert pd_cluster.worker("decode-0").status().running == 3
    stream.close()
    assert pd_cluster.wait_workers_idle(15) == 0
    assert pd_cluster.worker("decode-0").status().kv_blocks_free == start.kv_blocks_free


def test_n_out_of_range_is_a_400(client):
    for n in (0, 129):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt="Hi", n=n, max_tokens=1)
        assert err.value.body["param"] == "n"


def test_a_failing_prompt_cancels_the_others_and_frees_their_blocks(client, pd_cluster):
    start = pd_cluster.worker("decode-0").status()
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[[1, 2, 3, 4], [10**7]], max_tokens=3000, n=2,
                                  extra_body={"ignore_eos": True})
    assert pd_cluster.wait_workers_idle(15) == 0
    assert pd_cluster.worker("decode-0").status().kv_blocks_free == start.kv_blocks_free
