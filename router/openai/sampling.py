"""An OpenAI request body -> baton.v1 SamplingParams, and what its response must carry.

Each field's range is the router's validation's to check (router/validation.py), but a value of the
wrong type, or a field whose shape OpenAI defines (logit_bias's string keys, logprobs' meaning per
endpoint), is refused here with a 400 naming it.
"""
from __future__ import annotations

from dataclasses import dataclass

from baton.engine.requests.sampling_params import MAX_LOGPROBS, sample_seed
from baton.router.openai.errors import HTTPError
from baton.router.openai.structured import structured
from baton.v1 import router_pb2


@dataclass(slots=True)
class Shape:
    """What a response carries beyond text."""
    logprobs: bool = False          # completions: logprobs set; chat: logprobs true
    echo: bool = False              # completions: the prompt before the text
    echo_only: bool = False         # ...and max_tokens 0: the prompt alone (one token is run, not shown)


def choice_request(prompt: router_pb2.GenerateRequest, sampling: router_pb2.SamplingParams, j: int):
    """The request of choice `j` of a prompt: choice 0 is the request as sent; with a seed, choice j
    samples with a seed of its own derived from it (the same choices for the same seed), so the
    choices differ, yet each is reproducible."""
    req = router_pb2.GenerateRequest()
    req.CopyFrom(prompt)
    req.sampling.CopyFrom(sampling)
    if j and sampling.HasField("seed"):
        req.sampling.seed = sample_seed(sampling.seed, j)
    return req


def number(body: dict, name: str, kind: type, lo=None) -> float | int | None:
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, (int, float)) if kind is float else isinstance(value, int)
    if not ok or isinstance(value, bool):
        raise HTTPError(400, f"{name} must be {'a number' if kind is float else 'an integer'}, got {value!r}",
                        param=name)
    if lo is not None and value < lo:
        raise HTTPError(400, f"{name} must be >= {lo}, got {value}", param=name)
    return value


def sampling(body: dict, chat: bool) -> tuple[router_pb2.SamplingParams, Shape]:
    """OpenAI's fields -> baton.v1.SamplingParams (ranges are checked by the router's validation),
    and what the response carries."""
    s = router_pb2.SamplingParams()
    shape = _logprobs(body, chat, s)
    for name in ("temperature", "top_p"):
        v = number(body, name, float)
        if v is not None:
            setattr(s, name, v)
    top_k = number(body, "top_k", int)
    if top_k is not None and top_k != -1:            # vLLM's -1 means off, as Baton's 0
        if top_k < 0:
            raise HTTPError(400, f"top_k must be >= 0 (or -1: off), got {top_k}", param="top_k")
        s.top_k = min(top_k, 2**31 - 1)              # (past the vocabulary: every token, as vLLM's)
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    for name in names:
        v = number(body, name, int)
        if v is not None:
            if v == 0 and shape.echo:                  # as vLLM: the prompt (and its logprobs) alone
                shape.echo_only, v = True, 1
            if v < 1:
                raise HTTPError(400, f"{name} must be >= 1 (0 only with echo), got {v}", param=name)
            s.max_tokens = min(v, 2**32 - 1)
            break
    else:
        if not chat:
            s.max_tokens = 16                       # OpenAI's default for /v1/completions
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
            raise HTTPError(400, "stop must be a string or a list of strings", param="stop")
        s.stop.extend(stop)
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise HTTPError(400, "stop_token_ids must be a list of token ids", param="stop_token_ids")
    if any(t >= 2**32 for t in ids):                   # (the vocabulary's bound: the router's validation)
        raise HTTPError(400, f"stop_token_ids: token id {max(ids)} is outside the vocabulary", param="stop_token_ids")
    s.stop_token_ids.extend(ids)
    seed = number(body, "seed", int)
    if seed is not None:
        s.seed = seed % 2**64                       # OpenAI allows negative seeds
    ignore = body.get("ignore_eos", False)
    if not isinstance(ignore, bool):
        raise HTTPError(400, "ignore_eos must be true or false", param="ignore_eos")
    s.ignore_eos = ignore
    speculative = body.get("speculative")               # Baton's: false opts out of --speculative-method
    if speculative is not None:
        if not isinstance(speculative, bool):
            raise HTTPError(400, "speculative must be true or false", param="speculative")
        s.speculative = speculative
    priority = number(body, "priority", int)           # vLLM's: lower first (--scheduling-policy priority)
    if priority is not None:
        if not -2**31 <= priority < 2**31:
            raise HTTPError(400, f"priority must be a 32-bit integer, got {priority}", param="priority")
        s.priority = priority
    _processing(body, s)
    spec = structured(body)
    if spec is not None:
        s.structured.CopyFrom(spec)
    return s, shape


def _logprobs(body: dict, chat: bool, s: router_pb2.SamplingParams) -> Shape:
    """completions: logprobs=N, echo; chat: logprobs, top_logprobs."""
    shape = Shape()
    if chat:
        wanted = body.get("logprobs")
        if wanted not in (None, True, False):
            raise HTTPError(400, "logprobs must be true or false", param="logprobs")
        top = _alternatives(body, "top_logprobs")
        if top is not None and not wanted:
            raise HTTPError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if wanted:
            shape.logprobs = True
            s.logprobs = top or 0
        return shape
    n = _alternatives(body, "logprobs")
    echo = body.get("echo")
    if echo not in (None, True, False):
        raise HTTPError(400, "echo must be true or false", param="echo")
    shape.echo = bool(echo)
    if n is not None:
        shape.logprobs = True
        s.logprobs = n
        if shape.echo:
            s.prompt_logprobs = s.logprobs
    return shape


def _alternatives(body: dict, name: str) -> int | None:
    """top_logprobs (chat) or logprobs (completions): how many alternatives a token's entry lists."""
    n = number(body, name, int, lo=0)
    if n is not None and n > MAX_LOGPROBS:
        raise HTTPError(400, f"{name} must be in [0, {MAX_LOGPROBS}] (the number of alternatives), got {n}",
                        param=name)
    return n


def _processing(body: dict, s: router_pb2.SamplingParams) -> None:
    """Penalties, min_p, min_tokens and logit_bias (ranges: the router's validation)."""
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
        v = number(body, name, float)
        if v is not None:
            setattr(s, name, v)
    v = number(body, "min_tokens", int, lo=0)
    if v is not None:
        s.min_tokens = min(v, 2**32 - 1)
    bias = body.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise HTTPError(400, "logit_bias must be an object of token id -> bias", param="logit_bias")
    for key, value in bias.items():
        try:
            token = int(key)                          # JSON keys are strings: "1234"
        except ValueError:
            token = -1
        if token < 0 or token >= 2**32 or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise HTTPError(400, f"logit_bias: {key!r}: {value!r} is not a token id -> number", param="logit_bias")
        s.logit_bias[token] = value
