"""Tools in a chat: checking them, what the template renders, and what a forced call must look like.

Calls are written the Hermes / Qwen3 way, which those models' templates teach (and, for a template
without tools, generic_tools.py's prompt):
`<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>`.
A forced call (tool_choice "required" or a named tool) starts the assistant's turn with the
call's opening (`forced_call`): the model writes what follows it, the arguments of the named tool
(or the whole {name, arguments} object for "required"), which `call_schema` describes as a JSON
Schema that structured output holds the model to (router/server.py). A call the model makes on its
own (`auto`) is not constrained, so a `strict` tool is refused unless every call of it is forced.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from baton.v1 import router_pb2

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
MODES = ("auto", "none", "required")


@dataclass(slots=True, frozen=True)
class ForcedCall:
    prefix: str          # appended to the rendered prompt: the assistant's turn starts with it
    schema: dict         # what the model's output after `prefix` must match (call_schema)
    strict: bool = False # the forced tools are strict: schema keywords the engine cannot enforce are refused


def check(chat: router_pb2.Chat) -> None:
    """A ValueError naming what is wrong with the chat's tools and tool_choice, if anything."""
    names = [t.name for t in chat.tools]
    for i, tool in enumerate(chat.tools):
        if not tool.name:
            raise ValueError(f"tools[{i}] has no name")
        if names.count(tool.name) > 1:
            raise ValueError(f"tools: {tool.name!r} is given twice")
        schema = parameters(tool)
        if not isinstance(schema, dict):
            raise ValueError(f"tools[{i}] ({tool.name}): parameters must be a JSON Schema object")
    choice = chat.tool_choice
    forced = bool(choice.function) or choice.mode == "required"
    for i, tool in enumerate(chat.tools):
        if tool.strict and not forced:
            raise ValueError(f"tools[{i}] ({tool.name}): strict holds only where the call is forced (tool_choice "
                             f"'required' or naming a tool): Baton does not constrain calls the model makes on its "
                             f"own; force the call, or leave strict unset and validate the arguments")
    if choice.mode and choice.function:
        raise ValueError("tool_choice: set its mode or its function, not both")
    if choice.mode and choice.mode not in MODES:
        raise ValueError(f"tool_choice must be one of {MODES} or a function, got {choice.mode!r}")
    if choice.function and choice.function not in names:
        raise ValueError(f"tool_choice names {choice.function!r}, which is not among the tools {names}")
    if choice.mode == "required" and not names:
        raise ValueError("tool_choice 'required' needs tools")


def parameters(tool: router_pb2.Tool):
    if not tool.parameters:
        return {"type": "object"}
    try:
        return json.loads(tool.parameters)
    except json.JSONDecodeError as exc:
        raise ValueError(f"tool {tool.name!r}: parameters are not JSON ({exc})") from None


def template_tools(chat: router_pb2.Chat) -> list[dict] | None:
    """The tools as chat templates take them (transformers' `tools=`), or None: no tools, or
    tool_choice "none" (the model is not told of tools it may not call, as vLLM does)."""
    if not chat.tools or chat.tool_choice.mode == "none":
        return None
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": parameters(t)}} for t in chat.tools]


def call_schema(chat: router_pb2.Chat) -> dict | None:
    """The JSON Schema of what the model must write after `forced_call`'s prefix: a named tool's
    arguments, or for "required" one {"name", "arguments"} object of any tool; None when no call
    is forced. Pure (no tokenizer, no torch): structured output compiles it."""
    choice = chat.tool_choice
    if choice.function:
        return parameters(next(t for t in chat.tools if t.name == choice.function))
    if choice.mode != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": parameters(t)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in chat.tools]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def forced_call(chat: router_pb2.Chat) -> ForcedCall | None:
    """How the assistant's turn starts when a call is forced (None: it is not)."""
    schema = call_schema(chat)
    if schema is None:
        return None
    prefix = CALL_OPEN + "\n"
    if chat.tool_choice.function:
        prefix += '{"name": ' + json.dumps(chat.tool_choice.function) + ', "arguments": '
    callable_ = [t for t in chat.tools if chat.tool_choice.mode == "required" or t.name == chat.tool_choice.function]
    return ForcedCall(prefix, schema, strict=all(t.strict for t in callable_))


def history_calls(message: router_pb2.ChatMessage) -> list[dict]:
    """An assistant message's earlier calls as templates take them (arguments as an object where
    they are JSON, so a template's `tojson` writes them once, not as a quoted string)."""
    out = []
    for call in message.tool_calls:
        try:
            arguments = json.loads(call.arguments or "{}")
        except json.JSONDecodeError:
            arguments = call.arguments
        out.append({"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}})
    return out
