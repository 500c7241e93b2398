"""Rotary position embeddings with a precomputed float32 cos/sin table.

Inverse frequencies are computed exactly as Hugging Face does (including Llama 3's
frequency-dependent scaling), so positions rotate identically and greedy tokens match.
LongRoPE follows MiniCPM's published modeling code (see `longrope_factors`).
"""
from __future__ import annotations

import math

import torch
from torch import nn


def rope_parameters(config) -> tuple[float, dict | None]:
    """(theta, scaling dict or None) from a transformers 4.x or 5.x config."""
    params = getattr(config, "rope_parameters", None)
    scaling = getattr(config, "rope_scaling", None)
    theta = getattr(config, "rope_theta", None)
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if params.get("rope_type", "default") != "default":
            scaling = params
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(theta if theta is not None else 10000.0), scaling


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None,
                        max_positions: int | None = None) -> torch.Tensor:
    """`max_positions`: the table's length, which picks LongRoPE's long or short factors."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "longrope":
        return inv / longrope_factors(head_dim, scaling, max_positions)
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: llama3, longrope)")
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def longrope_factors(head_dim: int, scaling: dict, max_positions: int | None) -> torch.Tensor:
    """MiniCPM's LongRoPE divides each frequency by a per-dimension factor. Its published code
    builds one table for max_position_embeddings, so the choice is static: the long factors when
    that exceeds original_max_position_embeddings, else the short ones (MiniCPM4-0.5B: equal, short)."""
    original = _original_max_positions(scaling)
    if max_positions is None:
        raise ValueError("longrope needs the table length (max_position_embeddings) to pick its factors")
    key = "long_factor" if max_positions > original else "short_factor"
    factors = scaling.get(key)
    if not isinstance(factors, (list, tuple)) or len(factors) != head_dim // 2:
        raise ValueError(f"longrope {key} must be a list of head_dim / 2 = {head_dim // 2} numbers, "
                         f"got {factors!r:.80}")
    return torch.tensor([float(f) for f in factors], dtype=torch.float32)


def rotary_magnitude(scaling: dict | None, max_positions: int) -> float:
    """What cos and sin are multiplied by: LongRoPE's attention factor
    sqrt(1 + ln(max / original) / ln(original)) (1.0 when the context is not extended);
    1.0 for every other kind."""
    if scaling is None or scaling.get("rope_type", scaling.get("type")) != "longrope":
        return 1.0
    original = _original_max_positions(scaling)
    return math.sqrt(1 + math.log(max_positions / original) / math.log(original))


def _original_max_positions(scaling: dict) -> int:
    original = scaling.get("original_max_position_embeddings")
    if not isinstance(original, int) or original < 2:
        raise ValueError(f"longrope needs original_max_position_embeddings >= 2, got {original!r}")
    return original


class RotaryEmbedding(nn.Module):
    """The cos/sin tables [max_positions, head_dim]; LayerOps.qk_norm_rotary applies them."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv = inverse_frequencies(head_dim, theta, scaling, max_positions)
        t = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(t, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        magnitude = rotary_magnitude(scaling, max_positions)
        if magnitude != 1.0:                 # skipped otherwise: other models' tables stay bit-identical
            cos, sin = cos * magnitude, sin * magnitude
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
