"""The W4A16 GEMV for a few rows at once (decode batches 2-8; w4a16.py's layout, its unpack, `plane`, lives here).

Each program owns BLOCK_N columns, a K slice and ROWS (<= 8) rows of x: a block's words are loaded and unpacked
once (one LOP3 and one FFMA a weight, as the one-row GEMV), then used by every row (one FFMA a weight and row),
so the unpack's cost is shared ROWS ways. Each row keeps its own [16, BLOCK_N] sums (t0..t7: one tensor a row, in
the one-row GEMV's layout; a [ROWS, 16, BLOCK_N] tensor makes Triton spread the 16 rows over warps and reduce
across them every plane), added over their 16 rows and times the scale once a group.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def plane(words, high, z, j: tl.constexpr, nib):
    """Plane j of a block's words, q - zero in float32 (exact): the nibble masked in place (no shift) and ORed
    into 0x4B000000 reads as 2^23 + q * 16^jj; times 16^-jj (a power of two: exact) minus 2^23 * 16^-jj + zero
    is q - zero, one LOP3 and one FFMA a weight. Planes 4..7 come from `high` (words >> 16, once per word). `nib`
    is 0xF passed at run time: as an immediate, ptxas re-materializes the mask before every LOP3 (a MOV each)."""
    jj: tl.constexpr = j % 4
    inv: tl.constexpr = 1.0 / (1 << (4 * jj))
    src = words if j < 4 else high
    f = ((src & (nib << (4 * jj))) | 0x4B000000).to(tl.float32, bitcast=True)
    return f * inv - (z + 8388608.0 * inv)[None, :]


@triton.jit
def _fma(t, x_ptr, r, M, stride_xm, k, offs_i, w):
    """t + x[r, k:k+16] (as a column) * w; row r past M reads zeros."""
    x = tl.load(x_ptr + r * stride_xm + k + offs_i, mask=offs_i * 0 + r < M, other=0.0).to(tl.float32)
    return t + x[:, None] * w


@triton.jit
def _fold(acc, t, s):
    return acc + tl.sum(t, axis=0) * s


@triton.jit
def _store(out_ptr, acc, r, M, stride_om, offs_n, n_ok):
    tl.store(out_ptr + r * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok & (offs_n * 0 + r < M))


@triton.jit(do_not_specialize=["M", "K_SPLIT", "NIB"])
def gemv_rows(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, K_SPLIT, stride_xm, stride_qk, stride_sg, stride_zg,
              stride_os, stride_om, NIB, GROUP: tl.constexpr, PPG: tl.constexpr, ROWS: tl.constexpr,
              BLOCK_N: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r0 = pid_m * ROWS
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_i = tl.arange(0, 16)
    n_ok = offs_n < N
    zero = tl.zeros((BLOCK_N,), dtype=tl.float32)
    a0, a1, a2, a3, a4, a5, a6, a7 = zero, zero, zero, zero, zero, zero, zero, zero
    k_start = pid_k * K_SPLIT
    for k0 in range(k_start, k_start + K_SPLIT, 128):
        words = tl.load(qw_ptr + (k0 // 8 + offs_i)[:, None] * stride_qk + offs_n[None, :], mask=n_ok[None, :], other=0)
        high = words >> 16
        g = k0 // GROUP
        z = tl.load(z_ptr + g * stride_zg + offs_n, mask=n_ok, other=0).to(tl.float32)
        s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        t0 = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        t1, t2, t3, t4, t5, t6, t7 = t0, t0, t0, t0, t0, t0, t0
        for j in tl.static_range(8):
            if j % PPG == 0 and j > 0:            # a new group: fold the sums, reload zero and scale
                a0, a1, a2, a3 = _fold(a0, t0, s), _fold(a1, t1, s), _fold(a2, t2, s), _fold(a3, t3, s)
                if ROWS > 4:
                    a4, a5, a6, a7 = _fold(a4, t4, s), _fold(a5, t5, s), _fold(a6, t6, s), _fold(a7, t7, s)
                g = (k0 + 16 * j) // GROUP
                z = tl.load(z_ptr + g * stride_zg + offs_n, mask=n_ok, other=0).to(tl.float32)
                s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
                t0 = tl.zeros((16, BLOCK_N), dtype=tl.float32)
                t1, t2, t3, t4, t5, t6, t7 = t0, t0, t0, t0, t0, t0, t0
            w = plane(words, high, z, j, NIB)
            k = k0 + 16 * j
            t0 = _fma(t0, x_ptr, r0, M, stride_xm, k, offs_i, w)
            t1 = _fma(t1, x_ptr, r0 + 1, M, stride_xm, k, offs_i, w)
            if ROWS > 2:
                t2 = _fma(t2, x_ptr, r0 + 2, M, stride_xm, k, offs_i, w)
                t3 = _fma(t3, x_ptr, r0 + 3, M, stride_xm, k, offs_i, w)
            if ROWS > 4:
                t4 = _fma(t4, x_ptr, r0 + 4, M, stride_xm, k, offs_i, w)
                t5 = _fma(t5, x_ptr, r0 + 5, M, stride_xm, k, offs_i, w)
                t6 = _fma(t6, x_ptr, r0 + 6, M, stride_xm, k, offs_i, w)
                t7 = _fma(t7, x_ptr, r0 + 7, M, stride_xm, k, offs_i, w)
        a0, a1, a2, a3 = _fold(a0, t0, s), _fold(a1, t1, s), _fold(a2, t2, s), _fold(a3, t3, s)
        if ROWS > 4:
            a4, a5, a6, a7 = _fold(a4, t4, s), _fold(a5, t5, s), _fold(a6, t6, s), _fold(a7, t7, s)
    out_ptr += pid_k * stride_os
    _store(out_ptr, a0, r0, M, stride_om, offs_n, n_ok)
    _store(out_ptr, a1, r0 + 1, M, stride_om, offs_n, n_ok)
    if ROWS > 2:
        _store(out_ptr, a2, r0 + 2, M, stride_om, offs_n, n_ok)
        _store(out_ptr, a3, r0 + 3, M, stride_om, offs_n, n_ok)
    if ROWS > 4:
        _store(out_ptr, a4, r0 + 4, M, stride_om, offs_n, n_ok)
        _store(out_ptr, a5, r0 + 5, M, stride_om, offs_n, n_ok)
        _store(out_ptr, a6, r0 + 6, M, stride_om, offs_n, n_ok)
        _store(out_ptr, a7, r0 + 7, M, stride_om, offs_n, n_ok)
