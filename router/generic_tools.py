"""Tools for a model whose chat template does not render them (the embedded SmolLM2's, most base
ChatML ones): the tools go into the prompt in one generic, documented form instead.

The form: a block in the system turn listing each tool's name, description and JSON Schema, and
the call format the router parses, Hermes / Qwen3's `<tool_call>{"name", "arguments"}</tool_call>`
(tool_calls.py), so a forced call (a named or `required` tool_choice) opens the turn and the grammar
holds its arguments exactly as on a template with tools. The chat's history is rewritten into
plain turns the template renders: an assistant's earlier calls as those blocks in its content, tool
results as a user turn of `<tool_response>` blocks.
"""
from __future__ import annotations

import json

from baton.router import tool_calls
from baton.v1 import router_pb2

RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
# the generic block; {tools}: one JSON object per line, each tool's name, description, parameters
INSTRUCTIONS = """You can call the functions below to help answer. Each is given as JSON: its name, what it does, \
and a JSON Schema of its arguments.
<tools>
{tools}
</tools>

To call a function, reply with one block per call and nothing else, the arguments following the \
function's schema:
{call_open}
{{"name": "<function name>", "arguments": {{<arguments>}}}}
{call_close}
Each result comes back in a {response_open}{response_close} block; then answer from the results."""


def renders_tools(template) -> bool:
    """Whether a chat template (its source, or transformers' dict of named ones) renders tools: it
    must mention them (the rule engine/requests/tokenizer.py's render_chat applies to refuse dropped tools)."""
    if isinstance(template, dict):
        template = template.get("tool_use", "")
    return isinstance(template, str) and "tools" in template


def prompt_inputs(chat: router_pb2.Chat, messages: list[dict], template) -> tuple[list[dict], list[dict] | None]:
    """The messages and `tools=` to render `chat` with: the template's own way where it renders
    tools; else the generic form (tools in the system turn, the history in plain turns), no `tools=`."""
    tools = tool_calls.template_tools(chat)
    if renders_tools(template):
        return messages, tools
    messages = plain_history(messages)
    if tools is None:
        return messages, None
    return with_instructions(messages, instructions(tools), system="system" in str(template)), None


def instructions(tools: list[dict]) -> str:
    """The generic block for `tools` (as tool_calls.template_tools gives them)."""
    listed = "\n".join(json.dumps({k: v for k, v in t["function"].items() if v != ""}, ensure_ascii=False)
                       for t in tools)
    return INSTRUCTIONS.format(tools=listed, call_open=tool_calls.CALL_OPEN, call_close=tool_calls.CALL_CLOSE,
                               response_open=RESPONSE_OPEN, response_close=RESPONSE_CLOSE)


def with_instructions(messages: list[dict], block: str, system: bool) -> list[dict]:
    """`block` at the end of the system turn, or in a system turn of its own where the chat has none;
    before the first message's text where the template has no system turn (`system` False)."""
    first, rest = messages[0], messages[1:]
    if first["role"] == "system":
        return [dict(first, content=_added(first.get("content"), block, before=False)), *rest]
    if system:
        return [{"role": "system", "content": block}, *messages]
    return [dict(first, content=_added(first.get("content"), block, before=True)), *rest]


def plain_history(messages: list[dict]) -> list[dict]:
    """Earlier calls into the assistant's content; consecutive tool results into one user turn."""
    out: list[dict] = []
    after_tool = False
    for m in messages:
        if m["role"] == "tool":
            response = f"{RESPONSE_OPEN}\n{_text(m.get('content'))}\n{RESPONSE_CLOSE}"
            if after_tool:
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
            after_tool = True
            continue
        after_tool = False
        if m.get("tool_calls"):
            calls = "\n".join(_call_block(c["function"]) for c in m["tool_calls"])
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = _added(m.get("content"), calls, before=False, sep="\n")
        out.append(m)
    return out


def _call_block(fn: dict) -> str:
    call = json.dumps({"name": fn["name"], "arguments": fn["arguments"]}, ensure_ascii=False)
    return f"{tool_calls.CALL_OPEN}\n{call}\n{tool_calls.CALL_CLOSE}"


def _text(content) -> str:
    """A message's text: its string, or its text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(p["text"] for p in content if p.get("type") == "text")


def _added(content, text: str, before: bool, sep: str = "\n\n"):
    """`content` (a string, or parts with images) with `text` before or after what it holds."""
    if isinstance(content, list):
        part = {"type": "text", "text": text}
        return [part, *content] if before else [*content, part]
    if not content:
        return text
    return f"{text}{sep}{content}" if before else f"{content}{sep}{text}"
