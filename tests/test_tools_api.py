"""Tools, thinking and the token endpoints through a served stack, with the real `openai` client.

The stack renders chats with the Hermes / Qwen3-style template Baton ships, by its short name
(`--chat-template hermes_tools`: the embedded SmolLM2's own template takes no tools; that case,
the generic form, is test_openai_api's) and reads thinking with --reasoning-parser qwen3. The tiny model calls no tool on its own, so a call is made
deterministic the honest ways: a named tool_choice (the turn opens with the call, the model writes
its arguments), and a chat whose earlier turns the model copies greedily (its own output holds the
<tool_call> block, or the <think> block, that the router parses)."""
from __future__ import annotations

import json

import grpc
import httpx
import jsonschema
import openai
import pytest

from baton import __version__
from baton.router import chat_templates
from baton.v1 import router_pb2, router_pb2_grpc

MODEL = "smollm2-135m-instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
GREEDY = dict(model=MODEL, temperature=0, max_tokens=40)


@pytest.fixture(scope="module")
def stack(colocated_cluster):
    """The session's colocated stack (tests/conftest.py): hermes_tools template, qwen3 reasoning parser."""
    return colocated_cluster


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.http_url, api_key="unused", max_retries=0, timeout=120)


def test_chat_template_takes_a_shipped_template_by_name_or_a_file(tmp_path):
    shipped = chat_templates.resolve("hermes_tools")
    assert shipped == chat_templates.resolve("hermes_tools.jinja") and "<tool_call>" in open(shipped).read()
    own = tmp_path / "mine.jinja"
    own.write_text("{{ messages }}")
    assert chat_templates.resolve(str(own)) == str(own)
    with pytest.raises(ValueError, match=r"no such file, nor a template Baton ships \(.*hermes_tools.*\)"):
        chat_templates.resolve("hermes_tool")


def streamed(client, **kw):
    """The answer assembled by the openai package's own streaming helper."""
    with client.chat.completions.stream(**kw) as s:
        return s.get_final_completion().choices[0]


def test_a_named_tool_choice_calls_that_tool_whole_and_streamed(client):
    r = client.chat.completions.create(messages=QUESTION, tools=[WEATHER], tool_choice=NAMED, **GREEDY)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    # structured output holds the forced call to the tool's parameters schema
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    s = streamed(client, messages=QUESTION, tools=[WEATHER], tool_choice=NAMED, **GREEDY)
    assert s.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in s.message.tool_calls] == \
        [(call.function.name, call.function.arguments)]


def test_a_tool_round_trip_answers_from_the_tool_result(client):
    call = client.chat.completions.create(messages=QUESTION, tools=[WEATHER], tool_choice=NAMED,
                                          **GREEDY).choices[0].message
    history = QUESTION + [call.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.tool_calls[0].id,
                           "content": json.dumps({"temperature": 21, "sky": "sunny"})}]
    whole = client.chat.completions.create(messages=history, tools=[WEATHER], **GREEDY).choices[0]
    assert whole.finish_reason in ("stop", "length") and whole.message.content and not whole.message.tool_calls
    assert "21" in whole.message.content                    # it read the tool's result
    s = streamed(client, messages=history, tools=[WEATHER], **GREEDY)
    assert s.message.content == whole.message.content and not s.message.tool_calls


