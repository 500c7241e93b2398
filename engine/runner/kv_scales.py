"""A float8 KV cache's scales: one for K and one for V per (layer, kv head).

The cache holds K / k_scale and V / v_scale in e4m3 (engine/platforms/base.to_cache_dtype) and
every attention path multiplies them back. e4m3 saturates at +-448 and loses precision below
2^-6, so a scale maps what a head's keys or values really span into its range: the checkpoint's
own `k_scale`/`v_scale` where it carries them (vLLM's and compressed-tensors' FP8 checkpoints,
one per layer), else calibrated at load by `calibrate`: one forward over a fixed token sequence,
each head's largest |K| and |V| recorded, the scale the power of two that puts it between 448/8
and 448/4. Powers of two keep the round trip exact outside e4m3's own rounding, and make the
scales a function of the weights alone: a prefill and a decode worker of the same model compute
the same ones, and the KV handshake compares their `checksum` (the bytes that cross the wire
mean nothing under other scales).
"""
from __future__ import annotations

import hashlib

import torch

from baton.models.attention_metadata import AttnMetadata
from baton.models.forward_context import ForwardContext
from baton.models.layers.quantization import FP8_MAX

CALIBRATION_TOKENS = 256      # one sequence of this many tokens (fewer where the model's context is shorter)
CALIBRATION_SEED = 0          # the token ids: uniform over the vocabulary from this seed (CPU generator)
HEADROOM = 4                  # the calibrated |K|, |V| land in (448/8, 448/4]: 4-8x room above them


def calibration_ids(vocab_size: int, max_positions: int) -> torch.Tensor:
    """The calibration sequence: the same on every machine (torch's CPU generator, a fixed seed)."""
    n = min(CALIBRATION_TOKENS, max_positions)
    return torch.randint(vocab_size, (n,), generator=torch.Generator().manual_seed(CALIBRATION_SEED))


def power_of_two_scales(amax: torch.Tensor) -> torch.Tensor:
    """The scale per entry of amax: the least power of two s with amax * HEADROOM / s <= 448 (1 for 0)."""
    amax = amax.double()
    scale = torch.exp2(torch.ceil(torch.log2(amax * HEADROOM / FP8_MAX)))
    return torch.where(amax > 0, scale, torch.ones_like(scale)).float()


class _Recording(ForwardContext):
    """A cache-free forward that records each layer's largest |K| and |V| per kv head."""

    __slots__ = ("amax",)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.amax[layer_idx, 0] = k.detach().abs().amax(dim=(0, 2)).float()
        self.amax[layer_idx, 1] = v.detach().abs().amax(dim=(0, 2)).float()
        return super().attend(layer_idx, q, k, v)


def cache_free_meta(n: int, device: torch.device) -> AttnMetadata:
    """One sequence of n tokens, attending to itself only, nothing written to a cache (slot -1):
    the forward calibrations run (here, and engine/runner/fp8_rounding.py)."""
    return AttnMetadata(is_decode=False, slot_mapping=torch.full((n,), -1, device=device),
                        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
                        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
                        block_tables=torch.zeros(1, 1, dtype=torch.int32, device=device),
                        max_query_len=n, max_seq_len=n, has_context=False, query_start_loc_cpu=[0, n],
                        seq_lens_cpu=[n])


@torch.inference_mode()
def calibrate(model: torch.nn.Module, attention, scale: float, vocab_size: int, max_positions: int,
              device: torch.device) -> torch.Tensor:
    """[layers, 2, kv_heads] float32 scales on `device` from one forward over `calibration_ids`
    (every tensor-parallel rank runs it: its own heads)."""
    ids = calibration_ids(vocab_size, max_positions)
    n = ids.numel()
    ctx = _Recording(cache_free_meta(n, device), None, attention, scale)
    ctx.amax = torch.zeros(model.num_layers, 2, model.num_kv_heads, device=device)
    model(ids.to(device), torch.arange(n, device=device), ctx)
    return power_of_two_scales(ctx.amax).to(device)


def from_checkpoint(found: dict[int, tuple[float, float]], num_layers: int, num_kv_heads: int,
                    device: torch.device) -> torch.Tensor | None:
    """A checkpoint's per-layer k_scale/v_scale (models/loader.py collects them) as [layers, 2,
    kv_heads]; None where it carries none. A checkpoint with some layers' and not others' is refused."""
    if not found:
        return None
    missing = [i for i in range(num_layers) if i not in found]
    if missing:
        raise ValueError(f"the checkpoint carries KV cache scales for {len(found)} of {num_layers} layers "
                         f"(none for layer {missing[0]}); serve it with --kv-cache-scales one")
    scales = torch.tensor([found[i] for i in range(num_layers)], dtype=torch.float32)
    if not bool(torch.isfinite(scales).all()) or bool((scales <= 0).any()):
        raise ValueError("the checkpoint's KV cache scales must be positive and finite")
    return scales[:, :, None].expand(num_layers, 2, num_kv_heads).contiguous().to(device)


def checksum(scales: torch.Tensor | None) -> str:
    """What the KV handshake compares: 16 hex digits of the scales' float32 bytes ("" without)."""
    if scales is None:
        return ""
    data = scales.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


__all__ = ["CALIBRATION_TOKENS", "HEADROOM", "calibrate", "calibration_ids", "checksum", "from_checkpoint",
           "power_of_two_scales"]
