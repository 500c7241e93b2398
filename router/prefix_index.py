"""The router's fleet-wide prefix index (`--policy kv_aware`): which worker's prefix cache holds
which blocks, followed from the workers' own KV events (`GetKVEvents`: serving/worker/kv_events.py)
after every round of health checks, instead of guessed from a hash of the prompt's first tokens
(`prefix_aware`). A worker that is lost (hung, dead) leaves the index at once; one that restarted
answers with a new epoch, so what was known of it is replaced by what it holds now.

The policy (router/policies.py: KVAware) looks up a prompt's chained block hashes
(engine/requests/prefix_hash.py, the workers' own function) and weighs each worker's expected
saving against the work queued there. The index is a hint: a stale entry costs a prefill, never a
wrong token (the block manager verifies before it reuses).

Events arrive once per round of checks (every 0.5 s) and only after the prefill has run, yet an
agent's tool loop or a quick reply comes back sooner. So the policy also records where it sent
each prompt (`expect`): those blocks count as held there until the worker's events confirm them
(stored), contradict them (removed), or EXPECT_TTL_S passes (the request failed, or
the worker does not cache)."""
from __future__ import annotations

import logging
import time

import grpc

from baton.v1 import worker_pb2

log = logging.getLogger("baton.router")
TIMEOUT_S = 1.5
EXPECT_TTL_S = 10.0          # how long a routed prompt's blocks count as held without an event saying so


class PrefixIndex:
    def __init__(self):
        self.blocks: dict[str, set[int]] = {}            # worker address -> block hashes it holds
        self.cursor: dict[str, tuple[str, int]] = {}      # worker address -> (epoch, seq) applied
        self.expected: dict[str, dict[int, float]] = {}   # worker address -> block hash -> until (monotonic)

    async def refresh(self, w) -> None:
        """Apply `w`'s events since the last call. A call that fails changes nothing: what was known
        stays a hint, and the next call goes on from the same cursor (a lost worker is dropped by
        the registry; a restarted one answers with a new epoch, which resets)."""
        epoch, seq = self.cursor.get(w.address, ("", 0))
        try:
            reply = await w.stub.GetKVEvents(worker_pb2.GetKVEventsRequest(epoch=epoch, since=seq), timeout=TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.debug("KV events of %s: %s", w.address, exc.code().name)
            return
        self.apply(w.address, reply)

    def apply(self, address: str, reply: worker_pb2.KVEvents) -> None:
        held = self.blocks.setdefault(address, set())
        expected = self.expected.setdefault(address, {})
        if reply.reset:                              # (prompts sent since may not have run yet: still expected)
            held.clear()
        for e in reply.events:
            (held.discard if e.removed else held.add)(e.block_hash)
            expected.pop(e.block_hash, None)         # the worker has said: stored, or evicted
        now = time.monotonic()
        for h in [h for h, until in expected.items() if until <= now]:
            del expected[h]
        self.cursor[address] = (reply.epoch, reply.seq)

    def expect(self, address: str, hashes: list[int], now: float | None = None) -> None:
        """A prompt with these block hashes was just sent to `address`: its prefill will cache them."""
        until = (time.monotonic() if now is None else now) + EXPECT_TTL_S
        held, expected = self.blocks.get(address, ()), self.expected.setdefault(address, {})
        for h in hashes:                 # (what its events already said it holds needs no hint: the
            if h not in held:            # hints stay as few as the blocks not yet confirmed)
                expected[h] = until

    def drop(self, address: str) -> None:
        self.blocks.pop(address, None)
        self.cursor.pop(address, None)
        self.expected.pop(address, None)

    def hits(self, address: str, hashes: list[int], now: float | None = None) -> int:
        """How many of a prompt's leading blocks `address` holds, or will once what was sent there ran."""
        held, expected = self.blocks.get(address, ()), self.expected.get(address, {})
        now = time.monotonic() if now is None else now
        n = 0
        for h in hashes:
            if h not in held and expected.get(h, 0.0) <= now:
                break
            n += 1
        return n
