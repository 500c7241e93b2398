"""Deterministic mode (`--deterministic`): a request's tokens do not depend on its batch.

Default kernels are free to pick their reduction order from the shapes of the whole step: a
matmul library picks another algorithm (split-K, another tile) for another number of rows, a
flash-decoding kernel splits the context by how many sequences share the GPU, and prefill and
decode attention are different kernels that sum in different orders. Each choice is exact to
within rounding, but rounding differences flip near-ties, so the same request gives another
answer next to other requests, after a chunked prefill, or after migrating to a worker that
recomputes its prompt. vLLM calls the fix batch invariance, SGLang deterministic inference.

Here every reduction a row sees depends on that row alone:

- **Matmuls** run in fixed-shape pieces of `Platform.invariant_rows` rows (the last piece
  padded): the library sees one shape whatever the batch, so it always runs the same algorithm,
  and a row of a matmul depends only on that row. The cost is padding: a decode step of b < rows
  sequences computes `rows` rows, which decode (bound by reading the weights) barely notices.
- **Attention**: every query row, prefill or decode, is computed as a one-token query over its
  sequence's paged KV (`Platform.row_attention`), with a split of the context that depends on
  the row's own length. A prompt's last token computed in a prefill and the same token computed
  in a decode step reduce in the same order: chunked prefill, prefix-cache hits, a prefill
  worker's hand-off and a migration's recompute all give the bits the plain decode gives.
- **Norms, rotary, activations** were per-row already (one program per row on CUDA).
- **Sampling**: greedy is an argmax per row; seeded rows draw from a hash of (seed, position,
  token id) (engine/runner/sampler.py); the sampler picks its fused or plain path per row, not per batch.
- **Tensor parallelism**: an all-reduce of two ranks is a single addition, the same in either
  order; more ranks sum in an order the collective library picks by message size, so
  deterministic mode takes at most two ranks.
"""
from __future__ import annotations

import numpy as np
import torch

from baton.models.attention_metadata import AttnMetadata


def fixed_rows_linear(rows: int):
    """F.linear computed in pieces of exactly `rows` rows: the same library call for any batch."""

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, k)
        m = flat.shape[0]
        padded = -(-m // rows) * rows
        if padded != m or not flat.is_contiguous():
            # a fresh buffer: every piece starts at a multiple of rows * k elements of an
            # allocation, so the library sees the same alignment too
            buf = flat.new_zeros(padded, k)
            buf[:m] = flat
            flat = buf
        out = flat.new_empty(padded, weight.shape[0])
        wt = weight.t()
        for start in range(0, padded, rows):
            piece = slice(start, start + rows)
            if bias is None:
                torch.mm(flat[piece], wt, out=out[piece])
            else:
                torch.addmm(bias, flat[piece], wt, out=out[piece])
        return out[:m].reshape(*lead, weight.shape[0])

    linear.rows = rows
    return linear


def make_batch_invariant(model: torch.nn.Module, ops, rows: int) -> None:
    """Route every matmul of `model` (its linear layers, LM head, the ops' expert GEMMs) through
    fixed_rows_linear(rows). Modules opt in by reading `self.matmul` (models/layers)."""
    if getattr(model, "uses_moe", False) and not ops.invariant_moe:
        raise ValueError(f"--deterministic does not cover {type(ops).__name__}'s expert GEMMs (their rows per "
                         "expert follow the batch): serve this MoE model without --deterministic")
    linear = fixed_rows_linear(rows)
    for module in model.modules():
        if hasattr(module, "matmul"):
            module.matmul = linear
    ops.make_batch_invariant(linear)


def row_metadata(meta: AttnMetadata) -> AttnMetadata:
    """Every query row of a step as a one-token sequence: row j of sequence i (q_len new tokens,
    seq_len in all) sits at position seq_len - q_len + j and sees that many keys plus itself,
    through sequence i's block table. A decode step is already this."""
    if meta.is_decode:
        return meta
    starts = np.asarray(meta.query_start_loc_cpu, np.int64)
    q_lens = np.diff(starts)
    owner = np.repeat(np.arange(len(q_lens)), q_lens)                  # row -> its sequence
    # row j of sequence i sees seq_len - q_len + j + 1 keys
    row_lens = (np.asarray(meta.seq_lens_cpu, np.int64) - q_lens)[owner] + np.arange(len(owner)) - starts[owner] + 1
    device = meta.seq_lens.device
    index = torch.from_numpy(owner).to(device, non_blocking=True)
    t = len(owner)
    row_lens_list = row_lens.tolist()
    return AttnMetadata(
        is_decode=True, slot_mapping=meta.slot_mapping,
        query_start_loc=torch.arange(t + 1, dtype=torch.int32).to(device, non_blocking=True),
        seq_lens=torch.from_numpy(row_lens.astype(np.int32)).to(device, non_blocking=True),
        block_tables=meta.block_tables.index_select(0, index), max_query_len=1,
        max_seq_len=max(row_lens_list, default=1), has_context=True,
        query_start_loc_cpu=list(range(t + 1)), seq_lens_cpu=row_lens_list, num_decode_rows=t)


class RowAttention:
    """The attention back end of deterministic mode (models/forward_context.AttentionBackend):
    prefill and decode rows alike through the platform's row_attention."""

    def __init__(self, platform):
        self.platform = platform
        self._rows: tuple[AttnMetadata, AttnMetadata] | None = None   # (step, its rows): every layer asks

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping, kv_scale=None) -> None:
        self.platform.store_kv(key, value, k_cache, v_cache, slot_mapping, kv_scale)

    def _rows_of(self, meta: AttnMetadata) -> AttnMetadata:
        if self._rows is None or self._rows[0] is not meta:
            self._rows = (meta, row_metadata(meta))
        return self._rows[1]

    def prefill_attention(self, q, k, v, k_cache, v_cache, meta: AttnMetadata, scale: float, kv_scale=None):
        if k_cache is None:      # no cache (a bare forward in tests): nothing to be invariant with
            return self.platform.prefill_attention(q, k, v, k_cache, v_cache, meta, scale)
        return self.platform.row_attention(q, k_cache, v_cache, self._rows_of(meta), scale, kv_scale)

    def decode_attention(self, q, k_cache, v_cache, meta: AttnMetadata, scale: float, kv_scale=None):
        return self.platform.row_attention(q, k_cache, v_cache, meta, scale, kv_scale)


__all__ = ["RowAttention", "fixed_rows_linear", "make_batch_invariant", "row_metadata"]
