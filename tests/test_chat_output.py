"""Parsing a chat's output (tool calls, thinking) as it streams, and the schema of a forced
call: the router's pure parts, without a server (tests/test_tools_api.py serves them)."""
from __future__ import annotations

import json

import jsonschema
import pytest

from baton.router import tool_calls
from baton.router.chat_output import ChatOutput, Reasoning, ToolCalls
from baton.v1 import router_pb2

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string"}}}


def feed_all(parser, text: str, step: int):
    """The parser's outputs, the text fed `step` characters at a time, then ended."""
    outs = [parser.feed(text[i:i + step]) for i in range(0, len(text), step)]
    return outs + [parser.feed("", final=True)]


def calls_of(deltas) -> list[dict]:
    """The deltas assembled as OpenAI's client does: per index, the id and name once, arguments joined."""
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
        assert not (d.id and call["id"]), "a call's id comes once"
        call["id"] += d.id
        call["name"] += d.name
        call["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]


OUTPUTS = [
    # (output, content, calls)
    ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me look.\n", [("get_weather", {"city": "Paris"})]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ri\\"s"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET", "n": [1, {"a": 2}]}}\n</tool_call>',
     "\n", [("get_weather", {"city": 'Pa}ri"s'}), ("get_time", {"zone": "CET", "n": [1, {"a": 2}]})]),
    ('<tool_call>{"arguments": {"city": "Rome"}, "name": "get_weather"}</tool_call>',       # other key order
     "", [("get_weather", {"city": "Rome"})]),
    ("No tools needed: 1 < 2 and <tool is a word.", "No tools needed: 1 < 2 and <tool is a word.", []),
    ("<tool_call>not json</tool_call> after", "<tool_call>not json after", []),
]


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize("output, content, calls", OUTPUTS)
def test_tool_calls_parse_alike_whole_and_streamed(output, content, calls, step):
    outs = feed_all(ToolCalls(), output, step)
    assert "".join(c for c, _ in outs) == content
    got = calls_of([d for _, ds in outs for d in ds])
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == calls
    assert all(c["id"].startswith("call_") for c in got)


def test_arguments_stream_as_they_grow():
    parser = ToolCalls()
    _, deltas = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert [(d.index, d.name, d.arguments) for d in deltas] == [(0, "get_weather", '{"ci')]
    _, deltas = parser.feed('ty": "Paris"}}\n</tool_call>')
    assert [d.arguments for d in deltas] == ['ty": "Paris"}']


@pytest.mark.parametrize("kind, output, reasoning, content", [
    ("qwen3", "<think>Greet back.</think>Hello!", "Greet back.", "Hello!"),
    ("qwen3", "\n<think>\nhm\n</think>\n\nHi", "\nhm\n", "\n\nHi"),
    ("qwen3", "Hello <think> is not at the start", "", "Hello <think> is not at the start"),
    ("qwen3", "<thi", "", "<thi"),                                    # ended before it could be a tag
    ("deepseek_r1", "hm, easy</think>4", "hm, easy", "4"),            # its template opened the thinking
    ("deepseek_r1", "<think>hm</think>4", "hm", "4"),
    ("deepseek_r1", "still thinking when cut", "still thinking when cut", ""),
])
@pytest.mark.parametrize("step", [1, 2, 1000])
def test_reasoning_splits_alike_whole_and_streamed(kind, output, reasoning, content, step):
    outs = feed_all(Reasoning(kind), output, step)
    assert ("".join(r for r, _ in outs), "".join(c for _, c in outs)) == (reasoning, content)


def response(text: str, finish=router_pb2.FINISH_REASON_UNSPECIFIED) -> router_pb2.GenerateResponse:
    return router_pb2.GenerateResponse(text=text, finish_reason=finish)


