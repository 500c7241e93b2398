"""Logprobs in OpenAI's two shapes, from baton.v1 TokenLogprob messages.

Completions: {"tokens", "token_logprobs", "top_logprobs", "text_offset"} (with `echo`, the prompt's
tokens first; its first token has no logprob: null, as OpenAI's). Chat: {"content": [{"token",
"logprob", "bytes", "top_logprobs": [...]}]}. A token's text is its own decoding (a token holding
part of a character decodes to U+FFFD, as in vLLM); `bytes` are that text's UTF-8.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True)
class Entry:
    """One token: its logprob (None: the prompt's first) and the most likely ones there."""
    token_id: int
    logprob: float | None
    top: list[tuple[int, float]] | None


def entries(messages: Iterable) -> list[Entry]:
    """(A NaN logprob, a record the worker could not make, becomes None: JSON has no NaN.)"""
    return [Entry(m.token_id, None if math.isnan(m.logprob) else m.logprob, [(t.token_id, t.logprob) for t in m.top])
            for m in messages]


def prompt_entries(first_token: int, messages: Iterable) -> list[Entry]:
    return [Entry(first_token, None, None), *entries(messages)]


class TokenTexts:
    """Each token id's own text, decoded once."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False,
                                                                  clean_up_tokenization_spaces=False)
        return text


def completion_logprobs(items: list[Entry], text_of: TokenTexts, offset: int = 0) -> dict:
    """`offset`: characters of the choice's text before these tokens."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in items:
        text = text_of(e.token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(e.logprob)
        # the chosen token always among its position's entries, as OpenAI and vLLM give them (up to logprobs + 1)
        out["top_logprobs"].append(None if e.top is None else
                                   {**({} if e.logprob is None else {text: e.logprob}),
                                    **{text_of(t): v for t, v in e.top}})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_logprobs(items: list[Entry], text_of: TokenTexts) -> dict:
    def one(token_id: int, logprob: float) -> dict:
        text = text_of(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
    # chat's logprob is never null: OpenAI's own "too unlikely to tell" is -9999
    return {"content": [{**one(e.token_id, -9999.0 if e.logprob is None else e.logprob),
                         "top_logprobs": [one(t, v) for t, v in e.top or []]}
                        for e in items]}
