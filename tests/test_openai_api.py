"""The OpenAI-compatible API, driven by the real `openai` client against the shared stack
(router + prefill + decode processes), and the metrics every process records, checked by
value after known requests."""
from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request

import grpc
import httpx
import jsonschema
import openai
import pytest
from cluster import REPO
from prometheus_client.parser import text_string_to_metric_families

from baton.router.openai.errors import HTTPError, from_service_error
from baton.serving.grpc_server import ServiceError
from baton.v1 import router_pb2, router_pb2_grpc

MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(pd_cluster):
    return openai.OpenAI(base_url=pd_cluster.http_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def stub(pd_cluster):
    return router_pb2_grpc.RouterStub(grpc.insecure_channel(pd_cluster.router.address))


def grpc_text(stub, req) -> tuple[str, list[int]]:
    text, ids = "", []
    for r in stub.Generate(req, timeout=60):
        text += r.text
        ids += r.token_ids
    return text, ids


def test_models_lists_the_served_model(client, pd_cluster):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL                  # GET /v1/models/{model}
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4o")
    assert err.value.body["code"] == "model_not_found"
    with urllib.request.urlopen(pd_cluster.http_url.removesuffix("/v1") + "/health", timeout=10) as r:
        assert r.status == 200


def test_chat_answers_and_equals_the_grpc_answer(client, stub):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24)
    assert "Paris" in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    req = router_pb2.GenerateRequest(chat=router_pb2.Chat(messages=[router_pb2.ChatMessage(**QUESTION[0])]),
                                     sampling=router_pb2.SamplingParams(temperature=0, max_tokens=24))
    text, ids = grpc_text(stub, req)
    assert r.choices[0].message.content == text and r.usage.completion_tokens == len(ids)


def test_completions_equal_grpc_greedy_token_for_token(client, stub):
    for prompt in ("The quick brown fox", "def fibonacci(n):"):
        r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=20,
                                      extra_body={"ignore_eos": True})
        text, ids = grpc_text(stub, router_pb2.GenerateRequest(
            text=prompt, sampling=router_pb2.SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)))
        assert r.choices[0].text == text and r.usage.completion_tokens == len(ids) == 20
        assert r.choices[0].finish_reason == "length"
    r = client.completions.create(model=MODEL, prompt="Hello")          # OpenAI's default: 16 tokens
    assert r.usage.completion_tokens <= 16


def test_streaming_chat_with_usage_equals_the_whole_answer(client, pd_cluster):
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24)
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # on the wire: server-sent events ending with [DONE]
    with httpx.stream("POST", pd_cluster.http_url + "/completions", timeout=60,
                      json={"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 4, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"


def test_stop_strings_cut_the_text(client):
    full = client.completions.create(model=MODEL, prompt="1, 2, 3,", temperature=0, max_tokens=12).choices[0]
    assert " 5," in full.text
    cut = client.completions.create(model=MODEL, prompt="1, 2, 3,", temperature=0, max_tokens=12,
                                    stop=[" 5,"]).choices[0]
    assert cut.text == full.text[:full.text.index(" 5,")] and cut.finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt="1, 2, 3,", temperature=0, max_tokens=12,
                                         stop=" 5,", stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.text


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=MODEL, prompt="Once upon a time", temperature=0.9, max_tokens=12, seed=1234)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


@pytest.mark.parametrize("fields, param", [
    ({"temperature": -1}, None), ({"top_p": 1.5}, None), ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"), ({"logprobs": 21}, "logprobs"), ({"temperature": "hot"}, "temperature"),
    ({"stop": [1, 2]}, "stop"), ({"top_k": -5}, "top_k"), ({"prompt": ""}, None),
    ({"prompt": "word " * 5000}, None),                   # longer than the model's context
])
def test_invalid_parameters_are_400_in_openais_shape(client, fields, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="Hi", extra_body=fields)
    assert err.value.status_code == 400 and err.value.body["message"]
    assert err.value.body["type"] == "invalid_request_error"
    if param:
        assert err.value.body["param"] == param


def context_of(client) -> int:
    return client.models.list().data[0].model_extra["max_model_len"]


def token_count(pd_cluster, **body) -> int:
    return httpx.post(pd_cluster.http_url.removesuffix("/v1") + "/tokenize", json=body, timeout=30).json()["count"]


def test_max_tokens_past_the_context_is_a_400_naming_both_numbers(client, pd_cluster):
    context = context_of(client)
    n = token_count(pd_cluster, prompt="Hi")
    start = time.monotonic()
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=100000)
    assert time.monotonic() - start < 1.0                   # refused up front, nothing generated
    assert err.value.body["param"] == "max_tokens"
    assert err.value.body["message"] == (f"max_tokens 100000 is too large: the prompt has {n} tokens and the "
                                         f"model's context is {context}, so at most {context - n} can be generated")
    # a chat's max_completion_tokens; a token prompt one token short of the room it asks for
    m = token_count(pd_cluster, messages=QUESTION)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_completion_tokens=context)
    assert err.value.body["param"] == "max_completion_tokens" and f"at most {context - m} can" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=[1] * (context - 4), max_tokens=5)
    assert f"the prompt has {context - 4} tokens" in err.value.body["message"]


