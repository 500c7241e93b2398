"""The KV cache's host-memory tier (`--kv-offloading-size GiB`, vLLM's spelling): full blocks the
device's prefix cache lets go are copied to host memory (pinned, on an accelerator) instead of
lost, found again by the same chained hash, and brought back into a device block when a prompt
needs them, so a conversation that returns after its KV was evicted pays a copy, not its prefill.

The block manager (engine/scheduling/block_manager.py, torch-free) drives it through three calls:
`offload` as it reuses a cached block (before anything can write into it: the copy is queued on
the engine's stream ahead of the step that will), `find` when a prompt's next block is not on the
device, and `load` into the free block it took for it (queued ahead of the step that reads it).
Both copies go through the transfer seam's packing (engine/runner/kv_blocks.py): one block is a
payload of one block. The tier is inclusive and has its own LRU: a block brought back stays here
too, and the least recently used slot is the one overwritten when the tier is full. A hash hit is
trusted only once the stored parent and tokens match, as on the device.
"""
from __future__ import annotations

import collections
import logging

import torch

from baton.engine.runner.kv_blocks import can_pin, pack_blocks_on_device, unpack_blocks

log = logging.getLogger("baton.engine")


class HostTier:
    def __init__(self, kv_tensor: torch.Tensor, block_bytes: int, capacity_bytes: int):
        self.kv = kv_tensor
        self.block_bytes = block_bytes
        self.num_slots = max(0, capacity_bytes // block_bytes)
        if self.num_slots < 1:
            raise ValueError(f"--kv-offloading-size holds no block: one block is {block_bytes} bytes")
        pin = kv_tensor.device.type != "cpu" and can_pin()
        self.store = torch.empty((self.num_slots, block_bytes), dtype=torch.uint8, pin_memory=pin)
        self.index: collections.OrderedDict[int, tuple[int, int | None, tuple]] = collections.OrderedDict()
        self.free = list(range(self.num_slots - 1, -1, -1))
        self.offloaded = self.loaded = 0           # blocks copied out / brought back, ever

    def offload(self, block_id: int, h: int, parent: int | None, tokens: tuple) -> None:
        """Keep device block `block_id` (cached under `h`) here before the device reuses it."""
        if h in self.index:
            self.index.move_to_end(h)
            return
        slot = self.free.pop() if self.free else self.index.popitem(last=False)[1][0]
        self.store[slot].copy_(pack_blocks_on_device(self.kv, [block_id]), non_blocking=True)
        self.index[h] = (slot, parent, tokens)
        self.offloaded += 1

    def find(self, h: int, parent: int | None, tokens: tuple) -> bool:
        entry = self.index.get(h)
        return entry is not None and entry[1] == parent and entry[2] == tokens

    def load(self, h: int, block_id: int) -> None:
        """Copy the block kept under `h` into device block `block_id`."""
        slot = self.index[h][0]
        self.index.move_to_end(h)
        data = self.store[slot]
        if self.kv.device.type != "cpu":    # queued on the engine's stream, the engine thread goes on: the
            data = data.to(self.kv.device, non_blocking=True)   # slot is only ever rewritten on that stream
        unpack_blocks(self.kv, [block_id], data)
        self.loaded += 1

    @property
    def num_blocks(self) -> int:
        return len(self.index)
