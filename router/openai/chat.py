"""A chat request's OpenAI fields beyond its messages' text, to baton.v1 and back.

In: `tools`, `tool_choice`, an assistant's `tool_calls` and a tool message's `tool_call_id`,
`chat_template_kwargs` and `chat_template` (vLLM's extras). Out: the message's `tool_calls` and
`reasoning_content`, whole or as stream deltas, from what the router parsed (chat_output.py).
"""
from __future__ import annotations

import json

from baton.router.openai.errors import HTTPError
from baton.v1 import router_pb2


def chat_fields(body: dict, chat: router_pb2.Chat) -> None:
    """`tools`, `tool_choice`, `chat_template_kwargs` and `chat_template` into the gRPC chat."""
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise HTTPError(400, "tools must be a list of {type: function, function: {...}}", param="tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise HTTPError(400, f"tools[{i}] must be {{type: function, function: {{name, description, parameters}}}}",
                            param="tools")
        description, params, strict = fn.get("description") or "", fn.get("parameters"), fn.get("strict")
        if not isinstance(description, str) or not isinstance(params, (dict, type(None))) or \
                strict not in (None, True, False):
            raise HTTPError(400, f"tools[{i}].function: description must be a string, parameters a JSON Schema "
                                 "object, strict true or false", param="tools")
        chat.tools.add(name=fn["name"], description=description,
                       parameters=json.dumps(params) if params is not None else "", strict=bool(strict))
    _tool_choice(body.get("tool_choice"), chat)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise HTTPError(400, "chat_template_kwargs must be an object of template variables",
                            param="chat_template_kwargs")
        chat.template_kwargs = json.dumps(kwargs)
    template = body.get("chat_template")
    if template is not None:
        if not isinstance(template, str):
            raise HTTPError(400, "chat_template must be a string (a Jinja template)", param="chat_template")
        chat.template = template


def _tool_choice(choice, chat: router_pb2.Chat) -> None:
    if choice is None:
        return
    if isinstance(choice, str):
        chat.tool_choice.mode = choice
        return
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise HTTPError(400, "tool_choice must be 'auto', 'none', 'required' or {type: function, function: {name}}",
                        param="tool_choice")
    chat.tool_choice.function = fn["name"]


def message_fields(m: dict, i: int, message: router_pb2.ChatMessage) -> None:
    """An assistant's earlier `tool_calls` and a tool message's `tool_call_id`."""
    calls = m.get("tool_calls") or []
    if not isinstance(calls, list):
        raise HTTPError(400, f"messages[{i}].tool_calls must be a list", param="messages")
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                not isinstance(fn.get("arguments", ""), str):
            raise HTTPError(400, f"messages[{i}].tool_calls[{j}] must be {{id, type: function, function: "
                                 "{name, arguments: a JSON string}}", param="messages")
        message.tool_calls.add(id=str(call.get("id") or ""), name=fn["name"], arguments=fn.get("arguments", ""))
    call_id = m.get("tool_call_id")
    if call_id is not None:
        if not isinstance(call_id, str):
            raise HTTPError(400, f"messages[{i}].tool_call_id must be a string", param="messages")
        message.tool_call_id = call_id


class Calls:
    """A choice's tool calls, assembled from the deltas of its responses."""

    def __init__(self):
        self.calls: dict[int, dict] = {}

    def add(self, deltas) -> None:
        for d in deltas:
            call = self.calls.setdefault(d.index, {"id": d.id, "type": "function",
                                                   "function": {"name": d.name, "arguments": ""}})
            call["function"]["arguments"] += d.arguments

    def openai(self) -> list[dict] | None:
        return [self.calls[i] for i in sorted(self.calls)] or None


def chat_message(text: str, reasoning: str, calls: Calls) -> dict:
    """A whole answer's message: with tool calls, no content unless the model wrote some beside them."""
    tool_calls = calls.openai()
    content = text if text.strip() or not tool_calls else None
    out = {"role": "assistant", "content": content}
    if reasoning:
        out["reasoning_content"] = reasoning
    if tool_calls:
        out["tool_calls"] = tool_calls
    return out


def chat_delta(item: router_pb2.GenerateResponse) -> dict:
    """A streamed chunk's delta beyond its content, as OpenAI streams them: a call's first delta
    has its index, id, type and name (and arguments so far); later ones more arguments."""
    out = {}
    if item.reasoning_text:
        out["reasoning_content"] = item.reasoning_text
    calls = []
    for d in item.tool_calls:
        call = {"index": d.index, "function": {"arguments": d.arguments}}
        if d.id:
            call.update(id=d.id, type="function")
            call["function"]["name"] = d.name
        calls.append(call)
    if calls:
        out["tool_calls"] = calls
    return out
