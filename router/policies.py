"""Routing policies: which healthy worker gets the next request.

`round_robin` cycles; `least_loaded` takes the worker with the fewest queued + running
requests, breaking ties by free KV (for prefill: the least expected work, the prompt tokens
queued there times its measured time per token, so a slow worker gets less but is never left); `prefix_aware` sends prompts that share their first
block(s) to the same prefill worker (rendezvous hashing, so a worker leaving moves only
its own prefixes) and places decode by load; `kv_aware` sends a prompt where its first token needs
the fewest prompt tokens prefilled: those queued there plus the part of the prompt that worker's prefix
cache does not hold, as the workers' own KV events say and where it sent prompts since
(router/prefix_index.py). Its decode workers are picked the same way, by the blocks they hold
(--decode-prefix-reuse): the prefill worker sends them only what they lack, so a returning
conversation's history crosses the KV link once, not every turn.

kv_aware weighs load in two more ways, or a prefix every prompt shares (an app's system prompt)
would draw every new conversation to the worker that cached it first, whose cache then evicts
their histories (measured: 37 % of an oracle's cached tokens, below least_loaded's 64 %;
docs/benchmarks.md, "Routing policies on four workers"). A prompt no worker holds at least
HIT_SHARE of is new work: it goes to the least loaded worker (more cached blocks break ties).
And only workers within BALANCE_SLACK requests (or twice the load) of the least loaded one
compete at all, so a conversation stays with its cache until that worker is clearly busier.
"""
from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence as Seq

from baton.engine.requests.prefix_hash import prompt_block_hashes
from baton.router.prefix_index import PrefixIndex
from baton.router.registry import Worker

POLICIES = ("round_robin", "least_loaded", "prefix_aware", "kv_aware")
PREFIX_TOKENS = 64          # how much of the prompt identifies a shared prefix
HIT_SHARE = 0.5             # kv_aware: a prompt with less than this share cached anywhere is placed by load
BALANCE_SLACK = 4           # kv_aware: requests past the least loaded worker's (or its load again) that may wait


class Policy:
    name = "base"

    def pick(self, workers: Seq[Worker], prompt: Seq[int]) -> Worker:
        raise NotImplementedError


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self):
        self._counter = itertools.count()

    def pick(self, workers, prompt):
        return workers[next(self._counter) % len(workers)]


class LeastLoaded(Policy):
    name = "least_loaded"

    def __init__(self, role: str = "decode"):
        self.by_work = role == "prefill"

    def pick(self, workers, prompt):
        if self.by_work:
            return min(workers, key=lambda w: (w.expected_wait(), w.load(), w.address))
        return min(workers, key=lambda w: (w.load(), -w.kv_free_fraction(), w.address))


class PrefixAware(Policy):
    name = "prefix_aware"

    def pick(self, workers, prompt):
        key = ",".join(map(str, prompt[:PREFIX_TOKENS])).encode()
        return max(workers, key=lambda w: hashlib.blake2b(key + w.address.encode(), digest_size=8).digest())


class KVAware(Policy):
    name = "kv_aware"

    def __init__(self, index: PrefixIndex, role: str = "colocated"):
        self.index = index
        self.by_bytes = role == "decode"    # a decode worker's cache saves KV transfer, not prefill time

    def pick(self, workers, prompt):
        size = workers[0].status.block_size or 16
        hashes = prompt_block_hashes(prompt, size)
        cached = {w.address: self.index.hits(w.address, hashes) * size for w in workers}
        least = min(w.load() for w in workers)
        fair = [w for w in workers if w.load() <= least + max(BALANCE_SLACK, least)]
        if max(cached[w.address] for w in fair) < HIT_SHARE * len(prompt):
            chosen = min(fair, key=lambda w: (w.load(), -cached[w.address], -w.kv_free_fraction(), w.address))
        elif self.by_bytes:
            chosen = min(fair, key=lambda w: (-cached[w.address], w.load(), -w.kv_free_fraction(), w.address))
        else:
            def first_token_cost(w: Worker) -> int:
                """Prompt tokens to prefill there before its first token: those this router queued
                there (counted for prefill workers; a colocated one's queue weighs through `fair` only),
                then this prompt's tokens its prefix cache lacks. Tokens, not seconds: a worker's
                seconds_per_token averages its recent steps, decode rows and prompt tokens alike, so it
                swings tenfold with its mix of steps rather than its speed (one that was decoding would
                look too slow to keep a conversation whose history it holds); a pool's workers are alike."""
                return w.inflight_tokens + len(prompt) - cached[w.address]
            chosen = min(fair, key=lambda w: (first_token_cost(w), w.load(), w.address))
        self.index.expect(chosen.address, hashes)      # its next turn may come back before the worker's events
        return chosen


def make_policy(name: str, role: str, index: PrefixIndex | None = None) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {POLICIES}")
    if name == "round_robin":
        return RoundRobin()
    if name == "prefix_aware" and role in ("prefill", "colocated"):
        return PrefixAware()
    if name == "kv_aware":
        return KVAware(index if index is not None else PrefixIndex(), role)
    return LeastLoaded(role)
