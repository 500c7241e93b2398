"""The OpenAI API's answer to a `max_tokens` beyond what the context leaves after the prompt: a 400
naming both numbers, as vLLM's, before anything runs. (The gRPC API caps it at the context instead,
as its proto documents; router/validation.py.)
"""
from __future__ import annotations

import asyncio
import math

from baton.router import validation
from baton.router.openai.errors import HTTPError
from baton.v1 import router_pb2

# special tokens a tokenizer may add around a text (BOS, a SentencePiece prefix...): a byte-level
# tokenizer makes at most one token per byte of the text besides them
ADDED_TOKENS = 8


def requested(body: dict, chat: bool) -> tuple[str, int] | None:
    """The field that set the output's length, and its value; None when the request set none
    (sampling.py: sampling has checked its type; the first of the two a chat gives wins there too)."""
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    for name in names:
        value = body.get(name)
        if value is not None:
            return name, value
    return None


async def check_max_tokens(svc, body: dict, chat: bool, prompts: list[router_pb2.GenerateRequest]) -> None:
    """An HTTPError 400 when a prompt leaves less room in the model's context than the request's
    max_tokens. A prompt is tokenized here only where a bound on its length cannot rule that out."""
    given = requested(body, chat)
    if given is None or given[1] < 1:                  # (0: echo's prompt alone)
        return
    name, value = given
    context = svc.max_model_len
    for req in prompts:
        if value + _length_bound(req) <= context:
            continue
        n = await prompt_length(svc, req)
        if n < context < n + value:                    # a prompt too long on its own: the router's 400 says so
            raise HTTPError(400, f"{name} {value} is too large: the prompt has {n} tokens and the model's context "
                                 f"is {context}, so at most {context - n} can be generated", param=name)


def _length_bound(req: router_pb2.GenerateRequest) -> float:
    """A prompt's most tokens, without tokenizing it (a chat's template may add any: no bound)."""
    kind = req.WhichOneof("input")
    if kind == "tokens":
        return len(req.tokens.ids)
    if kind == "text":
        return len(req.text.encode()) + ADDED_TOKENS
    return math.inf


async def prompt_length(svc, req: router_pb2.GenerateRequest) -> int:
    """The prompt's token count as RouterService.generate makes it (a chat's images expanded)."""
    images = svc.images.collect(req)
    if images:                                         # decoding takes a while: not on the event loop
        await asyncio.to_thread(svc.images.measure, images)
    return len(validation.prompt_ids(req, svc.tokenizer, svc.model_info.vocab_size, images, svc.images,
                                     svc.cfg.trust_request_chat_template))
