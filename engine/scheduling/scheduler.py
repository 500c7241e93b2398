"""Continuous batching: which sequences run in the next step, and how many tokens each.

Torch-free. Each step spends a token budget: running sequences first (one token for a
decode, a chunk for an unfinished prefill), then new ones from the waiting queue, chunked
to fit. When KV blocks run out, the running sequence the policy ranks last (fcfs: the most
recently admitted) is preempted by recompute (its blocks are freed; the prefix cache usually
brings most of them back). The policy (scheduling_policy.py) orders both queues.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from baton.engine.requests.policies import DEFAULT_SCHEDULING_POLICY
from baton.engine.scheduling.block_manager import BlockManager
from baton.engine.scheduling.scheduling_policy import make_queue
from baton.engine.scheduling.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int          # tokens fed to the model this step, from seq.num_computed_tokens
    draft: list[int] = field(default_factory=list)   # guesses fed after its last token (verified: speculative.py)
    epoch: int = 0               # seq.spec_epoch when scheduled: a rollback since voids this step for it
    ahead: bool = False          # its guesses went in as tokens at launch (advance(ahead=True)), verified later

    @property
    def samples(self) -> bool:
        """Does this step produce the sequence's next token (its prefill is complete)?"""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens + len(self.draft)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def is_decode(self) -> bool:
        return all(s.num_new_tokens == 1 for s in self.scheduled)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: str = DEFAULT_SCHEDULING_POLICY         # scheduling_policy.POLICIES


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, eos_token_ids: set[int]):
        self.config = config
        self.block_manager = block_manager
        self.eos_token_ids = set(eos_token_ids)
        self.waiting = make_queue(config.policy)
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefill_tokens = 0             # prompt tokens computed, ever (prefix-cache hits, landed KV: none)
        self.may_admit: Callable[[], bool] = lambda: True    # False: no waiting sequence starts (KVHandoff.may_admit)

    # -- queue management -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.num_tokens > self.config.max_model_len:
            raise ValueError(f"prompt has {seq.num_tokens} tokens, over max_model_len {self.config.max_model_len}")
        if self.block_manager.blocks_needed(seq.num_tokens + 1) > self.block_manager.num_blocks:
            raise ValueError(f"prompt of {seq.num_tokens} tokens cannot fit the KV cache "
                             f"({self.block_manager.num_blocks} blocks of {self.block_manager.block_size})")
        self.waiting.add(seq)

    def add_running(self, seq: Sequence) -> None:
        """Join a sequence whose KV is already in its blocks (decode side of a handover)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def abort(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
        self._finish(seq, FinishReason.ABORT)

    @property
    def has_work(self) -> bool:
        """Something to schedule: a running sequence, or a waiting one that may start now."""
        return bool(self.running) or (bool(self.waiting) and self.may_admit())

    # -- scheduling -------------------------------------------------------------------------
    def schedule(self, preempt: bool = True) -> SchedulerOutput | None:
        """The next step. With `preempt` False (scheduling ahead, while the previous step's
        tokens are still on the device) it never preempts: None means it would have to, and
        the caller should first wait for those tokens. A sequence surely finished by length
        once its pending tokens are filled in gets no more steps."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self.waiting.order_running(self.running)
        if preempt:
            self._make_room_for_urgent(out)
        budget = self._schedule_running(out, budget, preempt)
        if budget is None:
            return None
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _make_room_for_urgent(self, out: SchedulerOutput) -> None:
        """While the most urgent waiting sequence outranks the least urgent running one (priority
        policy only) and cannot start for want of KV blocks or a batch slot, that one gives way."""
        while self.waiting and self.running:
            head, tail = self.waiting.peek(), self.running[-1]
            if not self.waiting.outranks(head, tail):
                return
            n = min(head.num_uncomputed_tokens, self.config.max_num_batched_tokens)
            if len(self.running) < self.config.max_num_seqs and self.block_manager.can_allocate(head, n):
                return
            self._preempt(tail, out)

    def _schedule_running(self, out: SchedulerOutput, budget: int, preempt: bool = True) -> int | None:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_pending_tokens and seq.surely_done:
                i += 1
                continue
            draft = seq.draft[:budget - 1] if seq.draft and seq.num_uncomputed_tokens == 1 else []
            seq.draft = []                              # this step's guesses live in its ScheduledSeq
            n = min(seq.num_uncomputed_tokens, budget) + len(draft)
            if draft and not self.block_manager.can_allocate(seq, n):
                draft, n = [], n - len(draft)           # guesses never cost another sequence its blocks
            if not preempt and not self.block_manager.can_allocate(seq, n):
                return None
            while not self.block_manager.can_allocate(seq, n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                self.block_manager.allocate(seq, n)
                out.scheduled.append(ScheduledSeq(seq, n, draft, seq.spec_epoch))
                budget -= n
                i += 1
                continue
            break           # seq itself was preempted: it was the last one
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        if not self.may_admit():
            return
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.peek()
            if not seq.block_table:
                seq.num_computed_tokens = self.block_manager.match_prefix(seq)
                if seq.num_preemptions == 0:        # usage reports the first admission's hits
                    seq.num_cached_tokens = seq.num_computed_tokens
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.can_allocate(seq, n):
                if not self.running and not out.scheduled:
                    n = self._shrink_to_fit(seq, n)
                if n == 0 or not self.block_manager.can_allocate(seq, n):
                    # a waiting sequence holds no blocks: its prefix hits stay cached for its next
                    # try, and another may be placed ahead of it meanwhile (a preempted or urgent one)
                    self.block_manager.free_sequence(seq)
                    seq.num_computed_tokens = 0
                    break
            self.block_manager.allocate(seq, n)
            self.waiting.pop()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n, epoch=seq.spec_epoch))
            budget -= n

    def _shrink_to_fit(self, seq: Sequence, n: int) -> int:
        """With nothing else running, take as big a chunk as the free blocks allow."""
        free_tokens = (self.block_manager.num_free_blocks + len(seq.block_table)) * self.block_manager.block_size
        return max(0, min(n, free_tokens - seq.num_computed_tokens))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free_sequence(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.readd(seq)
        out.preempted.append(seq)

    # -- after the model step ---------------------------------------------------------------
    def advance(self, out: SchedulerOutput, ahead: bool = False) -> list[int | None]:
        """Once a step is launched: its tokens are computed, and each sampling sequence gets a
        placeholder for the token being sampled. Returns each item's placeholder index (or None),
        for `resolve`. `ahead`: the guesses of a verifying step go in as tokens (unverified) and
        count as computed, so that the next step can be scheduled as if they all held; resolving
        keeps them or rolls the sequence back (engine/speculation/speculative.py)."""
        slots: list[int | None] = []
        for item in out.scheduled:
            seq = item.seq
            samples = item.samples                   # (judged before the count moves)
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.prefill_tokens += min(item.num_new_tokens, seq.num_prompt_tokens - seq.num_computed_tokens)
            if item.draft and ahead:
                item.ahead = True
                seq.num_computed_tokens += item.num_new_tokens
                seq.token_ids += item.draft
                seq.num_unverified_tokens += len(item.draft)
            else:       # a verified step's guesses count as computed once they are kept (resolve_many)
                seq.num_computed_tokens += item.num_new_tokens - len(item.draft)
            slots.append(seq.append_pending() if samples else None)
        return slots

    def resolve(self, out: SchedulerOutput, slots: list[int | None], sampled: list[int | None]) -> list[Sequence]:
        """Once the step's tokens are back: fill in the placeholders, register the blocks they
        completed, finish sequences. A sequence that ended meanwhile drops its placeholders.
        Returns the sequences that finished."""
        return self.resolve_many(out, slots, [None if token is None else [token] for token in sampled])

    def resolve_many(self, out: SchedulerOutput, slots: list[int | None],
                     kept: list[list[int] | None]) -> list[Sequence]:
        """`resolve` with each item's tokens to append: one, or for an item with guesses the ones
        that held and the token sampled after them (engine/speculation/speculative.accept). Their KV was
        computed this step, except the last token's. A stop (EOS, a stop token, max_tokens)
        inside them ends the sequence there."""
        finished = []
        for item, slot, tokens in zip(out.scheduled, slots, kept, strict=True):
            seq = item.seq
            if seq.is_finished:
                seq.drop_pending()
                continue
            if item.epoch != seq.spec_epoch:
                continue                                    # rolled back since: this step's rows are void
            reason = None
            if slot is not None and item.ahead:
                reason = self._verify_ahead(item, slot, tokens)
            elif slot is not None:
                for j, token in enumerate(tokens):
                    if j == 0:
                        seq.fill_pending(slot, token)
                    else:
                        seq.append_token(token)
                        seq.num_computed_tokens += 1        # the guess before it had its KV computed
                    reason = self.stop_reason(seq, token)
                    if reason is not None:
                        break
            self.block_manager.register_full_blocks(seq)
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def _verify_ahead(self, item: ScheduledSeq, slot: int, tokens: list[int]) -> FinishReason | None:
        """An item whose guesses went in as tokens (advance(ahead=True)) keeps `tokens` (the guesses that
        held and the token sampled after them): when all held they are in place, and the step scheduled
        past this one stands; else the sequence rolls back to them, voiding that step for it."""
        seq, guesses = item.seq, len(item.draft)
        if len(tokens) == guesses + 1:
            for j, token in enumerate(tokens):
                if j < guesses:
                    seq.num_unverified_tokens -= 1
                else:
                    seq.fill_pending(slot, token)
                reason = self.stop_reason(seq, token)
                if reason is not None:
                    seq.drop_pending()                      # what was scheduled past the stop
                    return reason
            return None
        seq.rollback(slot - guesses)
        for token in tokens:
            seq.append_token(token)
            reason = self.stop_reason(seq, token)
            if reason is not None:
                return reason
        seq.num_computed_tokens = seq.num_tokens - 1        # the KV of the guesses before it was computed
        return None

    def postprocess(self, out: SchedulerOutput, sampled: list[int | None]) -> list[Sequence]:
        """advance + resolve, for a step whose tokens are already known."""
        return self.resolve(out, self.advance(out), sampled)

    def stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            return FinishReason.STOP
        if seq.num_completion_tokens >= p.max_tokens or seq.num_known_tokens >= seq.max_model_len:
            return FinishReason.LENGTH
        return None

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence from outside (stop string matched, client gone)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is SequenceStatus.FINISHED:
            return
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free_sequence(seq)
