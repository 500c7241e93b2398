"""Emulated W4A16 ops: int4 weights packed into int32 and the weight-quantized matmul (docs/npu.md, "W4A16").

npu_convert_weight_to_int4pack(weight, inner_k_tiles=0): int32 [k, n] (contiguous, ND, last dim a multiple
of 8, every value in int4's [-8, 7]) -> int32 [k, n/8], eight int4 values to a word. The documents say the
values are laid out interleaved without giving the order; only the matmul below reads the words, so this
emulation packs them in order (value j of eight in bits 4j..4j+3) and the matmul reads that order.
npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None, ..., antiquant_group_size=0):
y = x @ ANTIQUANT(weight), ANTIQUANT(weight) = (weight + antiquant_offset) * antiquant_scale; x float16 /
bfloat16 [M, K]; weight int8 [K, N] or int32-packed int4 [K, N/8]; scale and offset of x's dtype, per channel
((1, N) or (N,)) or per group ((ceil(K / group), N), group a multiple of 32 in [32, K - 1]); y in x's dtype.
Computed in float32 (the weight widened exactly, the products summed in float32), cast once.
"""
from __future__ import annotations

import torch

from baton.engine.platforms.npu_emulation.common import _require, _unsupported

INT4_PACK = 8
WEIGHT_QUANT_X_DTYPES = (torch.float16, torch.bfloat16)


def npu_convert_weight_to_int4pack(weight, inner_k_tiles=0):
    """Emulated int4 packing: int32 [k, n] of values in [-8, 7] -> int32 [k, n/8]."""
    op = "npu_convert_weight_to_int4pack"
    _require(weight.dtype == torch.int32, op, f"weight must be int32, got {weight.dtype}")
    _require(weight.dim() == 2, op, f"weight must be 2-D, got {weight.dim()} dims")
    _require(weight.is_contiguous(), op, "weight must be contiguous")
    _require(weight.shape[1] % INT4_PACK == 0, op, f"the last dim must be a multiple of 8, got {weight.shape[1]}")
    _require(bool(((weight >= -8) & (weight <= 7)).all()), op, "values must lie in int4's range [-8, 7]")
    nibbles = (weight & 0xF).long().reshape(weight.shape[0], -1, INT4_PACK)
    words = (nibbles << torch.arange(0, 32, 4)).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def _unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [k, n/8] (npu_convert_weight_to_int4pack's) -> the signed values, int32 [k, n]."""
    nibbles = (packed[..., None] >> torch.arange(0, 32, 4, dtype=torch.int32)) & 0xF
    return torch.where(nibbles >= 8, nibbles - 16, nibbles).reshape(packed.shape[0], -1)


def npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None,
                                 quant_offset=None, bias=None, antiquant_group_size=0, inner_precise=0):
    """Emulated WeightQuantBatchMatmul for 2-D x [M, K] -> [M, N] in x's dtype."""
    op = "npu_weight_quant_batchmatmul"
    _require(x.dtype in WEIGHT_QUANT_X_DTYPES, op, f"x dtype must be float16 or bfloat16, got {x.dtype}")
    _require(x.dim() == 2 and weight.dim() == 2, op, "x [M, K] and weight must be 2-D")
    if quant_scale is not None or quant_offset is not None:
        raise _unsupported(op, "quant_scale / quant_offset (int8 output)")
    if weight.dtype == torch.int32:
        w = _unpack_int4(weight)
    else:
        _require(weight.dtype == torch.int8, op, f"weight must be int8 or int32 (packed int4), got {weight.dtype}")
        w = weight.to(torch.int32)
    k, n = w.shape
    _require(x.shape[1] == k, op, f"x [M, K] and weight [K, N] disagree on K: {tuple(x.shape)}, {tuple(w.shape)}")
    _require(antiquant_scale.dtype == x.dtype, op, f"antiquant_scale dtype must be x's ({x.dtype}), got "
                                                   f"{antiquant_scale.dtype}")
    group = antiquant_group_size
    if group:
        _require(group % 32 == 0 and 32 <= group <= k - 1, op,
                 f"antiquant_group_size must be a multiple of 32 in [32, K-1={k - 1}], got {group}")
        shape = (-(-k // group), n)
    else:
        shape = (n,) if antiquant_scale.dim() == 1 else (1, n)
    _require(tuple(antiquant_scale.shape) == shape, op, f"antiquant_scale must be {shape}, got "
                                                        f"{tuple(antiquant_scale.shape)}")
    scale = antiquant_scale.float().reshape(-1, n)
    offset = torch.zeros_like(scale)
    if antiquant_offset is not None:
        _require(antiquant_offset.dtype == antiquant_scale.dtype and antiquant_offset.shape == antiquant_scale.shape,
                 op, "antiquant_offset must have antiquant_scale's dtype and shape")
        offset = antiquant_offset.float().reshape(-1, n)
    if group:
        scale, offset = (t.repeat_interleave(group, 0)[:k] for t in (scale, offset))
    y = x.float() @ ((w.float() + offset) * scale)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