def test_grpc_still_caps_max_tokens_at_the_context(stub):
    """The proto documents max_tokens as capped by the context length: gRPC keeps that."""
    chunks = list(stub.Generate(router_pb2.GenerateRequest(
        chat=router_pb2.Chat(messages=[router_pb2.ChatMessage(**QUESTION[0])]),
        sampling=router_pb2.SamplingParams(temperature=0, max_tokens=100000)), timeout=60))
    assert chunks[-1].finish_reason == router_pb2.FINISH_REASON_STOP and "Paris" in "".join(c.text for c in chunks)


def test_a_prompt_longer_than_the_context_names_both_numbers(client, stub):
    context, prompt = context_of(client), "word " * 5000
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    with pytest.raises(grpc.RpcError) as rpc:
        list(stub.Generate(router_pb2.GenerateRequest(text=prompt), timeout=60))
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for message in (err.value.body["message"], rpc.value.details()):
        got = re.search(r"prompt has (\d+) tokens; the model's context is (\d+)", message)
        assert got and int(got[1]) > context == int(got[2]), message


def test_every_429_says_when_to_retry():
    """A worker out of KV blocks gives no retry hint of its own: the API's 429 still has Retry-After."""
    kv = ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "request r failed on every worker tried: admit on "
                      "127.0.0.1:1: RESOURCE_EXHAUSTED: out of KV cache memory: need 409 KV blocks, 320 free")
    refused = from_service_error(kv).response()
    assert refused.status == 429 and refused.headers["Retry-After"] == "1"
    assert json.loads(refused.body)["error"]["type"] == "rate_limit_error"
    hinted = ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", retry_after=2.5)
    assert from_service_error(hinted).response().headers["Retry-After"] == "3"
    assert "Retry-After" not in HTTPError(400, "bad").response().headers


def test_an_unexpected_failure_is_a_500_in_openais_shape():
    """A bug behind an endpoint answers OpenAI's error JSON (a client can parse it), not aiohttp's text."""
    import asyncio
    from types import SimpleNamespace

    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from baton.router.openai.api import OpenAIServer

    async def broken(request):
        raise TypeError("a bug")

    async def main():
        server = OpenAIServer(SimpleNamespace(auth=None), SimpleNamespace(served_model_name=["m"]), "m")
        app = web.Application(middlewares=[server._errors])
        app.router.add_post("/v1/completions", broken)
        async with TestClient(TestServer(app)) as http:
            r = await http.post("/v1/completions", json={})
            return r.status, await r.json()
    status, body = asyncio.run(main())
    assert status == 500 and body["error"]["type"] == "internal_error" and "a bug" in body["error"]["message"]


def test_bad_chat_bodies_are_400(client, pd_cluster):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    r = httpx.post(pd_cluster.http_url + "/chat/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_a_developer_message_is_a_system_message_and_a_bad_role_names_messages(client, pd_cluster):
    """OpenAI's newer models take "developer" messages in place of "system" ones: the same prompt."""
    def ids(role):
        return httpx.post(pd_cluster.http_url.removesuffix("/v1") + "/tokenize", timeout=30, json={
            "messages": [{"role": role, "content": "Answer in French."}, *QUESTION]}).json()["tokens"]
    assert ids("developer") == ids("system")
    r = client.chat.completions.create(model=MODEL, max_tokens=1,
                                       messages=[{"role": "developer", "content": "Be brief."}, *QUESTION])
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "Hi"}])
    assert err.value.body["param"] == "messages" and "'wizard'" in err.value.body["message"]


def test_an_image_to_a_text_only_model_is_400(client):
    url = "data:image/png;base64,iVBORw0KGgo="                      # never decoded: refused before that
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]}])
    assert "takes no images" in err.value.body["message"]


def test_audio_to_a_text_only_model_is_400(client):
    clip = {"data": "UklGRgAAAABXQVZF", "format": "wav"}        # never decoded: refused before that
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "input_audio", "input_audio": clip}, {"type": "text", "text": "What is this sound?"}]}])
    assert "takes no audio" in err.value.body["message"]


