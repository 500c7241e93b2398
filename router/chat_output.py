"""A chat's output split as it streams: thinking (`<think>...</think>`), tool calls, content.

Each parser takes the text as it comes and gives back what is sure already, holding back only a
tail that may be the start of a tag, so a tag split over chunks (or tokens) is never shown as
text. `ChatOutput` applies them to a request's GenerateResponse stream: `text` keeps the content,
`reasoning_text` and `tool_calls` get the rest; `token_ids` are left whole.
"""
from __future__ import annotations

import json
import re
import uuid

from baton.router.tool_calls import CALL_CLOSE, CALL_OPEN, ForcedCall
from baton.v1 import router_pb2

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")
# the canonical opening of a call, up to its arguments: {"name": "...", "arguments":
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:')


def held(text: str, tag: str) -> int:
    """Where the longest tail of `text` that may begin `tag` starts (len(text): none does)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return len(text) - n
    return len(text)


class Reasoning:
    """`<think>...</think>` -> reasoning. qwen3: thinking only when the output opens with <think>
    (a Qwen3 template with thinking off already closed it in the prompt); deepseek_r1: the output
    starts inside the thinking (its template opened it), an opening <think> is dropped if written."""

    def __init__(self, kind: str):
        self.kind = kind
        self.state = "start"
        self.buf = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) sure so far."""
        self.buf += text
        reasoning = content = ""
        if self.state == "start":
            head = self.buf.lstrip()
            if head.startswith(THINK_OPEN):
                self.buf, self.state = head[len(THINK_OPEN):], "thinking"
            elif THINK_OPEN.startswith(head) and not final:
                return "", ""                              # maybe <think>: wait
            else:
                self.state = "thinking" if self.kind == "deepseek_r1" else "content"
        if self.state == "thinking":
            end = self.buf.find(THINK_CLOSE)
            if end < 0:
                cut = len(self.buf) if final else held(self.buf, THINK_CLOSE)
                reasoning, self.buf = self.buf[:cut], self.buf[cut:]
                return reasoning, ""
            reasoning, self.buf, self.state = self.buf[:end], self.buf[end + len(THINK_CLOSE):], "content"
        content, self.buf = self.buf, ""
        return reasoning, content


