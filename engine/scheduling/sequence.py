"""A request's token sequence and its place in the engine: status, KV blocks, progress.

Torch-free. `num_computed_tokens` counts tokens whose KV is in the cache; the scheduler
feeds the rest to the model, in chunks if the budget requires. With asynchronous scheduling a
step's sampled token is appended as a placeholder (`PENDING`) when the step is launched and
filled in when its value is back, so the next step can be scheduled meanwhile;
`num_pending_tokens` counts those not yet filled in (the last ones). A step that verifies guesses
while the next is scheduled past it (engine/speculation/speculative.py: scheduled as if every guess held) puts its
guesses in as tokens too, `num_unverified_tokens` of them, until its tokens are back: then they stay,
or the sequence rolls back to the ones that held (`rollback`, a new `spec_epoch`). The known tokens,
what is emitted and cached, are the leading ones neither pending nor unverified.
"""
from __future__ import annotations

import itertools
from enum import Enum, auto

from baton.engine.requests.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    AWAITING_KV = auto()        # decode side: blocks reserved, its prompt's KV coming from a prefill worker
    FINISHED = auto()


class FinishReason(str, Enum):  # noqa: UP042  (str() of a member stays "FinishReason.STOP")
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


_ids = itertools.count()
PENDING = -1        # a sampled token whose value is still on the device


class Sequence:
    __slots__ = (
        "seq_id", "request_id", "token_ids", "num_prompt_tokens", "num_computed_tokens",
        "num_cached_tokens", "block_table", "status", "params", "finish_reason", "max_model_len",
        "arrival", "num_preemptions", "sampling_seed", "num_hashed_blocks", "kv_ticket",
        "num_blocks_handed_off", "num_pending_tokens", "mm", "logprobs", "prompt_logprobs",
        "prompt_token_set", "draft", "ngram_index", "draft_probs", "spec_hidden", "spec_misses", "spec_resume_step",
        "grammar", "num_unverified_tokens", "spec_next", "spec_epoch",
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 max_model_len: int, arrival: float = 0.0):
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0          # prompt tokens served by the prefix cache
        self.block_table: list[int] = []
        self.num_hashed_blocks = 0          # leading blocks already registered in the prefix cache
        self.status = SequenceStatus.WAITING
        self.params = params
        self.finish_reason: FinishReason | None = None
        self.max_model_len = max_model_len
        self.arrival = arrival
        self.num_preemptions = 0
        self.sampling_seed = params.seed
        self.kv_ticket = None               # KVTicket of a handed-off request (engine/kv_handoff.py)
        self.num_blocks_handed_off = 0      # prefill side: prompt blocks already packed into pieces
        self.num_pending_tokens = 0         # trailing PENDING tokens (asynchronous scheduling)
        self.mm = None                      # MultimodalPrompt (engine/scheduling/multimodal.py) of a prompt with images
        self.draft: list[int] = []          # guesses of its next tokens for this step (engine/speculation/speculative.py)
        self.ngram_index = None             # ...and where its n-grams occur (speculative.NgramIndex)
        self.draft_probs = None             # ...a draft head's q of each sampled guess (engine/runner/draft_head.py)
        self.spec_hidden = None             # ...and the head's output at its last kept token: (tensor, row)
        self.spec_misses = 0                # ...guessing rounds in a row that kept nothing (it backs off)
        self.spec_resume_step = 0           # ...the engine step from which it guesses again
        self.num_unverified_tokens = 0      # ...guesses in token_ids whose verifying step is in flight
        self.spec_next = None               # ...where the n-gram match continues after the guesses in flight
        self.spec_epoch = 0                 # ...rollbacks so far (steps scheduled before one are void for it)
        self.logprobs = None                # {token index: TokenLogprob} of sampled tokens (params.logprobs)
        self.prompt_logprobs = None         # {token index: TokenLogprob} of prompt tokens (params.prompt_logprobs)
        self.prompt_token_set = None        # the prompt's distinct tokens, once a repetition penalty needs them
        self.grammar = None                 # GrammarState of structured output (engine/requests/structured_output.py)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose value is known (all but the pending and unverified ones)."""
        return len(self.token_ids) - self.num_pending_tokens - self.num_unverified_tokens

    @property
    def num_completion_tokens(self) -> int:
        return self.num_known_tokens - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:self.num_known_tokens]

    @property
    def surely_done(self) -> bool:
        """Finished by length once its pending tokens are filled in, whatever their values."""
        limit = min(self.params.max_tokens + self.num_prompt_tokens, self.max_model_len)
        return len(self.token_ids) >= limit

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def block_key(self, i: int, block_size: int) -> tuple | None:
        """What block i is cached under: its tokens (and the digests of the images it holds part
        of); None: it must not be cached."""
        tokens = tuple(self.token_ids[i * block_size:(i + 1) * block_size])
        return tokens if self.mm is None else self.mm.block_key(i * block_size, (i + 1) * block_size, tokens)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def append_pending(self) -> int:
        """A placeholder for a token being sampled on the device; returns its index."""
        self.token_ids.append(PENDING)
        self.num_pending_tokens += 1
        return len(self.token_ids) - 1

    def fill_pending(self, index: int, token_id: int) -> None:
        """The sampled value of the placeholder at `index` (the oldest pending one)."""
        self.token_ids[index] = token_id
        self.num_pending_tokens -= 1

    def drop_last(self, n: int) -> None:
        """Forget the last n known tokens, and any after them (a stop string ended the text before them)."""
        if n > 0:
            self.rollback(self.num_known_tokens - n)

    def drop_pending(self) -> None:
        """Forget the placeholders and unverified guesses (the request ended before they were filled in)."""
        if self.num_pending_tokens or self.num_unverified_tokens:
            del self.token_ids[self.num_known_tokens:]
            self.num_pending_tokens = self.num_unverified_tokens = 0

    def rollback(self, length: int) -> None:
        """Keep the first `length` tokens (all known): the steps scheduled past them are void for it."""
        del self.token_ids[length:]
        self.num_pending_tokens = self.num_unverified_tokens = 0
        self.spec_next = None
        self.spec_epoch += 1

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, status={self.status.name})")
