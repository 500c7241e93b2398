"""MiniCPM (MiniCPM4-0.5B, MiniCPM 1/2): the Llama decoder with muP scalings and LongRoPE.

From openbmb's published modeling_minicpm.py: token embeddings times `scale_emb`; each
attention and MLP output times `scale_depth / sqrt(num_hidden_layers)` before its residual
add; the final normed hidden state divided by `hidden_size / dim_model_base` before the head;
rotary "longrope" (models/layers/rotary.py). MiniCPM4-8B's InfLLM v2 sparse attention is not
implemented: its configs (`sparse_config`) are refused.
"""
from __future__ import annotations

import math

import torch

from baton.models.decoder import DecoderForCausalLM


class MiniCPMForCausalLM(DecoderForCausalLM):
    def __init__(self, config, ops, dtype=None, tp=None):
        _validate(config)
        super().__init__(config, ops, dtype, tp)
        self.model.embed_scale = float(config.scale_emb)
        residual_scale = float(config.scale_depth) / math.sqrt(config.num_hidden_layers)
        for layer in self.model.layers:
            layer.residual_scale = residual_scale
        self.logit_divisor = config.hidden_size / config.dim_model_base

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden / self.logit_divisor)


def _validate(config) -> None:
    if getattr(config, "sparse_config", None):
        raise ValueError("MiniCPM sparse attention (sparse_config, InfLLM v2 of MiniCPM4-8B) is not supported; "
                         "dense MiniCPM configs only")
    if getattr(config, "num_experts", 0):
        raise ValueError("MiniCPM-MoE (num_experts) is not supported; dense MiniCPM configs only")
    if getattr(config, "attention_bias", False):
        raise ValueError("MiniCPM with attention_bias=True is not supported (Baton's o_proj has no bias)")
    for name in ("scale_emb", "scale_depth", "dim_model_base"):
        value = getattr(config, name, None)
        if not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"MiniCPM config needs a positive {name}, got {value!r}")
