"""Writes this step's K and V rows into their paged-cache slots in one launch.

One program per token copies all of its kv heads for K and V; slot -1 (a padding row) writes
nothing. Caches are [num_blocks, block_size, kv_heads, head_dim] views, addressed by strides.

`rounded_as_cached`: a prefill's own K and V as a float8 cache holds them (base.as_cached's
numbers), also in one launch, where plain torch takes seven per tensor; a prefill step runs it
once a layer, and eager prefill is bound by the host's launches.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _to_fp8_range(k, v, kv_scale_ptr, h, NUM_HEADS: tl.constexpr, KV_SCALED: tl.constexpr):
    """float8 e4m3 holds x / its kv head's scale, saturating at +-448 (base.to_cache_dtype): K and V
    [heads, D] in float32, divided and clamped, ready for the cast."""
    k, v = k.to(tl.float32), v.to(tl.float32)
    if KV_SCALED:             # kv_scale [2, heads]: K's row, then V's
        k = k / tl.load(kv_scale_ptr + h, mask=h < NUM_HEADS, other=1.0)[:, None]
        v = v / tl.load(kv_scale_ptr + NUM_HEADS + h, mask=h < NUM_HEADS, other=1.0)[:, None]
    return tl.minimum(tl.maximum(k, -448.0), 448.0), tl.minimum(tl.maximum(v, -448.0), 448.0)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, kv_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, HEADS_P: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr, KV_SCALED: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    valid = slot >= 0
    slot = tl.maximum(slot, 0)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_P)
    d = tl.arange(0, HEAD_DIM)
    mask = (h[:, None] < NUM_HEADS) & valid
    k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    if KV_FP8:
        k, v = _to_fp8_range(k, v, kv_scale_ptr, h, NUM_HEADS, KV_SCALED)
    kc = k_cache_ptr + block * stride_kcb + offset * stride_kcs + h[:, None] * stride_kch + d[None, :]
    vc = v_cache_ptr + block * stride_vcb + offset * stride_vcs + h[:, None] * stride_vch + d[None, :]
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
    """key/value [T, Hkv, D] (last dim contiguous) into caches [blocks, block_size, Hkv, D];
    a float8 cache's divided by kv_scale [2, Hkv] (contiguous float32) first, where given."""
    t, heads, dim = key.shape
    if t == 0:
        return
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    _store_kv_kernel[(t,)](
        key, value, k_cache, v_cache, slot_mapping, slot_mapping if kv_scale is None else kv_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=heads, HEADS_P=triton.next_power_of_2(heads), HEAD_DIM=dim, BLOCK_SIZE=k_cache.shape[1],
        KV_FP8=k_cache.dtype == torch.float8_e4m3fn, KV_SCALED=kv_scale is not None, num_warps=4 if heads * dim >= 1024 else 1,
    )


@triton.jit
def _round_kernel(key_ptr, value_ptr, k_out_ptr, v_out_ptr, kv_scale_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                  NUM_HEADS: tl.constexpr, HEADS_P: tl.constexpr, HEAD_DIM: tl.constexpr, KV_SCALED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HEADS_P)
    d = tl.arange(0, HEAD_DIM)
    mask = h[:, None] < NUM_HEADS
    k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
    v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
    k, v = _to_fp8_range(k, v, kv_scale_ptr, h, NUM_HEADS, KV_SCALED)
    k, v = k.to(tl.float8e4nv).to(tl.float32), v.to(tl.float8e4nv).to(tl.float32)
    if KV_SCALED:
        k = k * tl.load(kv_scale_ptr + h, mask=h < NUM_HEADS, other=1.0)[:, None]
        v = v * tl.load(kv_scale_ptr + NUM_HEADS + h, mask=h < NUM_HEADS, other=1.0)[:, None]
    out = t * NUM_HEADS * HEAD_DIM + h[:, None] * HEAD_DIM + d[None, :]
    tl.store(k_out_ptr + out, k.to(k_out_ptr.dtype.element_ty), mask=mask)
    tl.store(v_out_ptr + out, v.to(v_out_ptr.dtype.element_ty), mask=mask)


def rounded_as_cached(key: torch.Tensor, value: torch.Tensor,
                      kv_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """key/value [T, Hkv, D] -> new contiguous tensors of their dtype, each entry rounded as a
    float8 e4m3 cache holds it: divided by its kv head's scale (kv_scale [2, Hkv], contiguous float32;
    None: 1), saturated at +-448, rounded to e4m3 (as the store kernel rounds it), times the scale."""
    t, heads, dim = key.shape
    k_out, v_out = torch.empty_like(key, memory_format=torch.contiguous_format), torch.empty_like(
        value, memory_format=torch.contiguous_format)
    if t == 0:
        return k_out, v_out
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    _round_kernel[(t,)](key, value, k_out, v_out, k_out if kv_scale is None else kv_scale,
                        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                        NUM_HEADS=heads, HEADS_P=triton.next_power_of_2(heads), HEAD_DIM=dim,
                        KV_SCALED=kv_scale is not None, num_warps=4 if heads * dim >= 1024 else 1)
    return k_out, v_out


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
