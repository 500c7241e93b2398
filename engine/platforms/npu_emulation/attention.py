"""Emulated fused infer attention (v2) and the paged KV store, per their documented semantics."""
from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from baton.engine.platforms.npu_emulation.common import (
    FIA_DTYPES,
    INT32_MAX,
    MASK_SIZE,
    MAX_GQA_RATIO,
    NpuEmulationError,
    _require,
    _unsupported,
)

# -- fused infer attention (v2) ---------------------------------------------------------------------
_FIA = "npu_fused_infer_attention_score_v2"
_FIA_UNEMULATED = ("query_rope", "key_rope", "pse_shift", "dequant_scale_query", "dequant_scale_key",
                   "dequant_offset_key", "dequant_scale_value", "dequant_offset_value", "quant_scale_out",
                   "quant_offset_out", "learnable_sink", "out_dtype")
_FIA_RESERVED = ("dequant_scale_key_rope", "quant_scale_p", "query_dtype", "key_dtype", "value_dtype",
                 "query_rope_dtype", "key_rope_dtype", "key_shared_prefix_dtype", "value_shared_prefix_dtype",
                 "dequant_scale_query_dtype", "dequant_scale_key_dtype", "dequant_scale_value_dtype",
                 "dequant_scale_key_rope_dtype")


@dataclass(slots=True)
class _FiaPlan:
    """A validated FIA call: per-batch query rows, kv lengths, and where K/V come from."""
    batch: int
    q_rows: list[tuple[int, int]]          # (start, length) of each batch's queries in the flat query
    kv_lens: list[int]
    kv_starts: list[int]                   # non-paged: start of each batch's keys in the flat key
    q_heads: int
    kv_heads: int
    head_dim: int
    causal: bool                           # sparse_mode 3 (rightDownCausal) applies
    paged: bool


def _fia_validate(query, key, value, atten_mask, actual_seq_qlen, actual_seq_kvlen, block_table,
                  num_query_heads, num_key_value_heads, softmax_scale, input_layout, sparse_mode, block_size,
                  inner_precise, return_softmax_lse, extra) -> _FiaPlan:
    for name in _FIA_UNEMULATED:
        if extra.get(name) is not None:
            raise _unsupported(_FIA, name)
    for name in _FIA_RESERVED:
        _require(extra.get(name) is None, _FIA, f"{name} is reserved and must stay None")
    for name in ("query_quant_mode", "key_quant_mode", "value_quant_mode"):
        if extra.get(name, 0) != 0:
            raise _unsupported(_FIA, name)
    if return_softmax_lse:
        raise _unsupported(_FIA, "return_softmax_lse=True")
    _require(query.dtype in FIA_DTYPES, _FIA, f"query must be float16 or bfloat16, got {query.dtype}")
    _require(key.dtype == query.dtype and value.dtype == query.dtype, _FIA,
             f"key/value dtype ({key.dtype}, {value.dtype}) must match query ({query.dtype}) without quantization")
    for name, t in (("query", query), ("key", key), ("value", value)):
        _require(t.is_contiguous(), _FIA, f"{name} must be contiguous")
    _require(key.shape == value.shape, _FIA, f"key and value shapes must match, got {tuple(key.shape)} "
             f"and {tuple(value.shape)}")
    _require(isinstance(softmax_scale, float), _FIA, f"softmax_scale must be a float, got {softmax_scale!r}")
    _require(num_query_heads >= 1, _FIA, "num_query_heads must be >= 1")
    kv_heads = num_key_value_heads or num_query_heads
    _require(num_query_heads % kv_heads == 0 and num_query_heads // kv_heads <= MAX_GQA_RATIO, _FIA,
             f"num_key_value_heads ({kv_heads}) must divide num_query_heads ({num_query_heads}) with ratio <= 64")
    _require(sparse_mode in (0, 1, 2, 3, 4, 9), _FIA, f"sparse_mode must be 0, 1, 2, 3, 4 or 9, got {sparse_mode}")
    _require(inner_precise in (0, 1, 2, 3), _FIA, f"inner_precise must be 0..3, got {inner_precise}")
    if input_layout == "BSND":
        return _plan_bsnd(query, key, atten_mask, actual_seq_qlen, actual_seq_kvlen, block_table,
                          num_query_heads, kv_heads, sparse_mode, block_size, inner_precise)
    if input_layout == "TND":
        return _plan_tnd(query, key, atten_mask, actual_seq_qlen, actual_seq_kvlen, block_table,
                         num_query_heads, kv_heads, sparse_mode, block_size)
    if input_layout in ("BSH", "BNSD", "BNSD_BSND", "BSH_NBSD", "BSND_NBSD", "BNSD_NBSD", "TND_NTD", "NTD_TND"):
        raise _unsupported(_FIA, f"input_layout {input_layout!r}")
    raise NpuEmulationError(f"{_FIA}: unknown input_layout {input_layout!r}")


