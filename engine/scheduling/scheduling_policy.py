"""Which waiting request runs next, and which running one gives way when KV blocks run out.

Torch-free. The scheduler (scheduler.py) asks its policy for both decisions and nothing else:

  fcfs      first come, first served: the waiting queue in arrival order (a preempted request goes
            back to its front), and the most recently admitted running request is preempted first.
  priority  each request's `SamplingParams.priority` (lower runs first, as vLLM's
            --scheduling-policy priority), ties in arrival order: the waiting queue is kept in
            that order, the running request that sorts last is preempted first, and a waiting
            request that cannot start for want of blocks or a batch slot preempts running ones
            of strictly lower priority. A request never waits behind a less urgent one.

A policy holds the waiting queue and orders the running list before each step: the scheduler
serves that list front to back and preempts from its back.
"""
from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from baton.engine.requests.policies import SCHEDULING_POLICIES as POLICIES
from baton.engine.scheduling.sequence import Sequence


class _Queue:
    """What both policies' waiting queues answer alike (`_q`: the sequences, first to run first)."""

    _q: deque[Sequence] | list[Sequence]

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._q)

    def __contains__(self, seq: Sequence) -> bool:
        return seq in self._q

    def peek(self) -> Sequence:
        return self._q[0]

    def remove(self, seq: Sequence) -> None:
        self._q.remove(seq)


class FCFSQueue(_Queue):
    name = "fcfs"

    def __init__(self):
        self._q = deque()

    def add(self, seq: Sequence) -> None:
        self._q.append(seq)

    def readd(self, seq: Sequence) -> None:
        """A preempted sequence: it was admitted before every waiting one, so it goes first."""
        self._q.appendleft(seq)

    def pop(self) -> Sequence:
        return self._q.popleft()

    def order_running(self, running: list[Sequence]) -> None:
        """Admission order already: the last admitted is the first preempted."""

    def outranks(self, waiting: Sequence, running: Sequence) -> bool:
        """Whether a waiting sequence may preempt a running one to start: never, first come first served."""
        return False


class PriorityQueue(_Queue):
    """Sorted by (priority, arrival): seq_id counts up as sequences are made, so it is arrival
    order, kept across preemptions."""

    name = "priority"

    def __init__(self):
        self._q = []

    @staticmethod
    def _key(seq: Sequence) -> tuple[int, int]:
        return seq.params.priority, seq.seq_id

    def add(self, seq: Sequence) -> None:
        bisect.insort(self._q, seq, key=self._key)

    readd = add

    def pop(self) -> Sequence:
        return self._q.pop(0)

    def order_running(self, running: list[Sequence]) -> None:
        """Most urgent first: they get the step's token budget first, and the last is preempted first."""
        running.sort(key=self._key)

    def outranks(self, waiting: Sequence, running: Sequence) -> bool:
        """A strictly more urgent request takes a less urgent one's place (its blocks, its slot)."""
        return waiting.params.priority < running.params.priority


def make_queue(policy: str) -> FCFSQueue | PriorityQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, got {policy!r}")
