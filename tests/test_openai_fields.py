"""No request field is silently ignored: every field of OpenAI's completions and chat schemas (as the
real `openai` package types them) and of vLLM's common extras is honoured or refused with a 400
naming it; the sampling fields that are honoured give, through router + prefill + decode, the
tokens the offline engine gives (the first token sampled on the prefill worker, the rest on the
decode worker)."""
from __future__ import annotations

import grpc
import httpx
import openai
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from baton.engine import SamplingParams
from baton.router.openai.fields import HONOURED, INFORMATIONAL, REFUSED
from baton.v1 import router_pb2, router_pb2_grpc

MODEL = "smollm2-135m-instruct"
CHAT = [{"role": "user", "content": "Name three fruits."}]
# vLLM's extra request fields (its protocol's CompletionRequest / ChatCompletionRequest), as of 2026
VLLM_EXTRAS = {
    "both": ["top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids", "include_stop_str_in_output",
             "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
             "truncate_prompt_tokens", "allowed_token_ids", "prompt_logprobs", "bad_words", "use_beam_search",
             "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
             "guided_whitespace_pattern", "structural_tag", "structured_outputs", "priority", "request_id",
             "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt",
             "kv_transfer_params", "vllm_xargs", "mm_processor_kwargs"],
    "completions": ["add_special_tokens", "response_format"],
    "chat": ["echo", "add_generation_prompt", "continue_final_message", "add_special_tokens", "documents",
             "chat_template", "chat_template_kwargs"],
}
SCHEMAS = {"completions": completion_create_params.CompletionCreateParamsBase,
           "chat": chat_create_params.CompletionCreateParamsBase}
# what people send to get what Baton does not do (yet): each a 400 naming it
REAL_REFUSALS = {
    "completions": {"best_of": 3, "suffix": "end", "use_beam_search": True, "prompt_logprobs": 1,
                    "guided_decoding_backend": "xgrammar", "guided_whitespace_pattern": " ",
                    "include_stop_str_in_output": True, "allowed_token_ids": [1, 2], "bad_words": ["no"]},
    "chat": {"reasoning_effort": "low", "echo": True, "store": True, "audio": {"voice": "alloy", "format": "mp3"},
             "modalities": ["text", "audio"], "add_generation_prompt": False, "reasoning_parser": "qwen3"},
}


def body(endpoint: str, **fields) -> dict:
    base = {"prompt": "Hi"} if endpoint == "completions" else {"messages": CHAT}
    return {"model": MODEL, "max_tokens": 2, **base, **fields}


def post(pd_cluster, endpoint: str, payload: dict) -> httpx.Response:
    path = "/completions" if endpoint == "completions" else "/chat/completions"
    return httpx.post(pd_cluster.http_url + path, json=payload, timeout=60)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_field_of_openais_schema_and_vllms_extras_has_a_verdict(endpoint):
    known = HONOURED[endpoint] | INFORMATIONAL[endpoint] | set(REFUSED[endpoint])
    fields = set(SCHEMAS[endpoint].__annotations__) | set(VLLM_EXTRAS["both"]) | set(VLLM_EXTRAS[endpoint])
    assert fields - known == set()
    assert not (HONOURED[endpoint] & set(REFUSED[endpoint])), "a field is both honoured and refused"


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_refused_field_is_a_400_naming_it(pd_cluster, endpoint):
    for name in REFUSED[endpoint]:
        value = REAL_REFUSALS[endpoint].get(name, 7)        # 7: no field's no-op value
        r = post(pd_cluster, endpoint, body(endpoint, **{name: value}))
        assert r.status_code == 400, (name, r.text)
        error = r.json()["error"]
        assert error["param"] == name and name in error["message"], (name, error)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_refused_fields_at_their_no_op_values_pass(pd_cluster, endpoint):
    noops = {name: values[-1] for name, values in REFUSED[endpoint].items()}
    r = post(pd_cluster, endpoint, body(endpoint, **noops, user="someone"))
    assert r.status_code == 200, r.text


def test_an_unknown_field_is_a_400_naming_it(pd_cluster):
    r = post(pd_cluster, "completions", body("completions", temprature=0.5))
    assert r.status_code == 400 and r.json()["error"]["param"] == "temprature"
    assert "unknown field 'temprature'" in r.json()["error"]["message"]


@pytest.mark.parametrize("fields, param", [
    ({"presence_penalty": 3}, "presence_penalty"), ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"), ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": [1]}, "logit_bias"), ({"repetition_penalty": "high"}, "repetition_penalty"),
    ({"stop_token_ids": [True]}, "stop_token_ids"), ({"stop_token_ids": [2**40]}, "stop_token_ids"),
    ({"stop_token_ids": [999999]}, "stop_token_ids"), ({"logprobs": 10**10}, "logprobs"),
    ({"prompt": [2**40]}, "prompt"), ({"prompt": [999999]}, "prompt"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),          # without stream: OpenAI's 400
    ({"stream": True, "stream_options": {"include_usage": "no"}}, "stream_options"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
])
def test_out_of_range_sampling_fields_are_400_naming_them(pd_cluster, fields, param):
    r = post(pd_cluster, "completions", body("completions", **fields))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]
    assert "out of range" not in r.json()["error"]["message"]      # (protobuf's words, naming no field)


