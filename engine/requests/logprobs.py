"""Log-probabilities of tokens: what a request asked for with `logprobs` / `prompt_logprobs`.

A token's logprob is the log-softmax of the model's raw logits at its position (before
temperature, penalties and masks: what vLLM returns by default), with the N most likely tokens
there. The runner computes them on the device (engine/runner/logprobs_device.py); these records carry
them, torch-free, through the engine, the core's frames, the KV hand-off's metadata (the first
token and the prompt's are computed on the prefill worker) and the wire.
"""
from __future__ import annotations

import json
from typing import NamedTuple


class TokenLogprob(NamedTuple):
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]      # the most likely tokens at this position, most likely first


def encode(entries: list[TokenLogprob | None]) -> str:
    """For the hand-off's string metadata."""
    return json.dumps([None if e is None else [e.token_id, e.logprob, [list(t) for t in e.top]] for e in entries])


def decode(text: str) -> list[TokenLogprob | None]:
    return [None if e is None else TokenLogprob(int(e[0]), float(e[1]), tuple((int(i), float(v)) for i, v in e[2]))
            for e in json.loads(text)]
