"""Turns sampled tokens into streamed deltas: text, stop strings, finish reasons, usage.

Torch-free. Stop strings are cut from the text; the streamed text holds back any tail that
could still become a stop string, so no client ever sees a stop string or half of one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from baton.engine.detokenizer import make_detokenizer
from baton.engine.sequence import FinishReason, Sequence


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None      # "stop" | "length" | "abort" once finished
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None              # set when the request ended by a failure, not by itself


@dataclass(slots=True)
class CompletionOutput:
    """The offline API's result for one prompt."""
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    cached_tokens: int = 0


class RequestState:
    """Per-request streaming state next to its Sequence."""

    def __init__(self, seq: Sequence, tokenizer):
        self.seq = seq
        self.stops = list(seq.params.stop)
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self.detok = make_detokenizer(tokenizer, seq.token_ids[:seq.num_prompt_tokens]) \
            if tokenizer is not None else None
        self.emitted_tokens = 0
        self.emitted_chars = 0
        self.stopped_by_string = False

    def update(self) -> RequestOutput:
        """Consume tokens appended since the last call; may mark a stop-string match."""
        seq = self.seq
        completion = seq.completion_token_ids
        new_ids = completion[self.emitted_tokens:]
        self.emitted_tokens = len(completion)
        finished = seq.is_finished
        if self.detok is not None:
            for t in new_ids:
                self.detok.add(t)
            if finished:
                self.detok.flush()
            if self.stops and self._cut_at_stop():
                finished = True
        text = self.detok.text if self.detok is not None else ""
        end = len(text) if finished else max(self.emitted_chars, len(text) - self.holdback)
        delta = text[self.emitted_chars:end]
        self.emitted_chars = end
        reason = FinishReason.STOP if self.stopped_by_string else seq.finish_reason
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=new_ids, new_text=delta, finished=finished,
            finish_reason=reason.value if finished and reason else None,
            prompt_tokens=seq.num_prompt_tokens, completion_tokens=seq.num_completion_tokens,
            cached_tokens=seq.num_cached_tokens,
        )

    def _cut_at_stop(self) -> bool:
        if self.stopped_by_string:
            return True
        text = self.detok.text
        start = max(0, self.emitted_chars - self.holdback - 1)
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        if not hits:
            return False
        self.detok.text = text[:min(hits)]
        self.stopped_by_string = True
        return True
