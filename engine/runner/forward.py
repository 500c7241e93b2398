"""The model and what its forward reads besides the step: the paged KV cache's layers and their
float8 scales, the attention back end, the softmax scale. The runner's executor, its decode and
prefill graphs, its warm-up and the draft head call the model through this one object.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.models.attention_metadata import AttnMetadata
from baton.models.forward_context import AttentionBackend, ForwardContext


@dataclass(frozen=True, slots=True)
class Forward:
    model: torch.nn.Module
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]   # per cache layer (k_cache, v_cache)
    attention: AttentionBackend        # the platform, or deterministic mode's row attention
    scale: float
    kv_scales: torch.Tensor | None     # a float8 cache's K and V scales (engine/runner/kv_scales.py); None: 1
    # an EAGLE-3 head reads three of the target's hidden states, which the model appends to its output
    # past this width (the model's hidden size); None: no head, the output is the model's alone
    aux_width: int | None = None

    def context(self, meta: AttnMetadata, pieces: object | None = None) -> ForwardContext:
        """A step's forward context over the cache (`pieces`: a piecewise capture in progress)."""
        return ForwardContext(meta, self.kv_caches, self.attention, self.scale, self.kv_scales, pieces=pieces)

    def split_aux(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the model's output, the hidden states the head reads: None without a head)."""
        if self.aux_width is None:
            return hidden, None
        return hidden[:, :self.aux_width], hidden[:, self.aux_width:]