class ToolCalls:
    """Hermes / Qwen3 `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` -> deltas.

    A call in the canonical key order streams: its id and name once read, then its arguments'
    JSON text as it grows (a scanner finds where the arguments end). Any other shape waits for
    </tool_call> and is parsed whole; a block that is no call stays in the content, as written."""

    def __init__(self):
        self.state = "text"
        self.buf = ""
        self.calls = 0
        self.depth = 0                     # of the arguments' brackets
        self.in_string = self.escaped = self.started = False

    def feed(self, text: str, final: bool = False) -> tuple[str, list[router_pb2.ToolCallDelta]]:
        """(content, deltas) sure so far; `final`: the output has ended."""
        self.buf += text
        content: list[str] = []
        deltas: list[router_pb2.ToolCallDelta] = []
        while self.buf:
            if self.state == "text":
                start = self.buf.find(CALL_OPEN)
                if start < 0:
                    cut = len(self.buf) if final else held(self.buf, CALL_OPEN)
                    content.append(self.buf[:cut])
                    self.buf = self.buf[cut:]
                    break
                content.append(self.buf[:start])
                self.buf, self.state = self.buf[start + len(CALL_OPEN):], "head"
            elif self.state == "head":
                if not self._head(deltas, content):
                    break
            elif self.state == "arguments":
                self._arguments(deltas)
            else:                                           # "tail": after the arguments, up to </tool_call>
                end = self.buf.find(CALL_CLOSE)
                if end < 0:
                    self.buf = self.buf[held(self.buf, CALL_CLOSE):]
                    break
                self.buf, self.state = self.buf[end + len(CALL_CLOSE):], "text"
        if final and self.state == "head" and self.buf:
            self._whole(self.buf, deltas, content)
            self.buf = ""
        return "".join(content), deltas

    def _head(self, deltas, content) -> bool:
        """Read a call's opening; False: wait for more text."""
        m = _HEAD.match(self.buf)
        if m is not None:
            deltas.append(self._new(json.loads(f'"{m.group(1)}"')))
            self.buf, self.state = self.buf[m.end():], "arguments"
            self.depth, self.in_string, self.escaped, self.started = 0, False, False, False
            return True
        end = self.buf.find(CALL_CLOSE)
        if end < 0:
            return False
        self._whole(self.buf[:end], deltas, content)
        self.buf, self.state = self.buf[end + len(CALL_CLOSE):], "text"
        return True

    def _whole(self, body: str, deltas, content) -> None:
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            call = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            content.append(CALL_OPEN + body)                  # not a call: the model's text, as it wrote it
            return
        delta = self._new(call["name"])
        arguments = call.get("arguments", call.get("parameters", {}))
        delta.arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        deltas.append(delta)

    def _new(self, name: str) -> router_pb2.ToolCallDelta:
        self.calls += 1
        return router_pb2.ToolCallDelta(index=self.calls - 1, id=f"call_{uuid.uuid4().hex[:24]}", name=name)

    def _arguments(self, deltas) -> None:
        """Take the arguments' characters from the buffer, up to where their JSON value ends."""
        taken, end = [], None
        for i, c in enumerate(self.buf):
            if self.in_string:
                taken.append(c)
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:                     # the arguments were a string
                        end = i + 1
                        break
                continue
            if c in " \t\r\n" and not self.started:
                continue
            if (c in "}]" or (self.started and c in " \t\r\n,")) and self.depth == 0:
                end = i                                     # the call's own brace, or a bare value's end
                break
            self.started = True
            taken.append(c)
            if c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    end = i + 1
                    break
        self._more(deltas, "".join(taken))
        if end is None:
            self.buf = ""
        else:
            self.buf, self.state = self.buf[end:], "tail"

    def _more(self, deltas, text: str) -> None:
        if not text:
            return
        if deltas and deltas[-1].index == self.calls - 1:
            deltas[-1].arguments += text
        else:
            deltas.append(router_pb2.ToolCallDelta(index=self.calls - 1, arguments=text))


class ChatOutput:
    """One chat request's output through its parsers, response by response."""

    def __init__(self, reasoning: str | None, tools: bool, forced: ForcedCall | None = None):
        self.reasoning = Reasoning(reasoning) if reasoning and forced is None else None
        self.tools = ToolCalls() if tools else None
        self.pending: list[router_pb2.ToolCallDelta] = []
        if forced is not None:                              # the call's opening is in the prompt
            self.pending = self.tools.feed(forced.prefix)[1]
        self.called = False

    def relay(self, resp: router_pb2.GenerateResponse) -> router_pb2.GenerateResponse:
        final = resp.finish_reason != router_pb2.FINISH_REASON_UNSPECIFIED
        text, thought = resp.text, ""
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text, final)
        deltas = self.pending
        self.pending = []
        if self.tools is not None:
            text, more = self.tools.feed(text, final)
            deltas += more
        resp.text, resp.reasoning_text = text, thought
        resp.tool_calls.extend(_merged(deltas))
        self.called = self.called or bool(deltas)
        if final and self.called and resp.finish_reason == router_pb2.FINISH_REASON_STOP:
            resp.finish_reason = router_pb2.FINISH_REASON_TOOL_CALLS
        return resp


def _merged(deltas: list[router_pb2.ToolCallDelta]) -> list[router_pb2.ToolCallDelta]:
    """One delta per call of a chunk (a call's name and its first arguments together)."""
    out: list[router_pb2.ToolCallDelta] = []
    for d in deltas:
        if out and out[-1].index == d.index and not d.id:
            out[-1].arguments += d.arguments
        else:
            out.append(d)
    return out
