"""Speculative decoding: propose a few tokens per sequence, verify them in one forward.

Torch-free. Each step, while the batch is small enough to have compute to spare, a proposer
guesses up to k next tokens of every running sequence; the scheduler feeds the last token and
the guesses as one chunk (a multi-token decode), the runner samples a token at each of the
k + 1 positions, exactly as a plain decode step would sample there (the same temperature,
top-k/top-p, and for seeded requests the same noise, keyed by seed and position), and the
sequence keeps the guesses up to the first one that differs from what was sampled, plus the
sampled token at that point. So the tokens are the ones plain decoding gives, token for token
(greedy and seeded), and for unseeded sampling each kept token is a draw from the target
distribution given the tokens before it.

For a proposer that guesses one token (a point mass, as n-gram lookup does), this comparison
accepts a guess d with probability p(d), which is what rejection sampling's min(1, p(d)/q(d))
gives with q(d) = 1; on a rejection it emits a token drawn from p given "not d", as rejection
sampling's residual max(0, p - q) does. A draft model's proposals (a distribution q) would need
the residual step; none ships here (docs/benchmarks.md).

Proposers:
- `ngram` (prompt lookup): the longest suffix of the sequence (up to `max_ngram` tokens) that
  occurred earlier in it; the guesses are the tokens that followed its latest earlier
  occurrence. No weights; strong where outputs copy spans of the input (editing, summaries,
  code, extraction).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from baton.engine.config import SPECULATIVE_METHODS as METHODS
from baton.engine.sequence import Sequence


class NgramProposer:
    def __init__(self, k: int, max_ngram: int = 4, min_ngram: int = 1, window: int = 4096):
        self.k, self.max_ngram, self.min_ngram, self.window = k, max_ngram, min_ngram, window

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """Up to min(k, limit) guesses of what follows `token_ids` (the last `window` tokens searched)."""
        limit = min(self.k, limit)
        if limit <= 0 or len(token_ids) < self.min_ngram + 1:
            return []
        ids = np.asarray(token_ids[-self.window:], dtype=np.int64)
        n_ids = len(ids)
        for n in range(min(self.max_ngram, n_ids - 1), self.min_ngram - 1, -1):
            pattern = ids[n_ids - n:]
            # every earlier start i (i + n < n_ids, so something follows) where ids[i:i+n] == pattern
            windows = np.lib.stride_tricks.sliding_window_view(ids[:n_ids - 1], n)
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n              # the latest occurrence: the most local context
                return ids[start:start + limit].tolist()
        return []


@dataclass(slots=True)
class SpeculationStats:
    """Counters for metrics: steps that speculated, tokens proposed and accepted, and how many
    guesses each verified sequence kept (index = accepted count, 0..k)."""
    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    accepted_lengths: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        if accepted >= len(self.accepted_lengths):
            self.accepted_lengths.extend([0] * (accepted + 1 - len(self.accepted_lengths)))
        self.accepted_lengths[accepted] += 1

    @property
    def mean_accepted(self) -> float:
        """Tokens a verified sequence gained per step: accepted guesses + the sampled one."""
        n = sum(self.accepted_lengths)
        return (self.accepted + n) / n if n else 0.0


class Speculator:
    """Decides, each step, which running sequences get guesses and how many."""

    def __init__(self, method: str, k: int, max_batch: int):
        if method not in METHODS:
            raise ValueError(f"unknown speculative method {method!r}: use one of {', '.join(METHODS)}")
        self.proposer = NgramProposer(k)
        self.k = k
        self.max_batch = max_batch
        self.stats = SpeculationStats()

    def active(self, running: list[Sequence]) -> bool:
        """Speculate only while the batch is small: verifying k guesses costs k more rows of
        compute per sequence, which a large batch does not have to spare (it steps aside)."""
        return 0 < len(running) <= self.max_batch

    def propose(self, running: list[Sequence]) -> None:
        """Set each decoding sequence's `draft` (cleared for the others)."""
        for seq in running:
            seq.draft = []
            p = seq.params
            # penalties count the tokens before each row and logprobs are per sampled token: such
            # requests decode one token a step (their rows would need the guesses counted in)
            if seq.num_uncomputed_tokens != 1 or seq.num_pending_tokens or not p.speculative \
                    or p.processes_logits or p.logprobs is not None \
                    or seq.kv_ticket is not None and seq.kv_ticket.side == "prefill":
                continue
            # room left: max_tokens and the context both cap the tokens a step may add (guesses + 1)
            left = min(seq.params.max_tokens - seq.num_completion_tokens, seq.max_model_len - seq.num_tokens) - 1
            seq.draft = self.proposer.propose(seq.token_ids, left)


def accept(draft: list[int], sampled: list[int]) -> list[int]:
    """The tokens a verified sequence keeps: its guesses up to the first that differs from the
    token sampled at that position, then the sampled one (len(sampled) == len(draft) + 1)."""
    kept = []
    for guess, token in zip(draft, sampled, strict=False):
        if guess != token:
            break
        kept.append(guess)
    kept.append(sampled[len(kept)])
    return kept
