"""Varlen causal prefill attention (flash-attention style, online softmax in fp32).

One program owns (query head, query tile, sequence). Query row i of a sequence with q_len new
tokens and kv_len total tokens sits at position kv_len - q_len + i and sees keys 0..position.
Keys come either from this step's contiguous k/v (no cached context: plain causal attention)
or, with PAGED, from the paged cache through the block table, which serves prefix-cached and
chunked prefills in one path (the new tokens were stored there by store_kv first).
Key tiles wholly below a query tile's diagonal run without a mask; only the diagonal band pays
for masking.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from baton.engine.platforms.triton_kernels.decode_attention import dot_query

LOG2E = 1.4426950408889634


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3


def default_config(head_dim: int, dtype: torch.dtype, max_query_len: int = 0) -> PrefillConfig:
    """Measured on an H100 (docs/cuda-kernels.md): wide tiles pay off on long prompts, small
    ones on batches of short prompts, whose tiles are few and mostly diagonal."""
    if dtype == torch.float32:     # exact fp32 dots run on FMA units: small tiles, quick to compile
        return PrefillConfig(32, 32, 4, 1)
    if head_dim > 128:
        return PrefillConfig(64, 32, 4, 2)
    if max_query_len >= 2048:
        return PrefillConfig(128, 128, 8, 3)
    return PrefillConfig(64, 64, 4, 3)


@triton.jit
def _kv_tile(k_ptr, v_ptr, table_ptr, kv_start, pos, valid, d, stride_kt, stride_kh, stride_vt, stride_vh,
             stride_kb, stride_vb, kv_head, PAGED: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """K and V rows at key positions `pos` of one sequence, [BLOCK_N, D] each."""
    if PAGED:
        block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        row = pos % BLOCK_SIZE
        k_off = block * stride_kb + row * stride_kt + kv_head * stride_kh
        v_off = block * stride_vb + row * stride_vt + kv_head * stride_vh
    else:
        tok = (kv_start + pos).to(tl.int64)
        k_off = tok * stride_kt + kv_head * stride_kh
        v_off = tok * stride_vt + kv_head * stride_vh
    if MASKED:
        k = tl.load(k_ptr + k_off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + v_off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    else:
        k = tl.load(k_ptr + k_off[:, None] + d[None, :])
        v = tl.load(v_ptr + v_off[:, None] + d[None, :])
    return k, v


@triton.jit(do_not_specialize=["stride_bt"])   # the block-table width varies step to step: one binary
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, query_start_ptr, seq_lens_ptr, block_tables_ptr, kv_scale_ptr,
    scale_log2, group,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_kb, stride_vb, stride_bt,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    PAGED: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr, KV_SCALED: tl.constexpr,
):
    head = tl.program_id(0)
    m_start = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M    # longest (lowest) tiles first
    b = tl.program_id(2).to(tl.int64)
    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    if PAGED:
        kv_len = tl.load(seq_lens_ptr + b)
    else:
        kv_len = q_len
    context = kv_len - q_len
    kv_head = head // group
    if KV_SCALED:             # a float8 cache holds K / k_scale, V / v_scale (kv_scale [2, kv heads])
        scale_log2 = scale_log2 * tl.load(kv_scale_ptr + kv_head)
        v_scale = tl.load(kv_scale_ptr + tl.num_programs(0) // group + kv_head)
    else:
        v_scale = 1.0
    live = m_start < q_len

    offs_m = m_start + tl.arange(0, BLOCK_M)
    row_ok = offs_m < q_len
    d = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
    q = dot_query(q, k_ptr, KV_FP8)     # a float8 cache: the dots run in fp16 (decode_attention)
    pos_m = context + offs_m

    # keys below the tile's first query position are visible to every row: no mask there
    full_end = tl.where(live, (context + m_start + 1) // BLOCK_N * BLOCK_N, 0)
    band_end = tl.where(live, tl.minimum(kv_len, context + m_start + BLOCK_M), 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table = block_tables_ptr + b * stride_bt
    for n in range(0, full_end, BLOCK_N):
        pos = n + tl.arange(0, BLOCK_N)
        k, v = _kv_tile(k_ptr, v_ptr, table, q_start, pos, pos < kv_len, d, stride_kt, stride_kh,
                        stride_vt, stride_vh, stride_kb, stride_vb, kv_head, PAGED, BLOCK_SIZE, False)
        k, v = k.to(q.dtype), v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    for n in range(full_end, band_end, BLOCK_N):
        pos = n + tl.arange(0, BLOCK_N)
        valid = pos < kv_len
        k, v = _kv_tile(k_ptr, v_ptr, table, q_start, pos, valid, d, stride_kt, stride_kh,
                        stride_vt, stride_vh, stride_kb, stride_vb, kv_head, PAGED, BLOCK_SIZE, True)
        k, v = k.to(q.dtype), v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(valid[None, :] & (pos[None, :] <= pos_m[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    o = acc * (v_scale / tl.where(row_ok, l_i, 1.0))[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def varlen_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start_loc: torch.Tensor,
                   max_query_len: int, scale: float, *, seq_lens: torch.Tensor | None = None,
                   k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                   block_tables: torch.Tensor | None = None, cfg: PrefillConfig | None = None,
                   out: torch.Tensor | None = None, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D]. With k_cache (+ seq_lens, block_tables) keys are read from the
    paged cache (a float8 one's times its per-head scales kv_scale [2, Hkv], contiguous float32,
    where given); without, from k/v [T, Hkv, D] (each sequence attends to its own new tokens)."""
    t, q_heads, dim = q.shape
    out = torch.empty_like(q) if out is None else out
    batch = query_start_loc.shape[0] - 1
    if t == 0 or batch == 0 or max_query_len == 0:
        return out
    paged = k_cache is not None
    if paged:
        keys, values, kv_heads, block_size = k_cache, v_cache, k_cache.shape[2], k_cache.shape[1]
        strides = (k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
                   k_cache.stride(0), v_cache.stride(0), block_tables.stride(0))
    else:
        keys, values, kv_heads, block_size = _last_dim_contiguous(k), _last_dim_contiguous(v), k.shape[1], 1
        strides = (keys.stride(0), keys.stride(1), values.stride(0), values.stride(1), 0, 0, 0)
        seq_lens = block_tables = query_start_loc   # unused without PAGED
    q = _last_dim_contiguous(q)
    cfg = cfg or default_config(dim, keys.dtype, max_query_len)
    grid = (q_heads, triton.cdiv(max_query_len, cfg.block_m), batch)
    _prefill_kernel[grid](
        q, keys, values, out, query_start_loc, seq_lens, block_tables,
        kv_scale if paged and kv_scale is not None else query_start_loc, scale * LOG2E, q_heads // kv_heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *strides,
        HEAD_DIM=dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_SIZE=block_size, PAGED=paged,
        DOT_PRECISION="ieee" if keys.dtype == torch.float32 else "tf32",
        KV_FP8=keys.dtype == torch.float8_e4m3fn, KV_SCALED=paged and kv_scale is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