def _head_dim_ok(d: int, n: int, batch: int) -> None:
    _require(d % 16 == 0 and d <= 512, _FIA, f"head dim D must be a multiple of 16 and <= 512 (fp16/bf16), got {d}")
    _require(n <= 256, _FIA, f"N must be <= 256, got {n}")
    _require(batch <= 65536, _FIA, f"B must be <= 65536, got {batch}")


def _lengths(values, batch: int, op_arg: str) -> list[int]:
    """Per-batch lengths: one value for all batches, or at least `batch` values (first `batch` used)."""
    _require(isinstance(values, (list, tuple)) and all(isinstance(v, int) for v in values), _FIA,
             f"{op_arg} must be a list of ints (host values), got {type(values).__name__}")
    _require(len(values) == 1 or len(values) >= batch, _FIA,
             f"{op_arg} must have 1 or >= B ({batch}) entries, got {len(values)}")
    lens = list(values) * batch if len(values) == 1 else list(values[:batch])
    _require(all(v >= 0 for v in lens), _FIA, f"{op_arg} entries must be >= 0")
    return lens


def _check_mask(atten_mask, sparse_mode: int, needed: bool) -> None:
    """sparse_mode 3 takes the compressed 2048x2048 mask, 1/True = masked, upper triangle."""
    if not needed:
        return
    if sparse_mode == 0:
        if atten_mask is not None:
            raise _unsupported(_FIA, "sparse_mode 0 with an explicit atten_mask")
        return
    if sparse_mode != 3:
        raise _unsupported(_FIA, f"sparse_mode {sparse_mode}")
    _require(atten_mask is not None, _FIA, "sparse_mode 3 needs atten_mask (the 2048x2048 compressed mask)")
    _require(atten_mask.dtype in (torch.bool, torch.int8, torch.uint8), _FIA,
             f"atten_mask must be bool, int8 or uint8, got {atten_mask.dtype}")
    shape = tuple(atten_mask.shape)
    _require(shape in ((MASK_SIZE, MASK_SIZE), (1, MASK_SIZE, MASK_SIZE), (1, 1, MASK_SIZE, MASK_SIZE)), _FIA,
             f"sparse_mode 3 takes atten_mask of shape (2048, 2048), (1, 2048, 2048) or (1, 1, 2048, 2048), "
             f"got {shape}")
    _require(atten_mask.is_contiguous(), _FIA, "atten_mask must be contiguous")
    ref = _checked_masks.get(id(atten_mask))
    if ref is None or ref() is not atten_mask:         # verified once per mask tensor
        want = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=atten_mask.device).triu(1)
        _require(bool(torch.equal(atten_mask.reshape(MASK_SIZE, MASK_SIZE).bool(), want)), _FIA,
                 "sparse_mode 3's atten_mask must be the causal pattern: 1/True (masked) strictly above "
                 "the diagonal, 0/False on and below it")
        _checked_masks[id(atten_mask)] = weakref.ref(atten_mask)


_checked_masks: dict[int, weakref.ref] = {}   # id -> the mask, if still alive (not mutated later)


