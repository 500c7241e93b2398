"""Paged decode attention: one query token per sequence over its block table (flash-decoding).

One program owns (kv head, sequence, context split): it loads the queries of every head in that
kv head's GQA group as one [GROUP_P, D] tile, so each K/V tile is read once per kv head, and
runs an online softmax in fp32 over its share of the context. When the batch alone cannot fill
the GPU, the context is cut into `num_splits` pieces and a second kernel merges the partial
results by their log-sum-exp.

Graph capture: `num_splits` comes from shapes only (batch, kv heads, block-table width, SM
count); each program reads its sequence's length from device memory and derives its own range,
so a captured graph stays correct for any seq_lens the block-table width can hold.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# the host side (no triton), kept importable from here: cuda.py, the benchmarks and tests use these names
from baton.engine.platforms.triton_kernels.decode_config import DecodeConfig, default_config, num_splits
from baton.engine.platforms.triton_kernels.decode_config import invariant_config as invariant_config

LOG2E = 1.4426950408889634


@triton.jit
def _split_range(seq_len, pid_s, num_splits, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr):
    """This program's [start, end) of the context, and how many splits the sequence really uses."""
    seq_len = tl.maximum(seq_len, 1)
    used = tl.minimum(num_splits, tl.cdiv(seq_len, MIN_SPLIT))
    tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(tiles, used)
    used = tl.cdiv(tiles, tiles_per_split)
    start = pid_s * tiles_per_split * BLOCK_N
    end = tl.minimum(seq_len, start + tiles_per_split * BLOCK_N)
    return start, end, used


@triton.jit
def dot_query(q, k_ptr, KV_FP8: tl.constexpr):
    """q in the dtype the dots run in. A float8 cache (--kv-cache-dtype fp8) runs them in fp16:
    e4m3 widens to fp16 exactly in one packed instruction per pair (to bf16 it takes a second
    conversion per element), and q and the probabilities keep more mantissa in fp16 than in
    bf16; q is saturated to fp16's range (+-65504)."""
    if KV_FP8:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    else:
        q = q.to(k_ptr.dtype.element_ty)
    return q


@triton.jit
def widen_fp8(x):
    """e4m3 -> fp16 in registers, right where the tile was loaded. Triton's own `.to(tl.float16)`
    of a tile that feeds a dot is moved past the shared-memory staging, so V (the second dot's B
    operand, read down its rows) comes back from shared memory a byte at a time; the same packed
    cvt as inline asm with side effects stays where it is written, and V is staged as fp16 and read
    with ldmatrix (docs/benchmarks.md, "Quantized serving")."""
    return tl.inline_asm_elementwise("cvt.rn.f16x2.e4m3x2 $0, $1;", "=r,h", [x], dtype=tl.float16,
                                     is_pure=False, pack=2)