def test_an_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert err.value.body["code"] == "model_not_found" and MODEL in err.value.body["message"]


def test_a_path_or_method_not_served_says_what_is(client, pd_cluster):
    """An endpoint Baton does not serve (embeddings) is a 404 that lists the ones it does; a GET
    where only POST is served is a 405 that says to POST. Both in OpenAI's shape."""
    with pytest.raises(openai.NotFoundError) as err:
        client.embeddings.create(model=MODEL, input="hi")
    message = err.value.body["message"]
    assert "POST /v1/embeddings is not served here" in message
    assert "POST /v1/chat/completions" in message and "GET /v1/models" in message, message
    req = urllib.request.Request(pd_cluster.http_url + "/chat/completions", method="GET")
    with pytest.raises(urllib.error.HTTPError) as got:
        urllib.request.urlopen(req, timeout=10)
    body = json.loads(got.value.read())
    assert got.value.code == 405 and body["error"]["message"] == "GET /v1/chat/completions: use POST", body


# -- tools on a model whose chat template has none (the embedded SmolLM2's) -----------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def assert_valid_call(call, tools) -> None:
    """An OpenAI tool call whose arguments (a JSON string) follow its tool's parameters schema."""
    assert call.type == "function" and call.id.startswith("call_")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def streamed_calls(client, **kw) -> tuple[list[dict], str]:
    """The tool-call deltas of a streamed chat, merged per index as OpenAI's clients do, and its finish reason."""
    calls, reason = {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for d in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": d.id, "type": d.type, "name": d.function.name, "arguments": ""})
            call["arguments"] += d.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return [calls[i] for i in sorted(calls)], reason


def test_tools_reach_a_template_without_them_in_the_generic_form(pd_cluster):
    url = pd_cluster.http_url.removesuffix("/v1")
    ids = httpx.post(url + "/tokenize", json={"messages": WEATHER_Q, "tools": [WEATHER]}, timeout=30).json()["tokens"]
    prompt = httpx.post(url + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert prompt.startswith("<|im_start|>system\nYou can call the functions below")
    assert json.dumps(WEATHER["function"]["parameters"]) in prompt and "<tool_call>" in prompt
    assert prompt.endswith("What is the weather in Paris?<|im_end|>\n<|im_start|>assistant\n")


def test_a_named_tool_call_on_the_default_model_whole_and_streamed(client):
    kw = dict(model=MODEL, messages=WEATHER_Q, tools=[WEATHER], tool_choice=NAMED, temperature=0, max_tokens=40)
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert_valid_call(call, [WEATHER])
    calls, reason = streamed_calls(client, **kw)
    assert reason == "tool_calls" and [(c["type"], c["name"], c["arguments"]) for c in calls] == \
        [("function", "get_weather", call.function.arguments)] and calls[0]["id"].startswith("call_")


def test_a_required_tool_call_on_the_default_model_whole_and_streamed(client):
    kw = dict(model=MODEL, messages=WEATHER_Q, tools=[WEATHER, CLOCK], tool_choice="required", temperature=0,
              max_tokens=40)
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert_valid_call(call, [WEATHER, CLOCK])
    calls, reason = streamed_calls(client, **kw)
    assert reason == "tool_calls" and [(c["name"], c["arguments"]) for c in calls] == \
        [(call.function.name, call.function.arguments)]


def test_a_tool_result_on_the_default_model_is_answered(client, pd_cluster):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = WEATHER_Q + [{"role": "assistant", "content": None, "tool_calls": [call]},
                           {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "sunny"}'}]
    url = pd_cluster.http_url.removesuffix("/v1")
    ids = httpx.post(url + "/tokenize", json={"messages": history, "tools": [WEATHER]}, timeout=30).json()["tokens"]
    prompt = httpx.post(url + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    # the earlier call and its result, as plain turns the template renders
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{"temperature": 21, "sky": "sunny"}\n'
            '</tool_response><|im_end|>\n<|im_start|>assistant\n') in prompt
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], temperature=0,
                                            max_tokens=40).choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert "21" in answer.message.content                   # it read the tool's result


def _idle(pd_cluster) -> int:
    return pd_cluster.wait_workers_idle(15)


def test_a_client_that_disconnects_frees_its_blocks(client, pd_cluster):
    start = pd_cluster.worker("decode-0").status()
    stream = client.completions.create(model=MODEL, prompt="Tell me a very long story.", max_tokens=3000,
                                       extra_body={"ignore_eos": True}, stream=True)
    got = 0
    for _ in stream:
        got += 1
        if got == 5:
            break
    assert pd_cluster.worker("decode-0").status().running == 1
    stream.close()                                # the connection goes; the request must too
    assert _idle(pd_cluster) == 0
    # a non-streaming request whose client gives up (a client timeout closes the connection)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(pd_cluster.http_url + "/completions", timeout=1.5,
                   json={"model": MODEL, "prompt": "Another long story", "max_tokens": 3000, "ignore_eos": True})
    assert _idle(pd_cluster) == 0
    assert pd_cluster.worker("decode-0").status().kv_blocks_free == start.kv_blocks_free
    # no step ran after the aborts: the worker's gauges follow its idle core's beats, not its last step
    url, deadline = pd_cluster.metrics_urls["decode-0"], time.monotonic() + 3
    while True:
        d = scrape(url)
        settled = d[("baton_running", ())] == 0 and d[("baton_kv_blocks_free", ())] == start.kv_blocks_free
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert settled, {k: v for k, v in d.items() if k[0] in ("baton_running", "baton_kv_blocks_free")}


