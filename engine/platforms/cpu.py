"""The CPU platform: plain-torch reference attention over the paged KV cache.

Every other platform is tested against this one, so it favours obvious correctness:
per-sequence SDPA for prefill, a padded gather for decode.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from baton.engine.platforms.base import Platform, as_cached, from_cache_dtype, is_fp8, to_cache_dtype
from baton.models.attention_metadata import AttnMetadata


class CpuPlatform(Platform):
    name = "cpu"
    dist_backend = "gloo"
    supports_graphs = False
    invariant_rows = 16      # deterministic mode pads decode matmuls to this many rows: small, the CPU is compute-bound

    def default_dtype(self) -> torch.dtype:
        return torch.float32

    def memory_info(self) -> tuple[int, int]:
        """(available, total) bytes: Linux's MemAvailable, which counts the page cache the kernel gives
        back (MemFree does not: after a long run of file I/O it shrank a default KV cache by half)."""
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return max(free, int(line.split()[1]) * 1024), total
        except (OSError, ValueError, IndexError):
            pass
        return free, total

    def fp8_linear(self) -> str:
        """torch's CPU build has a float8 `_scaled_mm` (row-wise scales) since 2.7 or so; where it
        does not, the weights are widened per call: the same numbers, slower."""
        return "scaled_mm" if _cpu_scaled_mm() else "dequant"

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping, kv_scale=None) -> None:
        valid = slot_mapping >= 0
        if not bool(valid.all()):
            key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
        ks, vs = _split(kv_scale)
        key, value = to_cache_dtype(key, k_cache.dtype, ks), to_cache_dtype(value, v_cache.dtype, vs)
        if is_fp8(k_cache.dtype):       # index_copy_ has no float8 kernel on the CPU: copy the bytes
            k_cache, v_cache, key, value = (t.view(torch.uint8) for t in (k_cache, v_cache, key, value))
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value)

    def prefill_attention(self, q, k, v, k_cache, v_cache, meta: AttnMetadata, scale: float, kv_scale=None):
        ks, vs = _split(kv_scale)
        if k_cache is not None:
            k, v = as_cached(k, k_cache.dtype, ks), as_cached(v, v_cache.dtype, vs)
        out = torch.empty_like(q)
        starts = meta.query_start_loc_cpu
        for i, seq_len in enumerate(meta.seq_lens_cpu):
            qs, qe = starts[i], starts[i + 1]
            if qe == qs:
                continue
            if meta.has_context and k_cache is not None:
                keys, values = gather_sequence_kv(k_cache, v_cache, meta.block_tables[i], seq_len, q.dtype, kv_scale)
            else:
                keys, values = k[qs:qe], v[qs:qe]
            out[qs:qe] = _causal_attention(q[qs:qe], keys, values, scale)
        return out

    def decode_attention(self, q, k_cache, v_cache, meta: AttnMetadata, scale: float, kv_scale=None):
        block_size = k_cache.shape[1]
        tables = meta.block_tables.long().clamp(min=0)
        max_blocks = (meta.max_seq_len + block_size - 1) // block_size
        tables = tables[:, :max_blocks]
        b = tables.shape[0]
        ks, vs = _split(kv_scale)
        keys = from_cache_dtype(k_cache[tables], q.dtype, ks).reshape(b, max_blocks * block_size, *k_cache.shape[2:])
        values = from_cache_dtype(v_cache[tables], q.dtype, vs).reshape(b, max_blocks * block_size, *v_cache.shape[2:])
        positions = torch.arange(keys.shape[1], device=q.device)
        mask = positions[None, :] < meta.seq_lens[:, None].to(positions.dtype)     # [B, S]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2).to(keys.dtype),                  # [B, Hq, 1, D]
            keys.transpose(1, 2), values.transpose(1, 2),   # [B, Hkv, S, D]
            attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True,
        )
        return out.squeeze(2).to(q.dtype)


    def row_attention(self, q, k_cache, v_cache, rows: AttnMetadata, scale: float, kv_scale=None):
        """Each row alone, in shapes fixed by its own length: its keys gathered and laid out the
        same way whatever the batch, the group's query heads times its keys as one batched
        matmul per kv head, softmax, times its values."""
        out = torch.empty_like(q)
        hkv, d = k_cache.shape[2], k_cache.shape[3]
        group = q.shape[1] // hkv
        for r, seq_len in enumerate(rows.seq_lens_cpu):
            keys, values = gather_sequence_kv(k_cache, v_cache, rows.block_tables[r], seq_len, q.dtype, kv_scale)
            k_t = keys.permute(1, 2, 0).contiguous()           # [Hkv, D, L]
            v_r = values.permute(1, 0, 2).contiguous()         # [Hkv, L, D]
            q_r = q[r].reshape(hkv, group, d).to(k_t.dtype)
            probs = torch.softmax(torch.bmm(q_r, k_t) * scale, dim=-1)
            out[r] = torch.bmm(probs, v_r).reshape(hkv * group, d).to(q.dtype)
        return out


def _split(kv_scale: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A layer's [2, Hkv] K/V scales as (K's, V's); (None, None) without."""
    return (None, None) if kv_scale is None else (kv_scale[0], kv_scale[1])


