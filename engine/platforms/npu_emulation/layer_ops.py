"""Emulated fused layer ops: RMSNorm, add-RMSNorm, rotary, SwiGLU."""
from __future__ import annotations

import torch

from baton.engine.platforms.npu_emulation.common import _require, _unsupported

# -- fused layer ops -------------------------------------------------------------------------------
_NORM_DTYPES = {(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                (torch.float16, torch.float32), (torch.bfloat16, torch.float32)}


def _rms(x32: torch.Tensor, gamma: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    dims = tuple(range(x32.dim() - gamma.dim(), x32.dim()))
    rstd = torch.rsqrt(x32.pow(2).mean(dim=dims, keepdim=True) + eps)
    return x32 * rstd * gamma.float(), rstd


def npu_rms_norm(self, gamma, epsilon=1e-06):
    """Emulated RmsNorm -> (y, rstd): y in self's dtype, rstd float32 with the normed dims kept as 1."""
    op = "npu_rms_norm"
    _require(2 <= self.dim() <= 8, op, f"self must have 2..8 dims, got {self.dim()}")
    _require(1 <= gamma.dim() < self.dim() + 1 and tuple(self.shape[self.dim() - gamma.dim():]) == tuple(gamma.shape),
             op, f"gamma's shape {tuple(gamma.shape)} must equal self's trailing dims {tuple(self.shape)}")
    _require((self.dtype, gamma.dtype) in _NORM_DTYPES, op,
             f"(self, gamma) dtypes ({self.dtype}, {gamma.dtype}) are not a documented pair")
    y, rstd = _rms(self.float(), gamma, epsilon)
    return y.to(self.dtype), rstd


def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-06):
    """Emulated AddRmsNorm -> (y, rstd, x1 + x2); the sum is normed before rounding (float32)."""
    op = "npu_add_rms_norm"
    _require(1 <= x1.dim() <= 8 and x1.shape == x2.shape, op,
             f"x1 and x2 must have the same shape (1..8 dims), got {tuple(x1.shape)} and {tuple(x2.shape)}")
    _require(x1.dtype in (torch.float16, torch.bfloat16, torch.float32), op, f"x1 dtype {x1.dtype} unsupported")
    _require(x2.dtype == x1.dtype and gamma.dtype == x1.dtype, op,
             f"x2 and gamma must have x1's dtype {x1.dtype} (single-op mode), got {x2.dtype}, {gamma.dtype}")
    _require(tuple(x1.shape[x1.dim() - gamma.dim():]) == tuple(gamma.shape), op,
             f"gamma's shape {tuple(gamma.shape)} must equal x1's trailing dims {tuple(x1.shape)}")
    s = x1.float() + x2.float()
    y, rstd = _rms(s, gamma, epsilon)
    return y.to(x1.dtype), rstd, s.to(x1.dtype)


_ROTARY_LAYOUTS = {            # 4-D layouts of npu_rotary_mul's input: (B, N) axes, allowed cos/sin shapes
    "BNSD": ((0, 1), ("11SD", "B1SD", "BNSD")),
    "BSND": ((0, 2), ("1S1D", "BS1D", "BSND")),
    "SBND": ((1, 2), ("S11D", "SB1D", "SBND")),
}


def _rotary_shape_ok(x_shape, r_shape) -> bool:
    if len(x_shape) == 3:                                  # TND: T1D or TND
        return r_shape in ((x_shape[0], 1, x_shape[2]), tuple(x_shape))
    for layout, ((bi, ni), patterns) in _ROTARY_LAYOUTS.items():
        if x_shape[bi] >= 1000 or x_shape[ni] >= 1000:
            continue
        for pattern in patterns:
            want = tuple(1 if c == "1" else x_shape[layout.index(c)] for c in pattern)
            if tuple(r_shape) == want:
                return True
    return False


def npu_rotary_mul(input, r1, r2, rotary_mode="half", rotate=None):
    """Emulated RotaryMul, half mode: input * r1 + rotate_half(input) * r2 (float32, cast back)."""
    op = "npu_rotary_mul"
    if rotary_mode != "half":
        raise _unsupported(op, f"rotary_mode {rotary_mode!r}")
    if rotate is not None:
        raise _unsupported(op, "rotate")
    _require(input.dim() in (3, 4) and r1.dim() == input.dim() and r1.shape == r2.shape, op,
             f"input must be 3-D or 4-D with r1/r2 of the same rank and equal shapes, got "
             f"{tuple(input.shape)}, {tuple(r1.shape)}, {tuple(r2.shape)}")
    d = input.shape[-1]
    _require(d % 2 == 0 and d < 896, op, f"D must be even and < 896, got {d}")
    for t in (input, r1, r2):
        _require(t.dtype in (torch.float16, torch.bfloat16, torch.float32), op, f"dtype {t.dtype} unsupported")
    _require(_rotary_shape_ok(tuple(input.shape), tuple(r1.shape)), op,
             f"cos/sin shape {tuple(r1.shape)} is not a documented broadcast of input {tuple(input.shape)} "
             "(BSND: 1S1D, BS1D, BSND; BNSD: 11SD, B1SD, BNSD; SBND: S11D, SB1D, SBND; TND: T1D, TND; B, N < 1000)")
    x = input.float()
    x1, x2 = x.chunk(2, dim=-1)
    return (x * r1.float() + torch.cat((-x2, x1), dim=-1) * r2.float()).to(input.dtype)


def npu_swiglu(input, dim=-1):
    """Emulated SwiGLU: silu(first half along dim) * second half (float32, cast back)."""
    op = "npu_swiglu"
    _require(1 <= input.dim() <= 8, op, f"input must have 1..8 dims, got {input.dim()}")
    _require(input.dtype in (torch.float16, torch.bfloat16, torch.float32), op, f"dtype {input.dtype} unsupported")
    _require(input.shape[dim] % 2 == 0, op, f"the split dim must have even size, got {input.shape[dim]}")
    a, b = input.float().chunk(2, dim=dim)
    return (torch.nn.functional.silu(a) * b).to(input.dtype)
