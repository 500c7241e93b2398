"""Emulated W8A8 ops: per-token dynamic int8 quantization and the int8 matmul with per-channel and
per-token scales (docs/npu.md, "W8A8").

DynamicQuant (torch_npu.npu_dynamic_quant, symmetric, no smooth scales): scale = row_max(|x|) / 127
in float32, y = round(x / scale) in int8, scale's shape is x's without the last dim.
QuantBatchMatmul (torch_npu.npu_quant_matmul): out = (x1 @ x2) accumulated exactly in int32, times
scale (per output column, or one) and pertoken_scale (per row of x1), plus bias, cast to output_dtype.
"""
from __future__ import annotations

import torch

from baton.engine.platforms.npu_emulation.common import _require, _unsupported

DYNAMIC_QUANT_DTYPES = (torch.float16, torch.bfloat16)
QUANT_MATMUL_OUT = (torch.float16, torch.bfloat16)        # int8 output (the default) is not emulated
QUANT_SCALE_DTYPES = (torch.float32, torch.bfloat16)      # int64 (npu_trans_quant_param's) is not emulated


def npu_dynamic_quant(x, *, smooth_scales=None, group_index=None, dst_type=None):
    """Emulated DynamicQuant -> (y int8 shaped as x, scale float32 shaped as x without its last dim)."""
    op = "npu_dynamic_quant"
    _require(x.dim() > 1, op, f"x must have more than 1 dim, got {x.dim()}")
    _require(x.dtype in DYNAMIC_QUANT_DTYPES, op, f"x dtype must be float16 or bfloat16, got {x.dtype}")
    if smooth_scales is not None or group_index is not None:
        raise _unsupported(op, "smooth_scales / group_index (smooth quant, MoE groups)")
    _require(dst_type in (None, torch.int8), op, f"dst_type {dst_type} is not emulated (int8 only)")
    x32 = x.float()
    scale = x32.abs().amax(dim=-1) / 127.0
    # an all-zero row: 0 / 0 in the formula; its y is 0 (the row's only value)
    y = torch.round(x32 / scale.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(-1)).clamp(-128, 127)
    return y.to(torch.int8), scale


def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None):
    """Emulated QuantBatchMatmul for 2-D int8 x1 [M, K] and x2 [K, N] (ND) -> [M, N] in output_dtype."""
    op = "npu_quant_matmul"
    _require(x1.dtype == torch.int8 and x2.dtype == torch.int8, op,
             f"x1 and x2 must be int8 (int32-packed int4 is not emulated), got {x1.dtype}, {x2.dtype}")
    if x1.dim() != 2 or x2.dim() != 2:
        raise _unsupported(op, "batched (3-6 dim) x1 / x2")
    _require(x1.shape[1] == x2.shape[0], op, f"x1 [M, K] and x2 [K, N] disagree on K: {tuple(x1.shape)}, "
                                             f"{tuple(x2.shape)}")
    m, n = x1.shape[0], x2.shape[1]
    _require(scale.dim() == 1 and scale.shape[0] in (1, n), op, f"scale must be 1-D of 1 or n={n}, got "
                                                                f"{tuple(scale.shape)}")
    _require(scale.dtype in QUANT_SCALE_DTYPES, op, f"scale dtype {scale.dtype} is not float32/bfloat16")
    if offset is not None:
        raise _unsupported(op, "offset (int8 output)")
    _require(output_dtype in QUANT_MATMUL_OUT, op, f"output_dtype {output_dtype} is not emulated "
                                                   "(float16 / bfloat16; None means int8 output)")
    if pertoken_scale is not None:
        _require(pertoken_scale.dtype == torch.float32 and pertoken_scale.dim() == 1
                 and pertoken_scale.shape[0] == m, op,
                 f"pertoken_scale must be float32 [m={m}], got {pertoken_scale.dtype} {tuple(pertoken_scale.shape)}")
    _require(not (output_dtype == torch.float16 and scale.dtype == torch.bfloat16), op,
             "a bfloat16 scale needs output_dtype bfloat16")
    acc = x1.double() @ x2.double()             # int8 products summed exactly (|sum| < 2**53)
    out = acc * scale.double()
    if pertoken_scale is not None:
        out = out * pertoken_scale.double()[:, None]
    if bias is not None:
        _require(bias.dim() == 1 and bias.shape[0] == n, op, f"bias must be 1-D [n={n}], got {tuple(bias.shape)}")
        out = out + bias.double()
    return out.to(output_dtype)
