"""Fused RMSNorm, add-RMSNorm and SiLU-and-mul: one pass over the activations instead of the
half-dozen elementwise kernels plain torch launches. The `_fp8` forms write an FP8 projection's
input (e4m3 rows and per-row scales, the per-token quantizer's numbers) in the same pass.

Rounding follows `LayerOps` step for step (normalise in fp32, round to the input dtype, then
multiply by the weight and round again; the residual sum rounded before the norm; SiLU rounded
before the product), so results differ from plain torch only by reduction order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton.engine.platforms.triton_kernels import quant
from baton.models.layers.quantization import FP8, FP8_MAX, SCALE_EPS, Fp8Rows


@triton.jit
def _store_row(out_ptr, scale_ptr, row, cols, mask, y, fp8_max, scale_eps, FP8_OUT: tl.constexpr):
    """y (fp32, already rounded to the model dtype) as the output row; with FP8_OUT as e4m3 with
    the row's scale amax / 448, the numbers of triton_kernels/quant.py's quantizer."""
    if FP8_OUT:
        scale = tl.maximum(tl.max(tl.abs(y), 0), scale_eps) / fp8_max
        tl.store(scale_ptr + row, scale)
        y = tl.minimum(tl.maximum(y / scale, -fp8_max), fp8_max)
    tl.store(out_ptr + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, scale_ptr, n, eps, stride_x, stride_r, stride_o,
                     stride_s, fp8_max, scale_eps, HAS_RESIDUAL: tl.constexpr, FP8_OUT: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)   # rounded in the input dtype
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, 0) / n + eps)
    normed = (h * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = w * normed
    if FP8_OUT:          # quantized from the output as rms_norm writes it (the weight has x's dtype)
        y = y.to(x.dtype).to(tl.float32)
    _store_row(out_ptr + row * stride_o, scale_ptr, row, cols, mask, y, fp8_max, scale_eps, FP8_OUT)


@triton.jit
def _silu_mul(x_row, cols, mask, n):
    gate = tl.load(x_row + cols, mask=mask, other=0.0)
    up = tl.load(x_row + n + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    return (act * up.to(tl.float32)).to(gate.dtype).to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, scale_ptr, n, stride_x, stride_o, fp8_max, scale_eps,
                         FP8_OUT: tl.constexpr, BLOCK: tl.constexpr):
    """FP8_OUT: one program per row (the row's scale needs all of it), BLOCK >= n."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    y = _silu_mul(x_ptr + row * stride_x, cols, mask, n)
    _store_row(out_ptr + row * stride_o, scale_ptr, row, cols, mask, y, fp8_max, scale_eps, FP8_OUT)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _norm_warps(block: int) -> int:
    return min(16, max(1, block // 256))


def _fp8_outputs(rows: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 output rows [M, n] and their float32 scales [M, 1]."""
    return (torch.empty(rows.shape[0], n, dtype=FP8, device=rows.device),
            torch.empty(rows.shape[0], 1, dtype=torch.float32, device=rows.device))


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, fp8: bool):
    rows = _rows(x)
    res = _rows(residual) if residual is not None else rows
    n = rows.shape[1]
    if fp8:
        out, scale = _fp8_outputs(rows, n)
    else:
        out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
        scale = out
    total = torch.empty_like(rows) if residual is not None else out
    if rows.shape[0]:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, res, weight, out, total, scale, n, eps, rows.stride(0), res.stride(0) if residual is not None else 0,
            out.stride(0), total.stride(0) if residual is not None else 0, FP8_MAX, SCALE_EPS,
            HAS_RESIDUAL=residual is not None, FP8_OUT=fp8, BLOCK=block, num_warps=_norm_warps(block))
    normed = Fp8Rows(out, scale) if fp8 else out.view(*x.shape[:-1], n)
    return normed, (total.view(*x.shape[:-1], n) if residual is not None else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(x, None, weight, eps, False)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _norm(x, residual, weight, eps, False)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Fp8Rows:
    """rms_norm whose output is written as an FP8 projection's input: e4m3 rows and scales."""
    return _norm(x, None, weight, eps, True)[0]


def add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[Fp8Rows, torch.Tensor]:
    return _norm(x, residual, weight, eps, True)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    rows = _rows(x)
    n = rows.shape[1] // 2
    out = torch.empty(rows.shape[0], n, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = min(4096, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(n, block))](rows, out, out, n, rows.stride(0), out.stride(0),
                                                                     FP8_MAX, SCALE_EPS, FP8_OUT=False,
                                                                     BLOCK=block, num_warps=4)
    return out.view(*x.shape[:-1], n)


SILU_FP8_MAX_BLOCK = 16384      # one program holds a whole row (its scale needs all of it): 32 warps,
                                # 54 registers a thread at 16384 (ptxas, sm_90), no spills


def silu_and_mul_fp8(x: torch.Tensor) -> Fp8Rows:
    """silu_and_mul whose output is written as an FP8 projection's input; rows wider than
    SILU_FP8_MAX_BLOCK take the two-kernel path."""
    rows = _rows(x)
    n = rows.shape[1] // 2
    block = triton.next_power_of_2(n)
    if block > SILU_FP8_MAX_BLOCK:
        return Fp8Rows(*quant.quantize_fp8_rows(silu_and_mul(rows)))
    out, scale = _fp8_outputs(rows, n)
    if rows.shape[0]:
        _silu_and_mul_kernel[(rows.shape[0], 1)](rows, out, scale, n, rows.stride(0), out.stride(0), FP8_MAX, SCALE_EPS,
                                                 FP8_OUT=True, BLOCK=block, num_warps=max(4, min(32, block // 512)))
    return Fp8Rows(out, scale)


@triton.jit
def _norm_rotary_heads(src, dst, w_ptr, n_heads, stride_h, stride_oh, eps, c1, c2, s1, s2,
                       HAS_NORM: tl.constexpr, HEADS_P: tl.constexpr, HALF: tl.constexpr):
    """All heads of one token, [HEADS_P, HALF] per half: optional RMSNorm, then rotary."""
    h = tl.arange(0, HEADS_P)
    d = tl.arange(0, HALF)
    live = (h < n_heads)[:, None]
    at = h[:, None] * stride_h + d[None, :]
    x1 = tl.load(src + at, mask=live, other=0.0)
    x2 = tl.load(src + HALF + at, mask=live, other=0.0)
    dt = x1.dtype
    if HAS_NORM:        # as LayerOps.rms_norm: fp32 statistics, round, weight, round
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        rstd = tl.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / (2 * HALF) + eps)[:, None]
        x1 = (tl.load(w_ptr + d).to(tl.float32)[None, :] * (a * rstd).to(dt).to(tl.float32)).to(dt)
        x2 = (tl.load(w_ptr + HALF + d).to(tl.float32)[None, :] * (b * rstd).to(dt).to(tl.float32)).to(dt)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    # as LayerOps.rotary: x * cos + rotate_half(x) * sin, each product rounded to the dtype
    o1 = (a * c1).to(dt).to(tl.float32) + (-b * s1).to(dt).to(tl.float32)
    o2 = (b * c2).to(dt).to(tl.float32) + (a * s2).to(dt).to(tl.float32)
    out = h[:, None] * stride_oh + d[None, :]
    tl.store(dst + out, o1.to(dt), mask=live)
    tl.store(dst + HALF + out, o2.to(dt), mask=live)


@triton.jit
def _qk_norm_rotary_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, q_out_ptr, k_out_ptr,
                           num_q_heads, num_k_heads, eps, stride_qt, stride_qh, stride_kt, stride_kh, stride_cos,
                           stride_oqt, stride_oqh, stride_okt, stride_okh,
                           HAS_NORM: tl.constexpr, QH_P: tl.constexpr, KH_P: tl.constexpr, HALF: tl.constexpr):
    """One token: its q heads and k heads normed and rotated, cos/sin read once."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + t)
    dt = q_out_ptr.dtype.element_ty
    c1 = tl.load(cos_ptr + pos * stride_cos + d).to(dt).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + pos * stride_cos + HALF + d).to(dt).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + pos * stride_cos + d).to(dt).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + pos * stride_cos + HALF + d).to(dt).to(tl.float32)[None, :]
    _norm_rotary_heads(q_ptr + t * stride_qt, q_out_ptr + t * stride_oqt, qw_ptr, num_q_heads, stride_qh,
                       stride_oqh, eps, c1, c2, s1, s2, HAS_NORM, QH_P, HALF)
    _norm_rotary_heads(k_ptr + t * stride_kt, k_out_ptr + t * stride_okt, kw_ptr, num_k_heads, stride_kh,
                       stride_okh, eps, c1, c2, s1, s2, HAS_NORM, KH_P, HALF)


def qk_norm_rotary(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                   eps: float, cos: torch.Tensor, sin: torch.Tensor,
                   positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D] (views into the fused qkv output are fine) -> new contiguous
    q, k; cos/sin [max_positions, D] fp32 tables read at `positions` [T] on the device."""
    t, hq, dim = q.shape
    hk = k.shape[1]
    q_out = torch.empty(t, hq, dim, dtype=q.dtype, device=q.device)
    k_out = torch.empty(t, hk, dim, dtype=k.dtype, device=k.device)
    if t:
        has_norm = q_weight is not None
        qh_p = triton.next_power_of_2(hq)
        _qk_norm_rotary_kernel[(t,)](
            q, k, q_weight if has_norm else q, k_weight if has_norm else k, cos, sin, positions, q_out, k_out,
            hq, hk, eps, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            HAS_NORM=has_norm, QH_P=qh_p, KH_P=triton.next_power_of_2(hk), HALF=dim // 2,
            num_warps=4 if qh_p * dim >= 2048 else 2)
    return q_out, k_out
