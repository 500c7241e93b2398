"""What a model needs from the runner for one forward pass: metadata, KV cache, attention back end.

Models never see the platform or the cache directly; each attention layer calls
`ctx.attend(layer_idx, q, k, v)`, which stores the new K/V into the paged cache and runs the
platform's prefill or decode attention.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from baton.models.attention_metadata import AttnMetadata


class AttentionBackend(Protocol):
    """The part of a platform (baton.engine.platforms) a forward pass calls."""

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None: ...

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor | None,
                          v_cache: torch.Tensor | None, meta: AttnMetadata, scale: float,
                          kv_scale: torch.Tensor | None = None) -> torch.Tensor: ...

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata,
                         scale: float, kv_scale: torch.Tensor | None = None) -> torch.Tensor: ...


@dataclass(slots=True)
class ForwardContext:
    meta: AttnMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None   # per layer (k_cache, v_cache); None = no cache
    platform: AttentionBackend
    scale: float
    # a float8 cache's K and V scales, [layers, 2, kv_heads] float32 (engine/runner/kv_scales.py); None: 1
    kv_scales: torch.Tensor | None = None
    # a piecewise capture in progress (engine/runner/prefill_graphs.py): each attention call ends a graph,
    # runs eagerly, and begins the next; None: attend at once
    pieces: object | None = None

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for this step's tokens -> [T, Hq, D]."""
        if self.pieces is not None:
            return self.pieces.attend(self, layer_idx, q, k, v)
        return self.attend_now(layer_idx, q, k, v)

    def attend_now(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """`attend` outside any capture."""
        if self.kv_caches is None:
            return self.platform.prefill_attention(q, k, v, None, None, self.meta, self.scale)
        k_cache, v_cache = self.kv_caches[layer_idx]
        kv_scale = None if self.kv_scales is None else self.kv_scales[layer_idx]
        self.platform.store_kv(k, v, k_cache, v_cache, self.meta.slot_mapping, kv_scale)
        if self.meta.is_decode:
            return self.platform.decode_attention(q, k_cache, v_cache, self.meta, self.scale, kv_scale)
        return self.platform.prefill_attention(q, k, v, k_cache, v_cache, self.meta, self.scale, kv_scale)

    def store(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Only store this step's k/v [T, Hkv, D] at their slots (no attention): what keeps a layer's
        KV current where its output is not needed (an EAGLE-3 head's steps that draft nothing)."""
        k_cache, v_cache = self.kv_caches[layer_idx]
        kv_scale = None if self.kv_scales is None else self.kv_scales[layer_idx]
        self.platform.store_kv(k, v, k_cache, v_cache, self.meta.slot_mapping, kv_scale)
