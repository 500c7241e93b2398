"""Speculative decoding: propose a few tokens per sequence, verify them in one forward.

Torch-free. Each step, while the batch is small enough to have compute to spare, a proposer
guesses up to k next tokens of every running sequence (fewer each as the batch grows: GUESS_ROWS
guessed tokens a step in all); the scheduler feeds the last token and the guesses as one chunk
(a multi-token decode), the runner samples a token at each of the k + 1 positions, exactly as a
plain decode step would sample there (the same temperature,
top-k/top-p, and for seeded requests the same noise, keyed by seed and position), and the
sequence keeps the guesses up to the first one that differs from what was sampled, plus the
sampled token at that point. So the tokens are the ones plain decoding gives, token for token
(greedy and seeded), and for unseeded sampling each kept token is a draw from the target
distribution given the tokens before it.

For a proposer that guesses one token (a point mass, as n-gram lookup does), this comparison
accepts a guess d with probability p(d), which is what rejection sampling's min(1, p(d)/q(d))
gives with q(d) = 1; on a rejection it emits a token drawn from p given "not d", as rejection
sampling's residual max(0, p - q) does. A draft head's proposals drawn from a distribution q take
the exact rejection sampler instead (engine/runner/draft_head.py).

Scheduled ahead (n-gram, with asynchronous scheduling, as on accelerators): a verifying step's
guesses go in as tokens of the sequence (unverified: neither emitted nor cached) and the next step
is queued before its tokens are back, as if every guess held: its input is the token being sampled
after them (taken on the device) and its guesses go on where the n-gram match left off. When the
verifying step's tokens come back, a sequence whose guesses all held keeps them; one that kept fewer
rolls back to those (a new epoch: the rows of the steps queued past them are void, and the KV they
wrote past its length is overwritten later). Acceptance on copying workloads is mostly all or
nothing, so most verifying steps overlap the host's work for the next with the device's.

Proposers:
- `ngram` (prompt lookup): the longest suffix of the sequence (up to `max_ngram` tokens) that
  occurred earlier in it; the guesses are the tokens that followed its latest earlier
  occurrence. No weights; strong where outputs copy spans of the input (editing, summaries,
  code, extraction).
- `eagle3`: an EAGLE-3 draft head (models/eagle3.py, engine/runner/draft_head.py) drafts k tokens from
  the target's hidden states, one batch of head steps for every guessing sequence.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from baton.engine.config import SPECULATIVE_METHODS as METHODS
from baton.engine.scheduling.sequence import PENDING, Sequence

if TYPE_CHECKING:
    from baton.engine.scheduling.scheduler import ScheduledSeq

HEAD_STATE_META = "eagle3_hidden"       # KV hand-off metadata: a draft head's last state (engine/runner/draft_head.py)


class NgramIndex:
    """Where each n-gram (n = 1..max_ngram) of one sequence last ended, kept up to date as tokens
    arrive: a lookup per step instead of a scan of the whole sequence."""

    __slots__ = ("ends", "upto")

    def __init__(self, max_ngram: int):
        self.ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]
        self.upto = 0           # n-grams ending at positions <= upto are indexed (end = exclusive index)

    def extend(self, token_ids: list[int], end: int) -> None:
        """Index the n-grams ending at upto+1 .. end (exclusive ends: tokens[e-n:e])."""
        for e in range(self.upto + 1, end + 1):
            for n in range(1, min(e, len(self.ends) - 1) + 1):
                self.ends[n][tuple(token_ids[e - n:e])] = e
        self.upto = max(self.upto, end)


class NgramProposer:
    def __init__(self, k: int, max_ngram: int = 4, min_ngram: int = 1):
        self.k, self.max_ngram, self.min_ngram = k, max_ngram, min_ngram

    def propose(self, token_ids: list[int], limit: int, index: NgramIndex | None = None) -> list[int]:
        """Up to min(k, limit) guesses of what follows `token_ids`: the tokens after the latest
        earlier occurrence of its longest repeated suffix. `index`: the sequence's own, reused
        from step to step (a new one otherwise)."""
        start = self.match(token_ids, limit, index)
        return [] if start is None else token_ids[start:start + min(self.k, limit)]

    def match(self, token_ids: list[int], limit: int, index: NgramIndex | None = None) -> int | None:
        """Where `propose`'s guesses start in `token_ids` (None: no guesses)."""
        length = len(token_ids)
        if min(self.k, limit) <= 0 or length < self.min_ngram + 1:
            return None
        index = index or NgramIndex(self.max_ngram)
        index.extend(token_ids, length - 1)           # every n-gram something follows
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            end = index.ends[n].get(tuple(token_ids[length - n:]))
            if end is not None:
                return end
        return None

    def continue_match(self, token_ids: list[int], start: int, limit: int) -> list[int]:
        """Guesses for a sequence whose last token is still being sampled after guesses that are
        still being verified, assuming they all hold: the match goes on where they ended (start,
        past the token there, which is the guess for the one being sampled); up to the first token
        not known yet."""
        guesses = token_ids[start:start + min(self.k, limit)] if limit > 0 else []
        return guesses[:guesses.index(PENDING)] if PENDING in guesses else guesses


