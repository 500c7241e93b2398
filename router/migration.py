"""Migration: a stream whose worker died goes on, on a survivor, as if nothing happened.

The router keeps a ledger of what the client has been sent. When the decode (or colocated)
worker under a running stream dies, the request is re-admitted with prompt + tokens already
sent as its prompt and the rest of its token budget; the survivor's prefill of that prompt
rebuilds the KV and it continues. Its tokens are the fault-free ones: greedy is
deterministic, and seeded sampling hashes (seed, absolute position), which migration keeps.

Text is the subtle part: the dead worker may have held text back (half a UTF-8 character,
the start of a possible stop string), and a stop string may straddle the two workers. So
after a migration the router makes the text itself from the tokens, with the engine's own
detokenizer seeded exactly as the first worker's was, and checks the stop strings across
the seam; the survivor's text is not used.

A stream moved with its KV (a role switch, router/moves.py) continues the same way, but with no
prefill: the next worker takes the KV of every token but the last, and the last token as its
first (`continuation`), which the client already has.
"""
from __future__ import annotations

from dataclasses import replace

from baton.engine.requests.detokenizer import make_detokenizer
from baton.engine.requests.sampling_params import SamplingParams
from baton.v1 import router_pb2

FINISHED = router_pb2.FINISH_REASON_UNSPECIFIED


class Ledger:
    """What one request's client has seen; how to continue it elsewhere."""

    def __init__(self, prompt: list[int], params: SamplingParams, tokenizer, limit: int):
        self.prompt = prompt
        self.params = params
        self.tokenizer = tokenizer
        self.limit = limit              # migrations allowed for this request
        self.migrations = 0
        self.moves = 0                  # times it moved with its KV (no prefill)
        self.tokens: list[int] = []     # sent to the client
        self.sent_chars = 0             # length of the text sent to the client
        self.detok = None                # the router's own text, once migrated
        self.holdback = max((len(s) for s in params.stop), default=1) - 1
        self.floor = 0                  # (min_tokens: a stop string must end past this much text)

    @property
    def migrated(self) -> bool:
        return self.detok is not None

    @property
    def budget(self) -> int:
        """Tokens the request may still generate."""
        return self.params.max_tokens - len(self.tokens)

    def request(self) -> tuple[list[int], SamplingParams]:
        """The prompt and sampling to send to the next worker."""
        if not self.tokens:
            return self.prompt, self.params
        return self.prompt + self.tokens, replace(self.params, max_tokens=self.budget, prompt_logprobs=None,
                                                  min_tokens=max(0, self.params.min_tokens - len(self.tokens)),
                                                  prior_output_tokens=self.params.prior_output_tokens + len(self.tokens))

    def continuation(self) -> tuple[list[int], SamplingParams]:
        """A stream moving with its KV: the prompt whose KV moves (every token so far but the last,
        which arrives as the first token) and the sampling that goes on from there."""
        n = len(self.tokens)
        return self.prompt + self.tokens[:-1], replace(
            self.params, max_tokens=self.budget + 1, prompt_logprobs=None,
            min_tokens=max(0, self.params.min_tokens - (n - 1)),
            prior_output_tokens=self.params.prior_output_tokens + n - 1)

    def why_not(self) -> str | None:
        """None if the stream may migrate once more, else why not."""
        if self.limit <= 0:
            return "migration is off (--max-migrations 0)"
        if self.migrations >= self.limit:
            return f"it already migrated {self.migrations} time(s), the --max-migrations limit"
        return None

    def migrate(self) -> None:
        """Before the next attempt: take over the text from here on."""
        self.migrations += 1
        self.take_over_text()

    def take_over_text(self) -> None:
        """From here on the text is made here, from the tokens (the next worker's is not used)."""
        if self.detok is None and self.tokenizer is not None:
            self.detok = make_detokenizer(self.tokenizer, self.prompt)
            for t in self.tokens:
                self.detok.add(t)
            if len(self.tokens) < self.params.min_tokens:
                self.floor = len(self.detok.text)

    def out_of_budget(self, rid: str) -> router_pb2.GenerateResponse | None:
        """The last chunk, when the dead worker had sent every token but not the finish."""
        if self.budget > 0:
            return None
        return self._last(rid, [], router_pb2.FINISH_REASON_LENGTH, None)

    def relay(self, rid: str, chunk) -> router_pb2.GenerateResponse:
        """One worker chunk -> the client's chunk (with the text made here once migrated), and
        its tokens' logprobs (the prompt's: sent by the first worker only)."""
        resp = self._relay(rid, chunk)
        if chunk.logprobs:
            resp.logprobs.extend(chunk.logprobs[:len(resp.token_ids)])
        if chunk.prompt_logprobs:
            resp.prompt_logprobs.extend(chunk.prompt_logprobs)
        return resp

    def _relay(self, rid: str, chunk) -> router_pb2.GenerateResponse:
        ids = list(chunk.token_ids)
        usage = chunk.usage if chunk.HasField("usage") else None
        if self.detok is None:
            self.tokens.extend(ids)
            self.sent_chars += len(chunk.text)
            return router_pb2.GenerateResponse(request_id=rid, token_ids=ids, text=chunk.text,
                                               finish_reason=chunk.finish_reason, usage=self._usage(usage))
        for i, t in enumerate(ids):
            self.detok.add(t)
            if self._cut_at_stop(len(self.tokens) + i + 1):
                return self._last(rid, ids[:i + 1], router_pb2.FINISH_REASON_STOP, usage, stopped=True)
        if chunk.finish_reason != FINISHED:
            return self._last(rid, ids, chunk.finish_reason, usage)
        self.tokens.extend(ids)
        end = max(self.sent_chars, len(self.detok.text) - self.holdback)
        text = self.detok.text[self.sent_chars:end]
        self.sent_chars = end
        return router_pb2.GenerateResponse(request_id=rid, token_ids=ids, text=text)

    def _last(self, rid, ids, reason, usage, stopped: bool = False) -> router_pb2.GenerateResponse:
        self.tokens.extend(ids)
        text = ""
        if self.detok is not None:
            if not stopped:
                self.detok.flush()
                if self._cut_at_stop(len(self.tokens)):
                    reason = router_pb2.FINISH_REASON_STOP
            text = self.detok.text[self.sent_chars:]
        self.sent_chars += len(text)
        return router_pb2.GenerateResponse(request_id=rid, token_ids=ids, text=text, finish_reason=reason,
                                           usage=self._usage(usage, always=True))

    def _cut_at_stop(self, count: int) -> bool:
        """Cut the text at the first stop string that ends in it (searching across the seam)."""
        if not self.params.stop:
            return False
        text = self.detok.text
        if count < self.params.min_tokens:          # as TextStream: none ends before min_tokens
            self.floor = len(text)
            return False
        start = max(0, self.sent_chars - self.holdback - 1)
        hits = [i for i in (text.find(s, max(start, self.floor - len(s) + 1)) for s in self.params.stop) if i >= 0]
        if not hits:
            return False
        self.detok.text = text[:min(hits)]
        return True

    def _usage(self, usage, always: bool = False) -> router_pb2.Usage | None:
        """Usage as the client's request saw it: its prompt, every token it was sent."""
        if usage is None and not always:
            return None
        if not self.migrations and not self.moves and usage is not None:
            return usage
        cached = min(usage.cached_prompt_tokens, len(self.prompt)) if usage is not None else 0
        return router_pb2.Usage(prompt_tokens=len(self.prompt), completion_tokens=len(self.tokens),
                                cached_prompt_tokens=cached)
