"""RMSNorm with an optional fused residual add, through the platform's LayerOps."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    fp8_out = False     # feeds only an FP8 projection: returns its quantized input (decoder.fuse_fp8_inputs)

    def __init__(self, size: int, eps: float, ops, dtype=None):
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, reduce=None):
        """Without residual: norm(x). With it: (norm(x + residual), x + residual). With fp8_out
        the norm comes as quantization.Fp8Rows. With reduce (a TPInfo; residual set, fp8_out not): x is
        this rank's partial sum, all-reduced first (`TPInfo.reduce_add_rms_norm`: in the same kernel where it can)."""
        if reduce is not None:
            return reduce.reduce_add_rms_norm(x, residual, self.weight, self.eps, self.ops)
        if self.fp8_out:
            if residual is None:
                return self.ops.rms_norm_fp8(x, self.weight, self.eps)
            return self.ops.add_rms_norm_fp8(x, residual, self.weight, self.eps)
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
