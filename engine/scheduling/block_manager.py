"""Paged KV block allocation with a chained-hash prefix cache.

Torch-free. A full block of a sequence is identified by hash(parent block's hash, its
tokens); blocks whose refcount falls to zero stay findable by hash until reused, oldest
first (LRU). A hash hit is trusted only after comparing the stored tokens and parent
hash, so a collision can never hand out another prompt's KV. Once asked (`take_kv_events`), it
records which hashes become findable and which stop being so: the KV events a router's prefix
index follows (router/prefix_index.py). Unasked for MAX_KV_EVENTS events (its router left), it
stops recording, and the next ask gets a snapshot again: memory stays bounded.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

from baton.engine.requests.prefix_hash import block_hash
from baton.engine.scheduling.sequence import Sequence

HashFn = Callable[[int | None, tuple[int, ...]], int]
MAX_KV_EVENTS = 1 << 16      # unasked-for KV events kept (a router asks every 0.5 s; ~10 s of heavy churn)


class LowerTier(Protocol):
    """Where cached blocks go when the device lets them go, and come back from (engine/runner/host_tier.py)."""

    def offload(self, block_id: int, h: int, parent: int | None, tokens: tuple) -> None: ...

    def find(self, h: int, parent: int | None, tokens: tuple) -> bool: ...

    def load(self, h: int, block_id: int) -> None: ...


class KVCacheFull(Exception):
    """Not enough free KV blocks for what was asked: a capacity condition the caller may retry
    later or elsewhere (RESOURCE_EXHAUSTED), never a host out-of-memory."""


default_block_hash = block_hash       # (engine/requests/prefix_hash.py: the router hashes prompts alike)


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None                 # set once the block is full and registered
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = field(default_factory=tuple)

    def forget(self) -> None:
        self.hash, self.parent_hash, self.token_ids = None, None, ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_fn: HashFn = default_block_hash, lower: LowerTier | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.blocks = [Block(i) for i in range(num_blocks)]
        # free blocks in reuse order (front = least recently freed); cached ones stay findable
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}    # hash -> block_id
        self.num_hits = 0
        self.lower = lower if enable_prefix_caching else None    # a host tier (--kv-offloading-size)
        self.num_lower_hits = 0                                  # blocks brought back from it
        self.kv_events: list[tuple[bool, int]] | None = None    # (stored?, hash), once take_kv_events asked
        self.max_kv_events = MAX_KV_EVENTS

    def take_kv_events(self) -> tuple[list[tuple[bool, int]], bool]:
        """The prefix cache's changes since the last call, (stored?, hash) in order, and whether they
        are a snapshot: the first call turns the record on and lists every cached hash as stored."""
        if self.kv_events is None:
            self.kv_events = []
            return [(True, h) for h in self.cached], True
        taken, self.kv_events = self.kv_events, []
        return taken, False

    def _record(self, stored: bool, h: int) -> None:
        if self.kv_events is not None:
            self.kv_events.append((stored, h))
            if len(self.kv_events) > self.max_kv_events:     # nobody asks any more: off until asked again
                self.kv_events = None

    # -- accounting -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # -- prefix cache -----------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks for the longest cached prefix of a new sequence.

        Leaves at least one prompt token to compute so the step yields logits. Returns the
        number of cached tokens (a multiple of block_size).
        """
        assert not seq.block_table, "prefix matching is for sequences without blocks"
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return 0                    # (prompt logprobs need every prompt position's logits)
        parent: int | None = None
        usable = (seq.num_tokens - 1) // self.block_size
        for i in range(usable):
            tokens = seq.block_key(i, self.block_size)
            if tokens is None:
                break
            h = self.hash_fn(parent, tokens)
            block_id = self.cached.get(h)
            if block_id is None or not self._verified(block_id, h, parent, tokens):
                block_id = self._bring_back(h, parent, tokens)
                if block_id is None:
                    break
                seq.block_table.append(block_id)
                parent = h
                continue
            self._ref(block_id)
            seq.block_table.append(block_id)
            parent = h
        cached = len(seq.block_table) * self.block_size
        self.num_hits += len(seq.block_table)
        seq.num_hashed_blocks = len(seq.block_table)
        return cached

    def _bring_back(self, h: int, parent: int | None, tokens: tuple) -> int | None:
        """A free device block holding the lower tier's copy of this block, cached under `h` again
        (its copy queued ahead of the step that reads it); None when the tier lacks it or no block is free."""
        if self.lower is None or not self.free or not self.lower.find(h, parent, tokens):
            return None
        block_id = self._take_free()
        self.lower.load(h, block_id)
        b = self.blocks[block_id]
        b.hash, b.parent_hash, b.token_ids = h, parent, tokens
        self.cached[h] = block_id
        self._record(True, h)
        self.num_lower_hits += 1
        return block_id

    def _verified(self, block_id: int, h: int, parent: int | None, tokens: tuple[int, ...]) -> bool:
        b = self.blocks[block_id]
        return b.hash == h and b.parent_hash == parent and b.token_ids == tokens

    def register_full_blocks(self, seq: Sequence) -> None:
        """Make the sequence's completely computed blocks findable by later prompts."""
        if not self.enable_prefix_caching:
            return
        n_full = min(seq.num_computed_tokens, seq.num_known_tokens) // self.block_size
        start = seq.num_hashed_blocks       # only blocks that filled up since the last call
        parent = self.blocks[seq.block_table[start - 1]].hash if start else None
        for i in range(start, n_full):
            b = self.blocks[seq.block_table[i]]
            tokens = seq.block_key(i, self.block_size)
            if tokens is None:                  # image tokens of images not here: never shared
                n_full = i
                break
            if b.hash is None:
                h = self.hash_fn(parent, tokens)
                b.hash, b.parent_hash, b.token_ids = h, parent, tokens
                if self.cached.setdefault(h, b.block_id) == b.block_id:
                    self._record(True, h)
            parent = b.hash
        seq.num_hashed_blocks = max(start, n_full)

    # -- allocation -------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return need <= len(self.free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow the block table to hold num_computed_tokens + num_new_tokens tokens."""
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need > len(self.free):
            raise KVCacheFull(f"need {need} KV blocks, {len(self.free)} free")
        for _ in range(need):
            seq.block_table.append(self._take_free())

    def allocate_blocks(self, n: int) -> list[int]:
        """Raw blocks for KV that arrives from elsewhere (decode-side admission)."""
        if n > len(self.free):
            raise KVCacheFull(f"need {n} KV blocks, {len(self.free)} free")
        return [self._take_free() for _ in range(n)]

    def free_blocks(self, block_ids: Seq[int]) -> None:
        for block_id in reversed(block_ids):    # tail first: the prefix stays cached longest
            self._unref(block_id)

    def free_sequence(self, seq: Sequence) -> None:
        self.free_blocks(seq.block_table)
        seq.block_table = []
        seq.num_hashed_blocks = 0

    def _take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        b = self.blocks[block_id]
        if b.hash is not None and self.cached.get(b.hash) == block_id:
            del self.cached[b.hash]
            if self.lower is not None:        # kept in the lower tier before anything overwrites it
                self.lower.offload(block_id, b.hash, b.parent_hash, b.token_ids)
            self._record(False, b.hash)
        b.forget()
        b.ref_count = 1
        return block_id

    def _ref(self, block_id: int) -> None:
        b = self.blocks[block_id]
        if b.ref_count == 0:
            del self.free[block_id]
        b.ref_count += 1

    def _unref(self, block_id: int) -> None:
        b = self.blocks[block_id]
        if b.ref_count <= 0:
            raise RuntimeError(f"KV block {block_id} freed twice")
        b.ref_count -= 1
        if b.ref_count == 0:
            self.free[block_id] = None
