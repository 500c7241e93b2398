"""A worker's prefix-cache changes for routers (`GetKVEvents`, on the Prefill and Decode services):
what its engine's block manager stored and evicted (BlockManager.take_kv_events), pulled from the
engine core when a router asks (at most every PULL_S), numbered, the last KEPT kept, and the set
they add up to. A router follows them with a cursor (epoch, seq) into its prefix index
(router/prefix_index.py); a cursor from another process of this worker (a restart) or older than
what is kept gets the whole set instead (`reset`), so the index never holds what is not here.
Modelled on vLLM's KV events (BlockStored / BlockRemoved / AllBlocksCleared)."""
from __future__ import annotations

import asyncio
import collections
import time
import uuid

from baton.serving.worker.core_protocol import Command
from baton.v1 import worker_pb2

KEPT = 1 << 16
PULL_S = 0.2


class KVEventLog:
    def __init__(self, kept: int = KEPT):
        self.epoch = uuid.uuid4().hex[:16]      # this process: a restarted worker starts another
        self.seq = 0
        self.log: collections.deque[tuple[int, bool, int]] = collections.deque(maxlen=kept)   # (seq, stored?, hash)
        self.cached: set[int] = set()
        self._pulled = 0.0
        self._lock = asyncio.Lock()

    def add(self, events: list[tuple[bool, int]], snapshot: bool) -> None:
        if snapshot:                  # (the core stopped recording, or just began): what was logged no
            self.cached.clear()       # longer adds up to the set, so every cursor before now gets a reset
            self.log.clear()
            self.seq += 1
        for stored, h in events:
            self.seq += 1
            self.log.append((self.seq, stored, h))
            (self.cached.add if stored else self.cached.discard)(h)

    def since(self, epoch: str, seq: int) -> worker_pb2.KVEvents:
        oldest = self.log[0][0] if self.log else self.seq + 1
        if epoch != self.epoch or seq > self.seq or seq < oldest - 1:
            return worker_pb2.KVEvents(epoch=self.epoch, seq=self.seq, reset=True,
                                       events=[worker_pb2.KVEvent(block_hash=h) for h in self.cached])
        return worker_pb2.KVEvents(epoch=self.epoch, seq=self.seq, events=[
            worker_pb2.KVEvent(block_hash=h, removed=not stored) for s, stored, h in self.log if s > seq])

    async def answer(self, core, req: worker_pb2.GetKVEventsRequest, block_size: int) -> worker_pb2.KVEvents:
        async with self._lock:
            if time.monotonic() - self._pulled >= PULL_S:
                self.add(*await core.call(Command.KV_EVENTS))
                self._pulled = time.monotonic()
        reply = self.since(req.epoch, req.since)
        reply.block_size = block_size
        return reply