# -- metrics --------------------------------------------------------------------------------------
def scrape(url: str) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of a /metrics page."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def delta(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_record_the_requests_sent(client, stub, pd_cluster):
    urls = pd_cluster.metrics_urls
    _idle(pd_cluster)
    before = {name: scrape(url) for name, url in urls.items()}
    prompts = ["Count: 1, 2, 3,", "The alphabet: a, b, c,", "Colours: red, green,"]
    prompt_tokens = 0
    for p in prompts:
        r = client.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=5,
                                      extra_body={"ignore_eos": True})
        prompt_tokens += r.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError):                 # refused before routing: not a request
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert _idle(pd_cluster) == 0
    time.sleep(1.5)                                             # the workers' gauges follow their steps
    after = {name: scrape(url) for name, url in urls.items()}
    r0, r1 = before["router"], after["router"]
    m = {"model": MODEL}
    assert delta(r0, r1, "baton_requests_total", status="length", **m) == 3
    assert delta(r0, r1, "baton_prompt_tokens_total", **m) == prompt_tokens
    assert delta(r0, r1, "baton_generation_tokens_total", **m) == 15
    for hist, count in (("baton_ttft_seconds", 3), ("baton_e2e_seconds", 3), ("baton_queue_seconds", 3),
                        ("baton_itl_seconds", 12)):
        assert delta(r0, r1, hist + "_count", **m) == count, hist
        assert delta(r0, r1, hist + "_sum", **m) > 0 or hist == "baton_queue_seconds"
    # TTFT <= E2E, request by request, so in sum too
    assert delta(r0, r1, "baton_ttft_seconds_sum", **m) <= delta(r0, r1, "baton_e2e_seconds_sum", **m)
    assert r1[("baton_router_running", tuple(m.items()))] == 0
    assert r1[("baton_model_info", (("model", MODEL), ("role", "router")))] == 1
    d0, d1 = before["decode-0"], after["decode-0"]
    p0, p1 = before["prefill-0"], after["prefill-0"]
    moved = delta(p0, p1, "baton_kv_transfer_bytes_total", direction="out")
    assert moved > 0 and moved == delta(d0, d1, "baton_kv_transfer_bytes_total", direction="in")
    assert delta(d0, d1, "baton_handover_seconds_count") == 3
    assert delta(d0, d1, "baton_requests_total", status="length", **m) == 3
    assert d1[("baton_kv_cache_usage_ratio", ())] == 0 and d1[("baton_kv_blocks_total", ())] == 256
    assert d1[("baton_running", ())] == 0 and d1[("baton_waiting", ())] == 0


def test_the_metrics_table_is_what_the_processes_export():
    from baton.serving.metrics import table
    assert (REPO / "docs" / "metrics.md").read_text() == table(), \
        "regenerate it: python -m baton.serving.metrics > docs/metrics.md"


def test_observing_many_at_once_equals_observing_each():
    """The router's inter-token latency records a paced message's tokens in one go (observe_many)."""
    from prometheus_client import CollectorRegistry, Histogram

    from baton.serving.metrics import LATENCY_BUCKETS, observe_many
    one, many = (Histogram(name, "", buckets=LATENCY_BUCKETS, registry=CollectorRegistry()) for name in ("a", "b"))
    for value, count in ((0.0, 3), (0.004, 5), (0.2, 1), (100.0, 2), (0.01, 0)):
        for _ in range(count):
            one.observe(value)
        observe_many(many, value, count)
    samples = [[(s.name[1:], s.labels, s.value) for s in next(iter(h.collect())).samples if not s.name.endswith("created")]
               for h in (one, many)]
    assert samples[0] == samples[1]