def copied(reply: str, turns: int = 2) -> list[dict]:
    """A chat whose assistant said `reply` to the same question `turns` times: greedily, the model
    says it again (as in test_chat_output, the output is what the model wrote)."""
    chat = []
    for _ in range(turns):
        chat += [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": reply}]
    return chat + [{"role": "user", "content": "Hi"}]


def test_a_call_the_model_writes_itself_is_parsed_whole_and_streamed(client):
    block = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    chat = copied(block)
    whole = client.chat.completions.create(messages=chat, tools=[WEATHER], **GREEDY).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    (call,) = whole.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    s = streamed(client, messages=chat, tools=[WEATHER], **GREEDY)
    assert [json.loads(c.function.arguments) for c in s.message.tool_calls] == [{"city": "Paris"}]
    # tool_choice none: the model is not told of the tools, nothing is parsed
    plain = client.chat.completions.create(messages=chat, tools=[WEATHER], tool_choice="none", **GREEDY).choices[0]
    assert not plain.message.tool_calls and plain.finish_reason != "tool_calls"


def test_thinking_comes_back_as_reasoning_content_whole_and_streamed(client, stack):
    chat = copied("<think>Greet back.</think>Hello!")
    whole = client.chat.completions.create(messages=chat, **GREEDY).choices[0].message
    assert (whole.model_extra["reasoning_content"], whole.content) == ("Greet back.", "Hello!")
    chunks = list(client.chat.completions.create(messages=chat, stream=True, **GREEDY))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "Greet back."
    assert "".join(d.content or "" for d in deltas) == "Hello!"
    # the completions endpoint reads nothing: the same prompt's raw text holds the tags
    ids = httpx.post(stack.http_url.removesuffix("/v1") + "/tokenize", json={"messages": chat}, timeout=30).json()
    raw = client.completions.create(model=MODEL, prompt=ids["tokens"], temperature=0, max_tokens=40)
    assert raw.choices[0].text == "<think>Greet back.</think>Hello!"


def test_chat_template_kwargs_reach_the_template(client, stack):
    url = stack.http_url.removesuffix("/v1")
    on = httpx.post(url + "/tokenize", json={"messages": QUESTION, "return_token_strs": True}, timeout=30).json()
    off = httpx.post(url + "/tokenize", json={"messages": QUESTION, "chat_template_kwargs": {"enable_thinking": False}},
                     timeout=30).json()
    assert off["tokens"][:on["count"]] == on["tokens"] and off["count"] > on["count"]
    text = httpx.post(url + "/detokenize", json={"tokens": off["tokens"][on["count"]:]}, timeout=30).json()["prompt"]
    assert text == "<think>\n\n</think>\n\n"
    r = client.chat.completions.create(messages=QUESTION, extra_body={"chat_template_kwargs": {"enable_thinking": False}},
                                       **GREEDY)
    assert r.usage.prompt_tokens == off["count"]
    assert on["token_strs"][0] == "<|im_start|>" and on["max_model_len"] > 0


def test_tokenize_detokenize_and_version_over_http_and_grpc(client, stack):
    url = stack.http_url.removesuffix("/v1")
    text = "The quick brown fox"
    out = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": text}, timeout=30).json()
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=1)
    assert out["count"] == len(out["tokens"]) == r.usage.prompt_tokens and out["token_strs"] is None
    assert httpx.post(url + "/detokenize", json={"tokens": out["tokens"]}, timeout=30).json() == {"prompt": text}
    assert httpx.get(url + "/version", timeout=30).json() == {"version": __version__}
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(stack.router.address))
    assert list(stub.Tokenize(router_pb2.TokenizeRequest(text=text), timeout=30).ids) == out["tokens"]
    assert stub.Detokenize(router_pb2.DetokenizeRequest(ids=out["tokens"]), timeout=30).text == text
    with pytest.raises(grpc.RpcError) as err:
        stub.Detokenize(router_pb2.DetokenizeRequest(ids=[10**9]), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_grpc_chats_carry_tools_and_give_tool_call_deltas(stack):
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(stack.router.address))
    fn = WEATHER["function"]
    chat = router_pb2.Chat(messages=[router_pb2.ChatMessage(**QUESTION[0])],
                           tools=[router_pb2.Tool(name=fn["name"], description=fn["description"],
                                                  parameters=json.dumps(fn["parameters"]))],
                           tool_choice=router_pb2.ToolChoice(function="get_weather"))
    chunks = list(stub.Generate(router_pb2.GenerateRequest(
        chat=chat, sampling=router_pb2.SamplingParams(temperature=0, max_tokens=40)), timeout=60))
    deltas = [d for c in chunks for d in c.tool_calls]
    assert deltas[0].name == "get_weather" and deltas[0].id.startswith("call_")
    assert isinstance(json.loads("".join(d.arguments for d in deltas)), dict)
    assert chunks[-1].finish_reason == router_pb2.FINISH_REASON_TOOL_CALLS
    assert "".join(c.text for c in chunks) == ""


def test_required_and_strict_calls_follow_the_schema(client):
    """tool_choice 'required' over two tools, one strict: the call is one of them, its arguments valid."""
    clock = {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}}
    r = client.chat.completions.create(messages=QUESTION, tools=[WEATHER, clock], tool_choice="required", **GREEDY)
    (call,) = r.choices[0].message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, clock)}
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.parametrize("fields, param", [
    ({"tools": [dict(WEATHER, function=dict(WEATHER["function"], strict=True))], "tool_choice": "auto"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": NAMED, "response_format": {"type": "json_object"}}, None),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"chat_template": "{{ messages }}"}, "chat_template"),          # not started with --trust-request-chat-template
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
])
def test_bad_tool_and_template_fields_are_400(client, fields, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(messages=QUESTION, extra_body=fields, **GREEDY)
    assert param is None or err.value.body["param"] == param, err.value.body