def test_chat_logprob_bounds_name_the_field_sent_and_a_huge_top_k_is_off(pd_cluster):
    r = post(pd_cluster, "chat", body("chat", logprobs=True, top_logprobs=21))
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text
    assert "got 21" in r.json()["error"]["message"]
    r = post(pd_cluster, "completions", body("completions", logprobs=10**10))
    assert f"got {10**10}" in r.json()["error"]["message"]
    assert post(pd_cluster, "completions", body("completions", top_k=2**40)).status_code == 200   # as vLLM: all tokens


# -- honoured: served tokens == the offline engine's ---------------------------------------------------
PROMPT = "Write a list of fruits: apple, banana,"
SAMPLED = [
    dict(temperature=0, repetition_penalty=1.4),
    dict(temperature=0, presence_penalty=1.5, frequency_penalty=0.5),
    dict(temperature=0, logit_bias={"28": -100}),               # no commas
    dict(temperature=0.9, seed=11, min_p=0.1, frequency_penalty=1.0),
    dict(temperature=0.7, seed=3, repetition_penalty=1.2, top_k=20, top_p=0.9),
]


def engine_params(fields: dict, max_tokens: int) -> SamplingParams:
    fields = dict(fields)
    if "logit_bias" in fields:
        fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **fields)


@pytest.mark.parametrize("fields", SAMPLED)
def test_served_tokens_equal_the_offline_engines(pd_cluster, embedded_llm, fields):
    client = openai.OpenAI(base_url=pd_cluster.http_url, api_key="unused", max_retries=0, timeout=60)
    extra = {k: v for k, v in fields.items() if k not in ("temperature", "seed", "top_p", "presence_penalty",
                                                           "frequency_penalty", "logit_bias")}
    std = {k: v for k, v in fields.items() if k not in extra}
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, extra_body={"ignore_eos": True, **extra},
                                  **std)
    offline = embedded_llm.generate([PROMPT], engine_params(fields, 8))[0]
    assert r.choices[0].text == offline.text
    plain = embedded_llm.generate([PROMPT], SamplingParams(temperature=fields["temperature"], seed=fields.get("seed"),
                                                           max_tokens=8, ignore_eos=True))[0]
    assert offline.token_ids != plain.token_ids, "the field changes nothing here: the test proves nothing"


def test_min_tokens_holds_off_eos_over_grpc_and_bad_values_are_invalid_argument(pd_cluster):
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(pd_cluster.router.address))
    question = router_pb2.Chat(messages=[router_pb2.ChatMessage(role="user", content="What is the capital of France?")])

    def completion(**sampling) -> list[int]:
        ids = []
        for r in stub.Generate(router_pb2.GenerateRequest(chat=question, sampling=router_pb2.SamplingParams(
                temperature=0, max_tokens=40, **sampling)), timeout=60):
            ids += r.token_ids
        return ids
    short = completion()
    assert len(short) < 20
    assert len(completion(min_tokens=len(short) + 5)) >= len(short) + 5
    for bad, name in ((dict(min_p=2.0), "min_p"), (dict(prior_output_tokens=10_000), "prior_output_tokens"),
                      (dict(logprobs=21), "logprobs"), (dict(logit_bias={10**6: 1.0}), "logit_bias")):
        with pytest.raises(grpc.RpcError) as err:
            completion(**bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and name in err.value.details()


def test_min_tokens_holds_off_stop_strings_when_served(pd_cluster):
    def text(min_tokens: int) -> str:
        r = post(pd_cluster, "completions", {"model": MODEL, "prompt": "1, 2, 3, 4,", "max_tokens": 12, "stop": [","],
                                             "temperature": 0, "min_tokens": min_tokens})
        return r.json()["choices"][0]["text"]
    assert text(0) == " 5" and text(4) == " 5, 6"


def test_min_tokens_is_capped_by_the_context_as_max_tokens_is():
    from baton.router.validation import sampling
    req = router_pb2.GenerateRequest(text="x", sampling=router_pb2.SamplingParams(min_tokens=50))
    params = sampling(req, prompt_len=97, max_model_len=100, vocab_size=1000)
    assert params.max_tokens == params.min_tokens == 3


def test_the_first_token_sampled_on_the_prefill_worker_obeys_the_same_fields(pd_cluster):
    """The prefill worker samples token 1, the decode worker the rest: a bias holds for both, and a
    repetition penalty that counts token 1 (handed over with the KV) changes token 2 on decode."""
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(pd_cluster.router.address))

    def tokens(**sampling) -> list[int]:
        return [t for r in stub.Generate(router_pb2.GenerateRequest(text=PROMPT, sampling=router_pb2.SamplingParams(
            temperature=0, max_tokens=4, ignore_eos=True, **sampling)), timeout=60) for t in r.token_ids]
    assert tokens(logit_bias={1234: 100.0}) == [1234] * 4
    # two biased tokens; once the first is out (prefill), the penalty halves its logit (~100 -> ~50) and
    # the other (~60) wins on decode; once both are out, ~50 beats ~30 for good
    assert tokens(logit_bias={1234: 100.0, 4321: 60.0}, repetition_penalty=2.0) == [1234, 4321, 1234, 1234]


def test_priority_needs_the_priority_policy(pd_cluster):
    """`priority` is honoured (engine/scheduling/scheduling_policy.py); this fcfs deployment refuses all but 0,
    saying which flag would take it, and the refusal holds no block on any worker."""
    r = post(pd_cluster, "completions", body("completions", priority=3))
    assert r.status_code == 400 and "--scheduling-policy priority" in r.json()["error"]["message"], r.text
    assert post(pd_cluster, "completions", body("completions", priority=0)).status_code == 200
    pd_cluster.wait_blocks_free()
