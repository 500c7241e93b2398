"""The router's fleet-wide prefix index (`--policy kv_aware`): which worker's prefix cache holds
which blocks, followed from the workers' own KV events (`GetKVEvents`: serving/worker/kv_events.py)
after every round of health checks, instead of guessed from a hash of the prompt's first tokens
(`prefix_aware`). A worker that is lost (hung, dead) leaves the index at once; one that restarted
answers with a new epoch, so what was known of it is replaced by what it holds now.

The policy (router/policies.py: KVAware) looks up a prompt's chained block hashes
(engine/requests/prefix_hash.py, the workers' own function) and weighs each worker's expected
saving against the work queued there. The index is a hint: a stale entry costs a prefill, never a
wrong token (the block manager verifies before it reuses)."""
from __future__ import annotations

import logging

import grpc

from baton.v1 import worker_pb2

log = logging.getLogger("baton.router")
TIMEOUT_S = 1.5


class PrefixIndex:
    def __init__(self):
        self.blocks: dict[str, set[int]] = {}            # worker address -> block hashes it holds
        self.cursor: dict[str, tuple[str, int]] = {}      # worker address -> (epoch, seq) applied

    async def refresh(self, w) -> None:
        """Apply `w`'s events since the last call (on failure: forget it until the next)."""
        epoch, seq = self.cursor.get(w.address, ("", 0))
        try:
            reply = await w.stub.GetKVEvents(worker_pb2.GetKVEventsRequest(epoch=epoch, since=seq), timeout=TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.debug("KV events of %s: %s", w.address, exc.code().name)
            self.drop(w.address)
            return
        self.apply(w.address, reply)

    def apply(self, address: str, reply: worker_pb2.KVEvents) -> None:
        held = self.blocks.setdefault(address, set())
        if reply.reset:
            held.clear()
        for e in reply.events:
            (held.discard if e.removed else held.add)(e.block_hash)
        self.cursor[address] = (reply.epoch, reply.seq)

    def drop(self, address: str) -> None:
        self.blocks.pop(address, None)
        self.cursor.pop(address, None)

    def hits(self, address: str, hashes: list[int]) -> int:
        """How many of a prompt's leading blocks `address` holds."""
        held = self.blocks.get(address)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n
