"""Routing alignment for the grouped MoE GEMMs, in plain torch on the device (no triton import,
so it runs and is tested on the CPU too).

The T*k (token, choice) pairs are sorted by expert and each expert's group is padded to a
multiple of `block_m` rows, so every block of `block_m` rows belongs to one expert and a GEMM
program can load that expert's weight tiles once for all its rows. Every buffer has a size fixed
by (T, k, E, block_m) alone, and nothing is read back on the host, so the whole step captures
into a CUDA graph: counts come from scatter_add/cumsum, block owners from searchsorted.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class ExpertBlocks:
    """Rows of the grouped GEMMs. `sorted_slots[r]` is the flat pair index t*k + j that row r
    computes, or `num_slots` (= T*k) for a padding row; `block_expert[b]` owns rows
    [b*block_m, (b+1)*block_m), `num_experts` marking a block past the last expert's group."""
    sorted_slots: torch.Tensor       # [max_blocks * block_m] int32
    block_expert: torch.Tensor       # [max_blocks] int32
    block_m: int
    num_slots: int
    num_experts: int

    @property
    def max_blocks(self) -> int:
        return self.block_expert.numel()


def max_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """An upper bound on sum_e ceil(count_e / block_m) over any routing: ceil(c/m) <= c/m + 1 for
    each of the at most min(E, T*k) experts hit, so the grid never depends on the routing."""
    return -(-num_slots // block_m) + min(num_experts, num_slots)


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Group the pairs of `ids` [T, k] (expert ids, any integer dtype) by expert, padded per expert
    to `block_m` rows. Pairs of one expert stay in token order (a stable sort)."""
    if ids.dim() != 2:
        raise ValueError(f"ids must be [tokens, top_k], got shape {tuple(ids.shape)}")
    if num_experts < 1 or block_m < 1:
        raise ValueError(f"num_experts and block_m must be positive, got {num_experts} and {block_m}")
    flat = ids.reshape(-1).to(torch.int64)
    n, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[experts]   # place within its expert
    dest = (padded_end - padded)[experts] + rank
    blocks = max_blocks(n, num_experts, block_m)
    sorted_slots = torch.full((blocks * block_m,), n, dtype=torch.int32, device=dev)
    sorted_slots.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(blocks, device=dev) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True).to(torch.int32)
    return ExpertBlocks(sorted_slots, block_expert, block_m, n, num_experts)
