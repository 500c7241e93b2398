"""Per-token FP8 quantization of activations (FP8 weights' input to the scaled GEMM): one program
per row finds the row's absolute maximum, then writes the row as e4m3 with scale amax / 448,
in one launch instead of plain torch's five (abs, amax, divide, clamp, cast).

The numbers are `models/layers/quantization.quantize_rows`': float32 division by the scale,
saturation at +-448, round to nearest even.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton.models.layers.quantization import FP8, FP8_MAX, SCALE_EPS


@triton.jit
def _quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, n, stride_x, stride_o, fp8_max, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=start + cols < n, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, 0), eps) / fp8_max
    tl.store(scale_ptr + row, scale)
    for start in range(0, n, BLOCK):
        mask = start + cols < n
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -fp8_max), fp8_max)
        tl.store(out_ptr + row * stride_o + start + cols, q.to(out_ptr.dtype.element_ty), mask=mask)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D x [M, K] -> (e4m3 [M, K], float32 scales [M, 1]); capturable (no host sync)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, n = x.shape
    out = torch.empty((m, n), dtype=FP8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block = min(2048, triton.next_power_of_2(n))
        _quantize_rows_kernel[(m,)](x, out, scale, n, x.stride(0), out.stride(0), FP8_MAX, SCALE_EPS,
                                    BLOCK=block, num_warps=4 if block <= 1024 else 8)
    return out, scale
