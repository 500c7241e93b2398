"""Rotary position embeddings with a precomputed float32 cos/sin table.

Inverse frequencies are computed exactly as Hugging Face transformers does (modeling_rope_utils:
linear, dynamic NTK, YaRN, Llama 3), so positions rotate identically and greedy tokens match.
LongRoPE follows MiniCPM's published modeling code (see `longrope_factors`). Dynamic NTK is the one
kind a table indexed by position alone can only follow in part: see `rotary_angles`. Every
platform (CPU, CUDA's fused Triton kernel, the NPU's npu_rotary_mul) reads these tables at the
step's positions; none derives angles from theta itself. Reading the config: rope_config.py.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from baton.models.layers.rope_config import (
    check_scaling,
    context_length,
    original_max_positions,
    scaling_factor,
    scaling_kind,
    yarn_factor,
)


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None,
                        max_positions: int | None = None) -> torch.Tensor:
    """[head_dim / 2] float32, as transformers' ROPE_INIT_FUNCTIONS give them at load. `max_positions`:
    max_position_embeddings, which picks LongRoPE's long or short factors and YaRN's defaults. Dynamic
    NTK: the frequencies within max_position_embeddings (past it, `dynamic_ntk_frequencies`)."""
    kind = scaling_kind(scaling)
    if kind == "yarn":
        return yarn_frequencies(head_dim, theta, scaling, max_positions)
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if kind == "linear":
        return inv / scaling_factor(scaling)
    if kind == "longrope":
        return inv / longrope_factors(head_dim, scaling, max_positions)
    if kind == "llama3":
        return llama3_frequencies(inv, scaling)
    return inv


def llama3_frequencies(inv: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth blend between."""
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


def yarn_frequencies(head_dim: int, theta: float, scaling: dict, max_positions: int | None) -> torch.Tensor:
    """YaRN ("NTK-by-parts"): dimensions that turn more than beta_fast times over the original context
    keep their frequency, those turning fewer than beta_slow times are divided by `factor`, and a
    linear ramp blends the dimensions between. The same float32 steps as transformers, in its order."""
    original = original_max_positions(scaling, max_positions)
    powers = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    kept, interpolated = 1.0 / powers, 1.0 / (yarn_factor(scaling, max_positions) * powers)
    low, high = _yarn_ramp_ends(head_dim, theta, original, scaling)
    if low == high:
        high += 0.001
    keep = 1 - torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    return interpolated * (1 - keep) + kept * keep


def _yarn_ramp_ends(head_dim: int, theta: float, original: int, scaling: dict) -> tuple[float, float]:
    """The (fractional, or with `truncate` whole) dimensions where the ramp starts and ends."""
    def turning(rotations: float) -> float:         # the dimension that turns `rotations` times
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = turning(scaling.get("beta_fast") or 32), turning(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, head_dim - 1)


def yarn_attention_factor(scaling: dict, max_positions: int | None) -> float:
    """The configured attention_factor, else 0.1 ln(factor) + 1 (DeepSeek's mscale / mscale_all_dim:
    the ratio of two such terms)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = yarn_factor(scaling, max_positions)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def _yarn_mscale(factor: float, mscale: float = 1) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def dynamic_ntk_frequencies(head_dim: int, theta: float, scaling: dict, max_positions: int,
                            seq_lens: torch.Tensor) -> torch.Tensor:
    """[len(seq_lens), head_dim / 2]: dynamic NTK's frequencies for a sequence of each length. Past
    max_position_embeddings the base grows to theta (factor len / max - (factor - 1)) ^ (d / (d - 2));
    float32 throughout, as transformers computes it from the tensor of positions in a forward."""
    factor = scaling_factor(scaling)
    seq_lens = seq_lens.to(torch.int64).clamp(min=max_positions)
    base = theta * (factor * seq_lens / max_positions - (factor - 1)) ** (head_dim / (head_dim - 2))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (base[:, None] ** exponents)


def rotary_angles(head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                  length: int) -> torch.Tensor:
    """[length, head_dim / 2] float32: each position times the frequencies it rotates with.

    Dynamic NTK in transformers recomputes the frequencies in every forward from the longest
    position in it, and keys already in the cache keep the rotation they were written with. A
    table row can depend on its position only (prefix caching, chunks, batching), so position p
    rotates with the frequencies of a sequence of p + 1 tokens: exactly what transformers does for
    every token it decodes, and for a whole prompt within max_position_embeddings. A prompt longer
    than that is where the two part: transformers rotates all of its keys with the frequencies of
    its full length, the table each key with its own. (vLLM instead rotates every position with
    those of max_position_embeddings x factor: it differs from transformers at every length.)"""
    positions = torch.arange(length, dtype=torch.int64).float()
    inv = inverse_frequencies(head_dim, theta, scaling, max_positions)
    if scaling_kind(scaling) != "dynamic" or length <= max_positions:
        return torch.outer(positions, inv)
    grown = dynamic_ntk_frequencies(head_dim, theta, scaling, max_positions,
                                    torch.arange(max_positions + 1, length + 1))
    return positions[:, None] * torch.cat([inv.expand(max_positions, -1), grown])


def longrope_factors(head_dim: int, scaling: dict, max_positions: int | None) -> torch.Tensor:
    """MiniCPM's LongRoPE divides each frequency by a per-dimension factor. Its published code
    builds one table for max_position_embeddings, so the choice is static: the long factors when
    that exceeds original_max_position_embeddings, else the short ones (MiniCPM4-0.5B: equal, short)."""
    original = original_max_positions(scaling)
    if max_positions is None:
        raise ValueError("longrope needs max_position_embeddings to pick its factors")
    key = "long_factor" if max_positions > original else "short_factor"
    factors = scaling.get(key)
    if not isinstance(factors, (list, tuple)) or len(factors) != head_dim // 2:
        raise ValueError(f"longrope {key} must be a list of head_dim / 2 = {head_dim // 2} numbers, "
                         f"got {factors!r:.80}")
    return torch.tensor([float(f) for f in factors], dtype=torch.float32)


def rotary_magnitude(scaling: dict | None, max_positions: int) -> float:
    """What cos and sin are multiplied by: LongRoPE's attention factor
    sqrt(1 + ln(max / original) / ln(original)) (1.0 when the context is not extended), YaRN's
    `yarn_attention_factor`; 1.0 for every other kind."""
    kind = scaling_kind(scaling)
    if kind == "yarn":
        return yarn_attention_factor(scaling, max_positions)
    if kind != "longrope":
        return 1.0
    original = original_max_positions(scaling)
    return math.sqrt(1 + math.log(max_positions / original) / math.log(original))


class RotaryEmbedding(nn.Module):
    """The cos/sin tables [positions, head_dim]; LayerOps.qk_norm_rotary applies them. `max_positions`:
    max_position_embeddings; the table covers `context_length` positions, or `length` where more
    (an EAGLE-3 head covers its target's context)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 length: int | None = None):
        super().__init__()
        check_scaling(scaling, max_positions)
        length = max(length or 0, context_length(max_positions, scaling))
        freqs = rotary_angles(head_dim, max_positions, theta, scaling, length)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        magnitude = rotary_magnitude(scaling, max_positions)
        if magnitude != 1.0:                 # skipped otherwise: other models' tables stay bit-identical
            cos, sin = cos * magnitude, sin * magnitude
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
