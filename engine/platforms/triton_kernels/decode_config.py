"""Paged decode attention's launch settings, host side only: its tile configs and how many pieces a
context is cut into (`num_splits`). No triton here, so the arithmetic a captured graph depends on is
importable, and testable, on any machine (the kernels: decode_attention.py)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    block_n: int = 64                # context tokens per inner-loop tile (any multiple/fraction of block_size)
    num_warps: int = 4
    num_stages: int = 3
    min_split_tokens: int = 128      # a split covers at least this much context, so splits amortise the merge
    programs_per_sm: int = 2         # split until batch * kv_heads * splits reaches this many per SM
    max_splits: int = 64
    v_in_registers: bool = True      # a float8 cache: V widened where it was loaded (widen_fp8)


def default_config(head_dim: int, dtype: torch.dtype) -> DecodeConfig:
    if dtype == torch.float32 or head_dim > 128:
        return DecodeConfig(block_n=32, num_stages=2)
    if dtype == torch.float8_e4m3fn:      # half the bytes a token: twice the tokens a tile
        return DecodeConfig(block_n=128, num_warps=4, num_stages=3)
    return DecodeConfig()


def invariant_config(head_dim: int, dtype: torch.dtype) -> DecodeConfig:
    """Deterministic mode (engine/runner/batch_invariant.py): never split a context, so a row's sum does
    not depend on how many rows share the GPU."""
    return dataclasses.replace(default_config(head_dim, dtype), max_splits=1)


def num_splits(batch: int, kv_heads: int, max_tokens: int, num_sms: int, cfg: DecodeConfig) -> int:
    """Context splits per sequence, from shapes alone (fixed for a captured graph)."""
    programs = max(1, batch * kv_heads)
    wanted = _cdiv(cfg.programs_per_sm * num_sms, programs)
    useful = _cdiv(max(1, max_tokens), cfg.min_split_tokens)
    return max(1, min(wanted, useful, cfg.max_splits))


def _cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints (what triton.cdiv computes)."""
    return -(-a // b)
