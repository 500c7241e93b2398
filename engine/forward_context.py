"""What a model needs from the runner for one forward pass: metadata, KV cache, attention back end.

Models never see the platform or the cache directly; each attention layer calls
`ctx.attend(layer_idx, q, k, v)`, which stores the new K/V into the paged cache and runs the
platform's prefill or decode attention.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.attention_metadata import AttnMetadata

if TYPE_CHECKING:
    from engine.platforms.base import Platform


@dataclass(slots=True)
class ForwardContext:
    meta: AttnMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None   # per layer (k_cache, v_cache); None = no cache
    platform: Platform
    scale: float

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for this step's tokens -> [T, Hq, D]."""
        if self.kv_caches is None:
            return self.platform.prefill_attention(q, k, v, None, None, self.meta, self.scale)
        k_cache, v_cache = self.kv_caches[layer_idx]
        self.platform.store_kv(k, v, k_cache, v_cache, self.meta.slot_mapping)
        if self.meta.is_decode:
            return self.platform.decode_attention(q, k_cache, v_cache, self.meta, self.scale)
        return self.platform.prefill_attention(q, k, v, k_cache, v_cache, self.meta, self.scale)