def _check_paged(op_layout: str, key, block_table, kv_lens: list[int], batch: int, block_size: int,
                 d: int, kv_heads: int, q_s: int) -> None:
    _require(key.dim() == 3, _FIA, f"with {op_layout} the paged cache must be (blocks, block_size, KV_N*D), "
             f"got shape {tuple(key.shape)}")
    nblk, bs, h = key.shape
    _require(block_size == bs, _FIA, f"block_size argument ({block_size}) must equal the cache's block size ({bs})")
    if op_layout == "TND":
        _require(bs % 16 == 0 and bs <= 1024, _FIA, f"TND paged attention needs block_size 16-aligned and <= 1024, "
                 f"got {bs}")
    elif q_s > 1:
        _require(bs % 128 == 0 and 128 <= bs <= 512, _FIA, "paged attention with Q_S > 1 needs block_size in "
                 f"[128, 512] and a multiple of 128, got {bs}")
    else:
        _require(bs % 16 == 0 and bs <= 512, _FIA, f"paged attention with Q_S = 1 needs block_size 16-aligned "
                 f"and <= 512, got {bs}")
    _require(h == kv_heads * d, _FIA, f"cache hidden size ({h}) must be num_key_value_heads ({kv_heads}) x D ({d})")
    _require(h <= 65535, _FIA, f"KV_N*D must be <= 65535 in the (blocks, block_size, H) layout, got {h}")
    _require(block_table.dtype == torch.int32 and block_table.dim() == 2, _FIA,
             f"block_table must be a 2-D int32 tensor, got {block_table.dtype} {tuple(block_table.shape)}")
    _require(block_table.shape[0] == batch, _FIA, f"block_table's first dim must be B ({batch}), "
             f"got {block_table.shape[0]}")
    need = [-(-n // bs) for n in kv_lens]
    _require(block_table.shape[1] >= max(need, default=0), _FIA,
             f"block_table's second dim ({block_table.shape[1]}) is below the blocks the longest actual_seq_kvlen "
             f"needs ({max(need)})")
    _require(nblk >= sum(need), _FIA, f"the cache's block count ({nblk}) is below the sum of blocks each batch's "
             f"actual_seq_kvlen needs ({sum(need)})")
    for b, n in enumerate(need):                   # ids past a sequence's length are never read
        ids = block_table[b, :n]
        _require(bool(((ids >= 0) & (ids < nblk)).all()), _FIA,
                 f"block_table row {b} names blocks outside [0, {nblk}) within its actual_seq_kvlen")
    _require(key.numel() <= INT32_MAX, _FIA, "a paged cache's element count must fit in int32")


def _plan_bsnd(query, key, atten_mask, actual_seq_qlen, actual_seq_kvlen, block_table, q_heads, kv_heads,
               sparse_mode, block_size, inner_precise) -> _FiaPlan:
    _require(query.dim() == 4, _FIA, f"BSND query must be (B, S, N, D), got shape {tuple(query.shape)}")
    b, q_s, n, d = query.shape
    _require(n == q_heads, _FIA, f"num_query_heads ({q_heads}) must equal the query's N ({n})")
    _head_dim_ok(d, n, b)
    if q_s == 1:
        _require(inner_precise in (0, 1), _FIA, "inner_precise must be 0 or 1 when Q_S = 1")
    q_lens = _lengths(actual_seq_qlen, b, "actual_seq_qlen") if actual_seq_qlen is not None and q_s > 1 else [q_s] * b
    _require(all(q <= q_s for q in q_lens), _FIA, f"actual_seq_qlen entries must be <= the query's S ({q_s})")
    paged = block_table is not None
    if paged:
        _require(actual_seq_kvlen is not None, _FIA, "paged attention (block_table given) needs actual_seq_kvlen")
        kv_lens = _lengths(actual_seq_kvlen, b, "actual_seq_kvlen")
        _check_paged("BSND", key, block_table, kv_lens, b, block_size, d, kv_heads, q_s)
        kv_s = None
    else:
        _require(key.dim() == 4 and key.shape[0] == b and key.shape[2] == kv_heads and key.shape[3] == d, _FIA,
                 f"BSND key/value must be (B, KV_S, KV_N, D) = ({b}, S, {kv_heads}, {d}), got {tuple(key.shape)}")
        kv_s = key.shape[1]
        kv_lens = _lengths(actual_seq_kvlen, b, "actual_seq_kvlen") if actual_seq_kvlen is not None else [kv_s] * b
        _require(all(k <= kv_s for k in kv_lens), _FIA, f"actual_seq_kvlen entries must be <= the key's S ({kv_s})")
    causal = q_s > 1 and sparse_mode == 3
    _check_mask(atten_mask, sparse_mode, needed=q_s > 1)
    if causal:
        _require(all(k >= q for q, k in zip(q_lens, kv_lens, strict=True)), _FIA,
                 "rightDownCausal with actual_seq_kvlen < actual_seq_qlen leaves query rows nothing to attend "
                 "(undefined on the device with inner_precise 0/1)")
    rows = [(i * q_s, q) for i, q in enumerate(q_lens)]
    starts = [0] * b if paged else [i * kv_s for i in range(b)]
    return _FiaPlan(b, rows, kv_lens, starts, q_heads, kv_heads, d, causal, paged)


def _cumulative(values, op_arg: str) -> list[int]:
    _require(isinstance(values, (list, tuple)) and all(isinstance(v, int) for v in values), _FIA,
             f"TND needs {op_arg} as a list of ints (host values)")
    _require(0 < len(values) <= 4096, _FIA, f"TND {op_arg} must have 1..4096 entries (the batch), got {len(values)}")
    _require(values[0] >= 0 and all(b >= a for a, b in zip(values, values[1:], strict=False)), _FIA,
             f"TND {op_arg} must be cumulative (non-decreasing ends, no negatives), got {list(values)[:8]}...")
    return list(values)


def _plan_tnd(query, key, atten_mask, actual_seq_qlen, actual_seq_kvlen, block_table, q_heads, kv_heads,
              sparse_mode, block_size) -> _FiaPlan:
    _require(query.dim() == 3, _FIA, f"TND query must be (T, N, D), got shape {tuple(query.shape)}")
    t, n, d = query.shape
    _require(n == q_heads, _FIA, f"num_query_heads ({q_heads}) must equal the query's N ({n})")
    _require(actual_seq_qlen is not None and actual_seq_kvlen is not None, _FIA,
             "TND needs both actual_seq_qlen and actual_seq_kvlen")
    q_ends = _cumulative(actual_seq_qlen, "actual_seq_qlen")
    _require(q_ends[-1] == t, _FIA, f"TND actual_seq_qlen's last entry ({q_ends[-1]}) must be T ({t})")
    mha = q_heads == kv_heads
    _require(d == 128 or (mha and d == 64), _FIA,
             f"TND without rope needs D = 128 (or 64 for MHA; 192 only with V_D 128), got D = {d}")
    b = len(q_ends)
    q_lens = [e - s for s, e in zip([0] + q_ends[:-1], q_ends, strict=True)]
    paged = block_table is not None
    if paged:          # paged: kv lengths are per batch, not cumulative
        kv_lens = _lengths(actual_seq_kvlen, b, "actual_seq_kvlen")
        _require(len(actual_seq_kvlen) == b, _FIA, f"TND paged actual_seq_kvlen must have B ({b}) entries")
        _check_paged("TND", key, block_table, kv_lens, b, block_size, d, kv_heads, q_s=2)
        starts = [0] * b
    else:
        kv_ends = _cumulative(actual_seq_kvlen, "actual_seq_kvlen")
        _require(len(kv_ends) == b, _FIA, "TND actual_seq_kvlen must have as many entries as actual_seq_qlen")
        _require(key.dim() == 3 and key.shape[0] == kv_ends[-1] and key.shape[1:] == (kv_heads, d), _FIA,
                 f"TND key/value must be (T_kv, KV_N, D) with T_kv = {kv_ends[-1]}, got {tuple(key.shape)}")
        starts = [0] + kv_ends[:-1]
        kv_lens = [e - s for s, e in zip(starts, kv_ends, strict=True)]
    _check_mask(atten_mask, sparse_mode, needed=True)
    causal = sparse_mode == 3
    if causal:
        _require(all(k >= q for q, k in zip(q_lens, kv_lens, strict=True)), _FIA,
                 "rightDownCausal with kv length < q length leaves query rows nothing to attend")
    rows = list(zip([0] + q_ends[:-1], q_lens, strict=True))
    return _FiaPlan(b, rows, kv_lens, starts, q_heads, kv_heads, d, causal, paged)


def _fia_compute(query, key, value, block_table, plan: _FiaPlan, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v per batch, rightDownCausal when asked (query i of a batch with
    lengths Q, K attends kv j <= K - Q + i). The arithmetic is torch SDPA in the input dtype,
    the same primitive the CPU platform uses, so the two can agree bit for bit; a device kernel
    rounds its own way. Query rows past a batch's actual_seq_qlen come out NaN (undefined)."""
    d = plan.head_dim
    flat_q = query.reshape(-1, plan.q_heads, d)
    out = torch.full_like(flat_q, float("nan"))
    if plan.paged:
        nblk, bs, _ = key.shape
        k_flat = key.reshape(nblk * bs, plan.kv_heads, d)
        v_flat = value.reshape(nblk * bs, plan.kv_heads, d)
    else:
        k_flat = key.reshape(-1, plan.kv_heads, d)
        v_flat = value.reshape(-1, plan.kv_heads, d)
    if plan.paged and all(q == 1 for _, q in plan.q_rows) and len(plan.q_rows) == flat_q.shape[0]:
        return _paged_single_query(flat_q, k_flat, v_flat, block_table, plan, scale, bs).reshape(query.shape)
    for b, ((q0, q_len), kv_len) in enumerate(zip(plan.q_rows, plan.kv_lens, strict=True)):
        if q_len == 0:
            continue
        if kv_len == 0:                           # empty key/value: the documented result is zeros
            out[q0:q0 + q_len] = 0
            continue
        if plan.paged:
            pos = torch.arange(kv_len, device=query.device)
            slots = block_table[b].long()[pos // bs] * bs + pos % bs
            k, v = k_flat[slots], v_flat[slots]
        else:
            s = plan.kv_starts[b]
            k, v = k_flat[s:s + kv_len], v_flat[s:s + kv_len]
        mask = None
        if plan.causal:
            qi = torch.arange(q_len, device=query.device)[:, None]
            kj = torch.arange(kv_len, device=query.device)[None, :]
            mask = kj <= kv_len - q_len + qi                       # True = attends
        out[q0:q0 + q_len] = F.scaled_dot_product_attention(
            flat_q[q0:q0 + q_len].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=True).transpose(0, 1)
    return out.reshape(query.shape)


def _paged_single_query(q, k_flat, v_flat, block_table, plan: _FiaPlan, scale: float, bs: int) -> torch.Tensor:
    """Q_S = 1 over the paged cache, all batches at once: each batch's blocks gathered to the
    longest length, positions past its actual_seq_kvlen masked (never read on the device)."""
    nb = max(-(-n // bs) for n in plan.kv_lens)
    if nb == 0:
        return torch.zeros_like(q)
    b = q.shape[0]
    pos = torch.arange(nb * bs, device=q.device)
    slots = block_table[:, :nb].long().clamp(min=0).repeat_interleave(bs, dim=1) * bs + pos % bs
    keys, values = k_flat[slots], v_flat[slots]                        # [B, S, KV_N, D]
    lens = torch.tensor(plan.kv_lens, device=q.device)
    mask = pos[None, :] < lens[:, None]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True).squeeze(2)
    return out.masked_fill((lens == 0)[:, None, None], 0).reshape(b, *q.shape[1:])


def npu_fused_infer_attention_score_v2(
        query, key, value, *, query_rope=None, key_rope=None, pse_shift=None, atten_mask=None,
        actual_seq_qlen=None, actual_seq_kvlen=None, block_table=None, dequant_scale_query=None,
        dequant_scale_key=None, dequant_offset_key=None, dequant_scale_value=None, dequant_offset_value=None,
        dequant_scale_key_rope=None, quant_scale_out=None, quant_offset_out=None, quant_scale_p=None,
        learnable_sink=None, num_query_heads=1, num_key_value_heads=0, softmax_scale=1.0, pre_tokens=2147483647,
        next_tokens=2147483647, input_layout="BSH", sparse_mode=0, block_size=0, query_quant_mode=0,
        key_quant_mode=0, value_quant_mode=0, inner_precise=0, return_softmax_lse=False, query_dtype=None,
        key_dtype=None, value_dtype=None, query_rope_dtype=None, key_rope_dtype=None, key_shared_prefix_dtype=None,
        value_shared_prefix_dtype=None, dequant_scale_query_dtype=None, dequant_scale_key_dtype=None,
        dequant_scale_value_dtype=None, dequant_scale_key_rope_dtype=None, out_dtype=None):
    """Emulated FIA v2 (BSND and TND, paged or not, sparse_mode 0 without mask or 3) ->
    (attention_out, softmax_lse); softmax_lse is the documented [1] zeros (no lse asked)."""
    extra = dict(locals())
    plan = _fia_validate(query, key, value, atten_mask, actual_seq_qlen, actual_seq_kvlen, block_table,
                         num_query_heads, num_key_value_heads, softmax_scale, input_layout, sparse_mode, block_size,
                         inner_precise, return_softmax_lse, extra)
    out = _fia_compute(query, key, value, block_table, plan, softmax_scale)
    return out, torch.zeros(1, dtype=torch.float32, device=query.device)


def _fia_out(query, key, value, *, workspace=None, out=None, **kwargs):
    """Emulated `.out` variant: writes attention_out into out[0]; out[1] (lse) is left alone."""
    _require(isinstance(out, (list, tuple)) and len(out) == 2, _FIA + ".out", "out must be [attention_out, lse]")
    _require(out[0].shape == query.shape and out[0].dtype == query.dtype, _FIA + ".out",
             f"out[0] must have the query's shape {tuple(query.shape)} and dtype {query.dtype}")
    _require(workspace is None or isinstance(workspace, torch.Tensor), _FIA + ".out", "workspace must be a tensor")
    result, _ = npu_fused_infer_attention_score_v2(query, key, value, **kwargs)
    out[0].copy_(result)
    return out


def _fia_workspace(query, key, value, **kwargs) -> torch.Tensor:
    """Emulated _npu_fused_infer_attention_score_v2_get_max_workspace: takes the op's own
    arguments, validates them as the op does, returns a 1-byte placeholder (size not modelled)."""
    bound = inspect.signature(npu_fused_infer_attention_score_v2).bind(query, key, value, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    _fia_validate(query, key, value, a["atten_mask"], a["actual_seq_qlen"], a["actual_seq_kvlen"], a["block_table"],
                  a["num_query_heads"], a["num_key_value_heads"], a["softmax_scale"], a["input_layout"],
                  a["sparse_mode"], a["block_size"], a["inner_precise"], a["return_softmax_lse"], a)
    return torch.empty(1, dtype=torch.uint8, device=query.device)


# -- KV cache store -------------------------------------------------------------------------------
def _npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices):
    """Emulated ATB ReshapeAndCache: key/value (T, KV_N, D) into caches (blocks, block_size,
    KV_N, D) at flat slots block_id * block_size + offset (int32), in place; slot -1 is skipped
    (the padding convention npu.py relies on; see docs/npu.md)."""
    op = "_npu_reshape_and_cache"
    _require(key.dim() == 3 and key.shape == value.shape, op,
             f"key/value must both be (T, KV_N, D), got {tuple(key.shape)} and {tuple(value.shape)}")
    _require(key_cache.dim() == 4 and key_cache.shape == value_cache.shape, op,
             f"caches must both be (blocks, block_size, KV_N, D), got {tuple(key_cache.shape)} and "
             f"{tuple(value_cache.shape)}")
    _require(key.shape[1:] == key_cache.shape[2:], op, f"key's (KV_N, D) {tuple(key.shape[1:])} must match the "
             f"cache's {tuple(key_cache.shape[2:])}")
    _require(key.dtype == key_cache.dtype and value.dtype == value_cache.dtype, op,
             f"key/value dtype ({key.dtype}) must match the cache dtype ({key_cache.dtype})")
    _require(key_cache.is_contiguous() and value_cache.is_contiguous(), op, "caches must be contiguous (ND)")
    _require(slot_indices.dtype == torch.int32 and slot_indices.dim() == 1, op,
             f"slot_indices must be 1-D int32, got {slot_indices.dtype} {tuple(slot_indices.shape)}")
    _require(slot_indices.shape[0] == key.shape[0], op, f"one slot per token: {slot_indices.shape[0]} slots "
             f"for {key.shape[0]} tokens")
    capacity = key_cache.shape[0] * key_cache.shape[1]
    slots = slot_indices.long()
    _require(bool(((slots >= -1) & (slots < capacity)).all()), op,
             f"slots must be in [0, {capacity}) (or -1 for a padding row)")
    keep = slots >= 0
    slots = slots[keep]
    _require(slots.unique().numel() == slots.numel(), op, "two tokens write the same slot (order undefined)")
    key_cache.view(capacity, *key_cache.shape[2:]).index_copy_(0, slots, key[keep])
    value_cache.view(capacity, *value_cache.shape[2:]).index_copy_(0, slots, value[keep])
