"""Turns sampled tokens into streamed deltas: text, stop strings, finish reasons, usage.

Torch-free. Stop strings are cut from the text; the streamed text holds back any tail that
could still become a stop string, so no client ever sees a stop string or half of one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from baton.engine.requests.detokenizer import make_detokenizer
from baton.engine.requests.logprobs import TokenLogprob
from baton.engine.scheduling.sequence import FinishReason, Sequence


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
    logprobs: list[TokenLogprob | None] | None = None         # of new_token_ids, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # of the prompt (first: None), in the first output


@dataclass(slots=True)
class CompletionOutput:
    """The offline API's result for one prompt: its first sample, and with SamplingParams.n > 1
    the others in `outputs` (vLLM's `RequestOutput.outputs`; `outputs[0]` is this one)."""
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    cached_tokens: int = 0
    logprobs: list[TokenLogprob | None] | None = None         # of token_ids (SamplingParams.logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # of prompt_token_ids (prompt_logprobs)
    index: int = 0                                            # which sample of its prompt
    samples: list[CompletionOutput] = field(default_factory=list, repr=False)   # samples 1..n-1

    @property
    def outputs(self) -> list[CompletionOutput]:
        """Every sample of the prompt, in order: this one, then the rest."""
        return [self, *self.samples]


class TextStream:
    """One request's text as its tokens arrive: `add` a token, `take` the text new since the
    last take. Whole characters only; stop strings are cut from the text (`stopped` says one
    matched: the token just added completed it), and while the request runs, a tail that could
    still become a stop string is held back. The engine, the worker's front and the router (after
    a migration) all stream text through this one class. As in vLLM, no stop string ends the
    text before `min_tokens` tokens."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str], min_tokens: int = 0):
        self.detok = make_detokenizer(tokenizer, prompt_token_ids)
        self.stops = list(stop)
        self.min_tokens = min_tokens
        self.added = 0
        self.floor = 0                      # a stop string must end past the text of the first min_tokens - 1
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self.sent_chars = 0
        self.stopped = False

    @property
    def text(self) -> str:
        return self.detok.text

    def add(self, token_id: int) -> bool:
        """Feed one token; True once a stop string ended the text (later tokens change nothing)."""
        if not self.stopped:
            self.detok.add(token_id)
            self.added += 1
            if self.added < self.min_tokens:
                self.floor = len(self.detok.text)
            elif self.stops:
                self._cut_at_stop()
        return self.stopped

    def take(self, finished: bool) -> str:
        """The text new since the last take. `finished`: the request ended, so nothing is held
        back (an incomplete character is flushed, and may still complete a stop string)."""
        if finished and not self.stopped:
            self.detok.flush()
            if self.stops and self.added >= self.min_tokens:
                self._cut_at_stop()
        text = self.detok.text
        end = len(text) if finished or self.stopped else max(self.sent_chars, len(text) - self.holdback)
        delta = text[self.sent_chars:end]
        self.sent_chars = end
        return delta

    def _cut_at_stop(self) -> None:
        text = self.detok.text
        start = max(0, self.sent_chars - self.holdback - 1)
        hits = [i for i in (text.find(s, max(start, self.floor - len(s) + 1)) for s in self.stops) if i >= 0]
        if hits:
            self.detok.text = text[:min(hits)]
            self.stopped = True


class RequestState:
    """Per-request streaming state next to its Sequence."""

    def __init__(self, seq: Sequence, tokenizer):
        self.seq = seq
        self.text = TextStream(tokenizer, seq.token_ids[:seq.num_prompt_tokens], seq.params.stop,
                               seq.params.min_tokens) if tokenizer is not None else None
        self.emitted_tokens = 0

    @property
    def stopped_by_string(self) -> bool:
        return self.text is not None and self.text.stopped

    def update(self) -> RequestOutput:
        """Consume tokens appended since the last call; may mark a stop-string match."""
        seq = self.seq
        completion = seq.completion_token_ids
        new_ids = completion[self.emitted_tokens:]
        first, self.emitted_tokens = self.emitted_tokens, len(completion)
        finished = seq.is_finished
        delta = ""
        if self.text is not None:
            for j, t in enumerate(new_ids):
                if self.text.add(t):
                    # a stop string ended the text at this token: a step that added several
                    # (speculation) keeps none after it, as one token at a time would have
                    extra = len(new_ids) - j - 1
                    if extra and not seq.is_finished:
                        seq.drop_last(extra)
                        new_ids = new_ids[:j + 1]
                        self.emitted_tokens -= extra
                    break
            finished = finished or self.text.stopped
            delta = self.text.take(finished)
        reason = FinishReason.STOP if self.stopped_by_string else seq.finish_reason
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=new_ids, new_text=delta, finished=finished,
            finish_reason=reason.value if finished and reason else None,
            prompt_tokens=seq.num_prompt_tokens, completion_tokens=seq.num_completion_tokens,
            cached_tokens=seq.num_cached_tokens,
            logprobs=_entries(seq.logprobs, seq.num_prompt_tokens + first, len(new_ids))
            if seq.params.logprobs is not None else None,
            prompt_logprobs=_entries(seq.prompt_logprobs, 0, seq.num_prompt_tokens)
            if seq.params.prompt_logprobs is not None and first == 0 and (new_ids or finished) else None,
        )


def _entries(records: dict | None, start: int, count: int) -> list[TokenLogprob | None]:
    records = records or {}
    return [records.get(i) for i in range(start, start + count)]
