"""INT4 weight-only projections (AWQ / GPTQ checkpoints, models/layers/int4.py): a Triton W4A16 GEMM for
decode-sized M, dequantize-then-cuBLAS above it.

The GEMM: x [M, K] (bf16 / fp16; the float32 reference too) times the packed weight (qweight int32 [K/8, N],
eight input rows a word; scales fp16 and zero points uint8 [K/g, N]). Each program owns a BLOCK_M x BLOCK_N
output tile and a slice of K: a K tile's words are loaded once per row group of eight (the same word for its
eight rows, from L1), the nibbles shifted out in registers, the zero point subtracted (q - z is a small
integer, exact in bf16), a tensor-core dot with fp32 sums, then times the group's scale in fp32: BLOCK_K
divides the group size, so a K tile has one scale per column and the scale multiplies the [BLOCK_M, BLOCK_N]
partial, not the weights. Split-K: SPLIT programs share an output tile, each writing an fp32 partial; the
partials are added in split order (deterministic), then cast. Decode's M (1-16) takes one 16-row tile (the
MMA's smallest), and split-K fills the SMs that N / BLOCK_N tiles alone leave idle.

Above MAX_GEMM_M rows (prefill) the step is compute-bound, and the tensor cores do better on a plain bf16 GEMM
than on tiles that widen the weights in registers: the weight is widened once per call by a Triton kernel
into a transient [K, N] buffer in x's dtype and cuBLAS multiplies (4.5 bits a weight read, 16 written and
read back: 2 x 16-bit traffic on a step that moves M x K activations through the SMs anyway).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_GEMM_M = 64             # rows the W4A16 GEMM takes; above: dequantize, then cuBLAS
BLOCK_KS = (128, 64, 32)    # the largest that divides the group size is taken (a K tile has one group)


@dataclass(frozen=True, slots=True)
class W4a16Config:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3


def pick_config(m: int, n: int, k: int, group: int, num_sms: int) -> W4a16Config:
    """The tile for this shape: the fewest rows that cover M, 64 columns, split-K up to ~2 programs an SM."""
    block_k = next(b for b in BLOCK_KS if group % b == 0)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_blocks, split = k // block_k, 1
    while split * 2 <= k_blocks and k_blocks % (split * 2) == 0 and tiles * split < 2 * num_sms:
        split *= 2
    return W4a16Config(block_m, block_n, block_k, split)


@triton.jit
def _w4a16_gemm(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, stride_xm, stride_qk, stride_sg, stride_zg,
                stride_os, stride_om, K_SPLIT: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    shifts = ((offs_k % 8) * 4)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * K_SPLIT
    for k0 in range(k_start, k_start + K_SPLIT, BLOCK_K):
        k = k0 + offs_k
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None], other=0.0)
        words = tl.load(qw_ptr + (k // 8)[:, None] * stride_qk + offs_n[None, :], mask=n_ok[None, :], other=0)
        q = (words >> shifts) & 0xF
        g = k0 // GROUP
        z = tl.load(z_ptr + g * stride_zg + offs_n, mask=n_ok, other=0).to(tl.int32)
        s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        b = (q - z[None, :]).to(x_ptr.dtype.element_ty)          # -15..15: exact in every float type
        if IEEE:
            part = tl.dot(a, b, input_precision="ieee")
        else:
            part = tl.dot(a, b)
        acc += part * s[None, :]
    out = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _w4a16_dequant(qw_ptr, s_ptr, z_ptr, w_ptr, N, stride_qk, stride_sg, stride_zg, stride_wk,
                   GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_k, pid_n = tl.program_id(0), tl.program_id(1)
    k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (n < N)[None, :]
    words = tl.load(qw_ptr + (k // 8)[:, None] * stride_qk + n[None, :], mask=ok, other=0)
    q = (words >> ((k % 8) * 4)[:, None]) & 0xF
    g = (k // GROUP)[:, None]
    z = tl.load(z_ptr + g * stride_zg + n[None, :], mask=ok, other=0).to(tl.int32)
    s = tl.load(s_ptr + g * stride_sg + n[None, :], mask=ok, other=0.0).to(tl.float32)
    w = (q - z).to(tl.float32) * s
    tl.store(w_ptr + k[:, None] * stride_wk + n[None, :], w.to(w_ptr.dtype.element_ty), mask=ok)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8                          # the interpreter (tests on the CPU)
    return torch.cuda.get_device_properties(device).multi_processor_count


def w4a16_gemm(x: torch.Tensor, w, config: W4a16Config | None = None) -> torch.Tensor:
    """x [M, K] times the INT4 weight `w` (models/layers/int4.py's Int4Weight, columns of x already in its
    row order) -> [M, N] in x's dtype, through the W4A16 GEMM at any M."""
    x = x.contiguous()
    m, k = x.shape
    n = w.out_features
    cfg = config or pick_config(m, n, k, w.group_size, _num_sms(x.device))
    if cfg.split_k == 1:
        out = torch.empty(1, m, n, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), cfg.split_k)
    _w4a16_gemm[grid](x, w.qweight, w.scales, w.zeros, out, m, n, x.stride(0), w.qweight.stride(0),
                      w.scales.stride(0), w.zeros.stride(0), out.stride(0), out.stride(1),
                      K_SPLIT=k // cfg.split_k, GROUP=w.group_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      BLOCK_K=cfg.block_k, IEEE=x.dtype == torch.float32, num_warps=cfg.num_warps,
                      num_stages=cfg.num_stages)
    return out[0] if cfg.split_k == 1 else out.sum(0).to(x.dtype)


def w4a16_dequantize(w, dtype: torch.dtype) -> torch.Tensor:
    """The INT4 weight widened to [K, N] in `dtype`: (q - zero) * scale in fp32, rounded once."""
    k, n = w.in_features, w.out_features
    out = torch.empty(k, n, dtype=dtype, device=w.qweight.device)
    block_k = next(b for b in BLOCK_KS if w.group_size % b == 0)
    grid = (k // block_k, triton.cdiv(n, 64))
    _w4a16_dequant[grid](w.qweight, w.scales, w.zeros, out, n, w.qweight.stride(0), w.scales.stride(0),
                         w.zeros.stride(0), out.stride(0), GROUP=w.group_size, BLOCK_K=block_k, BLOCK_N=64)
    return out


def supported(w) -> bool:
    """Whether the kernels take this layer: groups a multiple of 32 rows (a K tile holds one group)."""
    return w.group_size % BLOCK_KS[-1] == 0


def w4a16_matmul(x: torch.Tensor, w) -> torch.Tensor:
    """CudaPlatform.w4a16_matmul: the GEMM up to MAX_GEMM_M rows, dequantize + cuBLAS above; a group size
    the kernels do not tile (not a multiple of 32) takes the plain-torch reference."""
    if not supported(w):
        from baton.models.layers.int4 import dequantize
        return torch.nn.functional.linear(x, dequantize(w, x.dtype))
    if x.shape[0] <= MAX_GEMM_M:
        return w4a16_gemm(x, w)
    return x @ w4a16_dequantize(w, x.dtype)