@dataclass(slots=True)
class SpeculationStats:
    """Counters for metrics: steps that speculated, tokens proposed and accepted, and how many
    guesses each verified sequence kept (index = accepted count, 0..k)."""
    steps: int = 0
    ahead: int = 0                      # verifying steps queued before the step before them was back
    rolled_back: int = 0                # ...sequence-steps of those, void as guesses before them failed
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


# Adaptivity: a sequence whose guesses keep failing (or that has nothing to guess from) backs off for
# 1, 2, 4 ... MAX_BACKOFF engine steps, resuming at a multiple of its wait so that the sequences backing
# off resume together; while none is due, the engine decodes plainly, a step ahead (a verifying step
# cannot be: its guesses need every token before them known, and its kept count sets the next positions).
MAX_BACKOFF = 4
# A verifying step runs only when at least this share of the decoding sequences guess: it costs more
# than a plain step (more rows, and host work that cannot overlap the device)
MIN_GUESSING_SHARE = 0.25
# Guessed rows a verifying step adds in all: each sequence guesses up to k while k x the running
# sequences fit, fewer as the batch grows (at least one). A small batch leaves the device idle for
# its weights' read, so a long guess costs it about nothing; a larger one spends real compute on it.
GUESS_ROWS = 128


class Speculator:
    """Decides, each step, which running sequences get guesses and how many, and whether the step
    verifies guesses at all (else the engine decodes plainly, scheduling ahead)."""

    def __init__(self, method: str, k: int, max_batch: int, block_manager=None, drafter=None):
        if method not in METHODS:
            raise ValueError(f"unknown speculative method {method!r}: use one of {', '.join(METHODS)}")
        if method == "eagle3" and (drafter is None or block_manager is None):
            raise ValueError("speculative method eagle3 needs a draft head (--speculative-model)")
        self.proposer = NgramProposer(k)
        self.drafter = drafter if method == "eagle3" else None     # engine/runner/draft_head.DraftHead
        self.block_manager = block_manager
        self.k = k
        self.max_batch = max_batch
        self.stats = SpeculationStats()
        self.clock = 0                      # engine steps launched (backing off counts them)

    def active(self, running: list[Sequence]) -> bool:
        """Speculate only while the batch is small: verifying k guesses costs k more rows of
        compute per sequence, which a large batch does not have to spare (it steps aside)."""
        return 0 < len(running) <= self.max_batch

    def wants(self, running: list[Sequence]) -> bool:
        """Should the next step verify guesses: speculation is on for this batch size, and enough
        decoding sequences are due to guess (not backing off) for a step worth verifying."""
        if not self.active(running):
            return False
        decoding = [seq for seq in running if seq.num_tokens > seq.num_prompt_tokens]
        due = sum(1 for seq in decoding if seq.spec_resume_step <= self.clock and self._may_guess(seq))
        return due > 0 and due >= MIN_GUESSING_SHARE * len(decoding)

    def propose(self, running: list[Sequence]) -> None:
        """Set each decoding sequence's `draft` (cleared for the others); every draft cleared when
        too few guess for a verifying step (the step decodes plainly)."""
        guessing = decoding = 0
        heads: list[tuple[Sequence, int]] = []          # (sequence, guesses) for the draft head
        most = self.guesses_each(len(running))
        for seq in running:
            seq.draft, seq.draft_probs = [], None
            # its guesses in flight, verified as this step runs (scheduled past them: all held, assumed),
            # or a plain step's token in flight (the n-gram match of the known tokens predicts it)
            follows, seq.spec_next = seq.spec_next if seq.num_unverified_tokens else None, None
            predicts = seq.num_pending_tokens == 1 and not seq.num_unverified_tokens
            if seq.num_uncomputed_tokens != 1 or (seq.num_pending_tokens and follows is None and not predicts):
                continue
            decoding += 1
            if seq.spec_resume_step > self.clock or not self._may_guess(seq):
                continue
            # room left: max_tokens and the context both cap the tokens a step may add (guesses + 1)
            left = min(seq.params.max_tokens + seq.num_prompt_tokens, seq.max_model_len) - seq.num_tokens - 1
            left = min(left, most)
            if self.drafter is not None:
                if left > 0:
                    heads.append((seq, left))
                continue
            if follows is not None:
                start = follows
                seq.draft = self.proposer.continue_match(seq.token_ids, start, left)
            elif predicts:              # the match's next token is the guess for the one in flight
                if seq.ngram_index is None:
                    seq.ngram_index = NgramIndex(self.proposer.max_ngram)
                start = self.proposer.match(seq.token_ids[:-1], left, seq.ngram_index)
                if start is None:
                    if left > 0:
                        self._back_off(seq)
                    continue
                start += 1
                seq.draft = self.proposer.continue_match(seq.token_ids, start, left)
            else:
                if seq.ngram_index is None:
                    seq.ngram_index = NgramIndex(self.proposer.max_ngram)
                start = self.proposer.match(seq.token_ids, left, seq.ngram_index)
                seq.draft = [] if start is None else seq.token_ids[start:start + min(self.k, left)]
                if not seq.draft and left > 0:
                    self._back_off(seq)                 # nothing repeats yet: as a failed guess
            if seq.draft:
                guessing += 1
                seq.spec_next = start + len(seq.draft) + 1     # past the token after them: the next guesses
        if heads:
            guessing = self._draft(heads, decoding, len(running))
        if guessing < MIN_GUESSING_SHARE * decoding:
            for seq in running:
                if seq.draft:                           # due, but alone: wait for company a few steps
                    seq.draft, seq.draft_probs, seq.spec_next = [], None, None
                    seq.spec_resume_step = self._after(4)

    def guesses_each(self, running: int) -> int:
        return guesses_each(running, self.k)

    def _draft(self, heads: list[tuple[Sequence, int]], decoding: int, running: int) -> int:
        """The draft head's guesses for these sequences, in one batch, when enough of them guess for a
        verifying step and their blocks have room (the head writes its guesses' KV as it drafts).
        Returns how many got guesses."""
        if len(heads) < MIN_GUESSING_SHARE * decoding:
            for seq, _ in heads:                        # due, but too few: wait for company a few steps
                seq.spec_resume_step = self._after(4)
            return 0
        heads = [(seq, n) for seq, n in heads if self._reserve(seq, n, running)]
        if heads:
            seqs = [seq for seq, _ in heads]
            for seq, draft in zip(seqs, self.drafter.draft(seqs, [n for _, n in heads]), strict=True):
                seq.draft = draft
        return len(heads)

    def _reserve(self, seq: Sequence, guesses: int, running: int) -> bool:
        """Blocks for the last token and its guesses, unless that would leave fewer free blocks than
        running sequences (each may need one to decode: guesses never cost another its blocks)."""
        bm = self.block_manager
        need = bm.blocks_needed(seq.num_computed_tokens + 1 + guesses) - len(seq.block_table)
        if need > 0 and bm.num_free_blocks - need < running:
            return False
        bm.allocate(seq, 1 + guesses)
        return True

    def _may_guess(self, seq: Sequence) -> bool:
        """A draft head needs its state at the sequence's last token (a handed-off prompt brings it)."""
        return _may_guess(seq) and (self.drafter is None or seq.spec_hidden is not None)

    def verified(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """A verified sequence kept `accepted` of its `proposed` guesses."""
        self.stats.record(proposed, accepted)
        if accepted:
            seq.spec_misses = 0
        else:
            self._back_off(seq)

    def launched(self, scheduled: list[ScheduledSeq], past_in_flight: bool) -> None:
        """A step was queued on the device (backing off counts them); `past_in_flight`: before the step
        before it was back, which counts it as verifying ahead if its guesses went in as tokens."""
        self.clock += 1
        self.stats.ahead += past_in_flight and any(item.ahead for item in scheduled)

    def keep(self, scheduled: list[ScheduledSeq], drawn: list[list[int] | None]) -> list[list[int] | None]:
        """A verifying step's tokens, back: an item with guesses keeps them up to the first the model
        disagreed with, and the token sampled there (`accept`); a void item's (a new epoch, or
        finished meanwhile) pass as drawn, and the scheduler drops them."""
        kept = []
        for item, tokens in zip(scheduled, drawn, strict=True):
            if tokens is not None and item.draft and item.epoch == item.seq.spec_epoch and not item.seq.is_finished:
                tokens = accept(item.draft, tokens)
                self.verified(item.seq, len(item.draft), len(tokens) - 1)
                self.stats.rolled_back += item.ahead and len(tokens) <= len(item.draft)
            kept.append(tokens)
        self.stats.steps += 1
        return kept

    def _back_off(self, seq: Sequence) -> None:
        seq.spec_misses += 1
        seq.spec_resume_step = self._after(min(1 << (seq.spec_misses - 1), MAX_BACKOFF))

    def _after(self, wait: int) -> int:
        """The first engine step after this one that is a multiple of `wait`."""
        return (self.clock // wait + 1) * wait


def guesses_each(running: int, k: int) -> int:
    """How many tokens each of `running` sequences may guess in a step (GUESS_ROWS)."""
    return max(1, min(k, GUESS_ROWS // max(1, running)))


def _may_guess(seq: Sequence) -> bool:
    """Penalties count the tokens before each row, logprobs are per sampled token and a grammar's
    mask needs the token before: such requests decode one token a step (and so does a prompt whose
    KV is handed off, or a request that opted out)."""
    p = seq.params
    return p.speculative and not p.processes_logits and p.logprobs is None and p.structured is None \
        and not (seq.kv_ticket is not None and seq.kv_ticket.side == "prefill")


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