def _cpu_scaled_mm() -> bool:
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def gather_sequence_kv(k_cache, v_cache, block_table, seq_len: int, dtype: torch.dtype | None = None,
                       kv_scale: torch.Tensor | None = None):
    """The first seq_len cached tokens of one sequence, [seq_len, Hkv, D] each (a float8 cache's
    widened to `dtype`, times its per-head scales `kv_scale` [2, Hkv])."""
    block_size = k_cache.shape[1]
    n = (seq_len + block_size - 1) // block_size
    blocks = block_table[:n].long()
    keys = k_cache[blocks].reshape(-1, *k_cache.shape[2:])[:seq_len]
    values = v_cache[blocks].reshape(-1, *v_cache.shape[2:])[:seq_len]
    ks, vs = _split(kv_scale)
    return from_cache_dtype(keys, dtype, ks), from_cache_dtype(values, dtype, vs)


def _causal_attention(q, keys, values, scale):
    """q [Tq, Hq, D] are the last Tq positions of a Tk-long history; keys/values [Tk, Hkv, D].

    In the shapes torch's fused CPU kernel takes ([1, H, T, D], every query head's keys, is_causal),
    which skips the masked half and never builds the [Tq, Tk] scores (6-10x the masked SDPA at
    2-7k tokens on two cores). Past cached context, the context and the new tokens attend apart and
    are merged by their log-sum-exps: exact, where a boolean mask would send SDPA down its slow path.
    float32 histories of FUSED_MIN_TOKENS or more only: the rest keep the masked path."""
    tq, tk, hq = q.shape[0], keys.shape[0], q.shape[1]
    if keys.dtype != torch.float32 or tk < FUSED_MIN_TOKENS:
        # bf16/fp16: the masked path, whose rounding the NPU emulation shares; short histories too, where the
        # fused kernel saves little and its different summation order moved a tiny MoE's expert choice in tests
        return _masked_attention(q, keys, values, scale)
    q4 = q.transpose(0, 1).unsqueeze(0).to(keys.dtype)
    k4, v4 = (_per_query_head(t, hq) for t in (keys, values))
    if tq == tk:
        out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale)
    elif _FLASH_LSE is None:
        return _masked_attention(q, keys, values, scale)
    else:
        ctx = tk - tq
        past, past_lse = _FLASH_LSE(q4, k4[:, :, :ctx], v4[:, :, :ctx], scale=scale)[:2]
        new, new_lse = _FLASH_LSE(q4, k4[:, :, ctx:], v4[:, :, ctx:], is_causal=True, scale=scale)[:2]
        top = torch.maximum(past_lse, new_lse)
        w_past, w_new = (torch.exp(lse - top).unsqueeze(-1) for lse in (past_lse, new_lse))
        out = (past * w_past + new * w_new) / (w_past + w_new)
    return out.squeeze(0).transpose(0, 1).to(q.dtype)


def _masked_attention(q, keys, values, scale):
    tq, tk = q.shape[0], keys.shape[0]
    mask = torch.arange(tk, device=q.device)[None, :] <= torch.arange(tk - tq, tk, device=q.device)[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).to(keys.dtype), keys.transpose(0, 1), values.transpose(0, 1),
        attn_mask=mask, scale=scale, enable_gqa=True,
    )
    return out.transpose(0, 1).to(q.dtype)


def _per_query_head(t: torch.Tensor, hq: int) -> torch.Tensor:
    """[T, Hkv, D] -> [1, Hq, T, D], each kv head repeated for its group of query heads."""
    return t.transpose(0, 1).repeat_interleave(hq // t.shape[1], dim=0).unsqueeze(0)


FUSED_MIN_TOKENS = 512       # histories at least this long take the fused kernel

# torch's fused CPU attention, with the log-sum-exp the context/new merge needs (None: not this torch)
_FLASH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