def test_chat_output_splits_thinking_then_calls_and_says_tool_calls():
    out = ChatOutput("qwen3", tools=True)
    parts = ["<think>need the", " weather</think>", '<tool_call>\n{"name": "get_weather", ',
             '"arguments": {"city": "Paris"}}\n</tool_call>']
    got = [out.relay(response(t)) for t in parts] + [out.relay(response("", router_pb2.FINISH_REASON_STOP))]
    assert "".join(r.reasoning_text for r in got) == "need the weather"
    assert "".join(r.text for r in got) == ""
    assert calls_of([d for r in got for d in r.tool_calls])[0]["arguments"] == '{"city": "Paris"}'
    assert got[-1].finish_reason == router_pb2.FINISH_REASON_TOOL_CALLS


def chat(choice: router_pb2.ToolChoice) -> router_pb2.Chat:
    return router_pb2.Chat(tools=[router_pb2.Tool(name="get_weather", parameters=json.dumps(WEATHER)),
                                  router_pb2.Tool(name="get_time", parameters=json.dumps(TIME))],
                           tool_choice=choice)


def test_a_named_choice_forces_that_call_and_its_arguments_schema():
    c = chat(router_pb2.ToolChoice(function="get_weather"))
    assert tool_calls.call_schema(c) == WEATHER
    forced = tool_calls.forced_call(c)
    out = ChatOutput(None, tools=True, forced=forced)
    first = out.relay(response('{"city": "Paris"}}\n'))
    last = out.relay(response("", router_pb2.FINISH_REASON_STOP))
    (call,) = calls_of(list(first.tool_calls) + list(last.tool_calls))
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    jsonschema.validate(json.loads(call["arguments"]), forced.schema)


def test_required_forces_one_call_of_any_tool():
    c = chat(router_pb2.ToolChoice(mode="required"))
    schema = tool_calls.call_schema(c)
    jsonschema.validate({"name": "get_time", "arguments": {"zone": "UTC"}}, schema)
    for wrong in ({"name": "get_time", "arguments": {"zone": 1}}, {"name": "nope", "arguments": {}},
                  {"name": "get_weather", "arguments": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    assert tool_calls.forced_call(c).prefix == "<tool_call>\n"
    assert tool_calls.call_schema(chat(router_pb2.ToolChoice(mode="auto"))) is None
    assert tool_calls.template_tools(chat(router_pb2.ToolChoice(mode="none"))) is None


@pytest.mark.parametrize("bad, message", [
    (router_pb2.Chat(tools=[router_pb2.Tool(name="f", parameters="{oops")]), "not JSON"),
    (router_pb2.Chat(tools=[router_pb2.Tool(name="f"), router_pb2.Tool(name="f")]), "given twice"),
    (router_pb2.Chat(tools=[router_pb2.Tool(name="f", strict=True)]), "strict holds only where the call is forced"),
    (router_pb2.Chat(tools=[router_pb2.Tool(name="f")], tool_choice=router_pb2.ToolChoice(function="g")),
     "not among the tools"),
    (router_pb2.Chat(tool_choice=router_pb2.ToolChoice(mode="required")), "needs tools"),
    (router_pb2.Chat(tools=[router_pb2.Tool(name="f")], tool_choice=router_pb2.ToolChoice(mode="always")),
     "must be one of"),
])
def test_bad_tools_are_refused_with_what_to_fix(bad, message):
    with pytest.raises(ValueError, match=message):
        tool_calls.check(bad)


def test_a_template_that_cannot_render_tools_is_refused_rather_than_dropping_them(embedded_source):
    from baton.engine.requests.tokenizer import load_tokenizer, render_chat
    tokenizer = load_tokenizer(embedded_source)                 # SmolLM2's template takes no tools
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    with pytest.raises(ValueError, match="does not render tools.*--chat-template"):
        render_chat(tokenizer, [{"role": "user", "content": "Hi"}], tools=tools)
    with pytest.raises(ValueError, match="may not set.*tools"):
        render_chat(tokenizer, [{"role": "user", "content": "Hi"}], template_kwargs={"tools": tools})