@triton.jit(do_not_specialize=["num_splits", "stride_bt"])   # they vary in eager steps: one binary
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, kv_scale_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    scale_log2, num_splits, group,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, stride_ob, stride_oh,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    BLOCK_SIZE: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    MIN_SPLIT: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
    V_IN_REGISTERS: tl.constexpr, KV_SCALED: tl.constexpr,
):
    kv_head = tl.program_id(0)
    if KV_SCALED:             # a float8 cache holds K / k_scale, V / v_scale (kv_scale [2, kv heads])
        scale_log2 = scale_log2 * tl.load(kv_scale_ptr + kv_head)
        v_scale = tl.load(kv_scale_ptr + tl.num_programs(0) + kv_head)
    else:
        v_scale = 1.0
    b = tl.program_id(1).to(tl.int64)
    pid_s = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start, end, used = _split_range(seq_len, pid_s, num_splits, BLOCK_N, MIN_SPLIT)

    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * group + g
    g_mask = g < group
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g_mask[:, None], other=0.0)
    q = dot_query(q, k_cache_ptr, KV_FP8)

    m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_DIM], tl.float32)
    table = block_tables_ptr + b * stride_bt
    for n in range(start, end, BLOCK_N):
        pos = n + tl.arange(0, BLOCK_N)
        valid = pos < end
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        row = pos % BLOCK_SIZE
        k = tl.load(k_cache_ptr + (block * stride_kb + row * stride_ks + kv_head * stride_kh)[:, None] + d[None, :],
                    mask=valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + (block * stride_vb + row * stride_vs + kv_head * stride_vh)[:, None] + d[None, :],
                    mask=valid[:, None], other=0.0)
        if V_IN_REGISTERS:     # only with KV_FP8
            k, v = k.to(q.dtype), widen_fp8(v)
        else:
            k, v = k.to(q.dtype), v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if SPLIT:
        live = g_mask & (pid_s < used)
        part = part_out_ptr + b * stride_pb + heads * stride_ph + pid_s * stride_ps
        tl.store(part[:, None] + d[None, :], acc * (v_scale / l_i)[:, None], mask=live[:, None])
        tl.store(part_lse_ptr + b * stride_lb + heads * stride_lh + pid_s, m_i + tl.log2(l_i), mask=live)
    else:
        o = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(o, (acc * (v_scale / l_i)[:, None]).to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(
    part_out_ptr, part_lse_ptr, seq_lens_ptr, out_ptr,
    num_splits, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, SPLITS_P: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    _, _, used = _split_range(seq_len, 0, num_splits, BLOCK_N, MIN_SPLIT)
    s = tl.arange(0, SPLITS_P)
    d = tl.arange(0, HEAD_DIM)
    live = s < used
    lse = tl.load(part_lse_ptr + b * stride_lb + h * stride_lh + s, mask=live, other=float("-inf"))
    parts = tl.load(part_out_ptr + (b * stride_pb + h * stride_ph + s * stride_ps)[:, None] + d[None, :],
                    mask=live[:, None], other=0.0)
    w = tl.exp2(lse - tl.max(lse, 0))
    o = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, o.to(out_ptr.dtype.element_ty))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, num_sms: int, cfg: DecodeConfig | None = None,
                 out: torch.Tensor | None = None, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D]; caches [blocks, block_size, Hkv, D]; block_tables [B, W] int32;
    kv_scale [2, Hkv] contiguous float32: a float8 cache's per-head K and V scales (None: 1)."""
    batch, q_heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    cfg = cfg or default_config(dim, k_cache.dtype)
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    group = q_heads // kv_heads
    splits = num_splits(batch, kv_heads, block_tables.shape[1] * block_size, num_sms, cfg)
    if splits > 1:   # shape-sized workspaces: inside a captured graph they come from its pool
        part_out = torch.empty(batch, q_heads, splits, dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, q_heads, splits, dtype=torch.float32, device=q.device)
        part_strides = (*part_out.stride()[:3], *part_lse.stride()[:2])
    else:
        part_out = part_lse = out   # unused by the single-split kernel
        part_strides = (0, 0, 0, 0, 0)
    dot_precision = "ieee" if k_cache.dtype == torch.float32 else "tf32"
    kv_fp8 = k_cache.dtype == torch.float8_e4m3fn
    _decode_kernel[(kv_heads, batch, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, seq_lens if kv_scale is None else kv_scale,
        out, part_out, part_lse,
        scale * LOG2E, splits, group,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        *part_strides,
        BLOCK_SIZE=block_size, GROUP_P=max(16, triton.next_power_of_2(group)), HEAD_DIM=dim,
        BLOCK_N=cfg.block_n, MIN_SPLIT=cfg.min_split_tokens, SPLIT=splits > 1, DOT_PRECISION=dot_precision,
        KV_FP8=kv_fp8, V_IN_REGISTERS=kv_fp8 and cfg.v_in_registers, KV_SCALED=kv_scale is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        _merge_kernel[(batch, q_heads)](
            part_out, part_lse, seq_lens, out, splits, *part_strides, out.stride(0), out.stride(1),
            HEAD_DIM=dim, SPLITS_P=triton.next_power_of_2(splits), BLOCK_N=cfg.block_n,
            MIN_SPLIT=cfg.min_split_tokens, num_warps=4,
        )
    return out
