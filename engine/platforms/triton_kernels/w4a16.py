"""INT4 weight-only projections (AWQ / GPTQ checkpoints, models/layers/int4.py) on CUDA: a GEMV for one row,
a tensor-core GEMM for decode-sized M, dequantize-then-cuBLAS above it.

The bytes (qwen3-8b, group 128): a projection's packed weight is 0.5 byte a weight plus 3 bytes a group and
column (4.19 bits against bf16's 16). At decode sizes every kernel here reads each word once, so its floor is
the packed bytes at ~4.8 TB/s: qkv 6144x4096 13.2 MB (2.7 us), o 4096x4096 8.8 MB (1.8 us), gate_up
24576x4096 52.8 MB (11 us), down 4096x12288 26.4 MB (5.5 us); bf16 reads 3.8x those bytes.

The layout (`relayout`, applied at load by CudaPlatform.w4a16_layout): qweight int32 [K/8, N] as
models/layers/int4.py has it, but within each block of 128 input rows, word 16b + i holds in nibble j the row
128b + 16j + i (the canonical layout holds row 8(16b + i) + j). So a block's 16 x BLOCK_N words, loaded once
(coalesced along N: four words a thread, 128-bit loads), give in "plane" j = (words >> 4j) & 0xF the 16
consecutive rows 16j..16j+15: the activations a plane multiplies are a contiguous slice of x, and a plane lies
in one group (groups are multiples of 16 rows), so its zero point and scale are one [BLOCK_N] vector.

The unpack (`_plane`): a nibble q ORed into the float32 bits 0x4B000000 reads as 2^23 + q, without an
integer-to-float conversion (a quarter-rate instruction); masked in place (no shift) plane j reads 2^23 + q * 16^j
(j < 4; planes 4..7 from the words shifted by 16 once), and one FFMA by 16^-j (a power of two: exact) minus
2^23 * 16^-j + zero gives q - zero exactly. q - zero (-15..15) is exact in every float type; the group's scale
multiplies the fp32 sums, not the weights, so the only rounding is the accumulation's (and the output's cast).

  _w4a16_gemv (M = 1, and small M one row a program): CUDA cores. A program owns BLOCK_N columns of one row
    and a K slice; per plane: t[16, BLOCK_N] += x[16] * (q - zero); per group: acc += sum(t) * scale.
    ~4.3 instructions a weight (ptxas, sm_90), so at M = 1 the SMs' issue rate (~33 T lanes/s) is about the
    bytes' floor.
  w4a16_rows.gemv_rows (M = 2..16, where TABLE says so): the GEMV for 2, 4 or 8 rows a program, each word
    unpacked once for all of them (w4a16_rows.py).
  _w4a16_dot (M = 2..64): per plane a [BLOCK_M, 16] x [16, BLOCK_N] tensor-core dot of x's slice with the
    plane's (q - zero) in x's dtype, fp32 sums, times the group's scale per group. Kernel "dotshift" unpacks by
    shift and mask instead: more instructions, but Triton then converts the packed words (not the bf16 planes)
    to the MMA operand layout; which wins is the sweep's to say.
Split-K: SPLIT programs share an output tile, each writes an fp32 partial; the last of them to finish (an atomic
ticket a tile, `_finish`) adds them in split order (deterministic) and casts, so a projection is one kernel.
`_w4a16_reduce`, a second kernel, does it where there are no tickets (gemvm; a capture before any eager call).
The tile, the kernel and the split per shape come from TABLE (measured on an H200 by
`benchmarks/int4_decode.py --sweep`), `pick_config`'s rule otherwise.

Above MAX_GEMM_M rows (prefill) the step is compute-bound: the weight is widened once per call into a transient
[K, N] buffer in x's dtype (_w4a16_dequant) and cuBLAS multiplies.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from baton.engine.platforms.triton_kernels import w4a16_rows
from baton.engine.platforms.triton_kernels.w4a16_rows import plane as _plane

MAX_GEMM_M = 64             # rows the W4A16 kernels take; above: dequantize, then cuBLAS
BLOCK_ROWS = 128            # input rows a block of the layout interleaves (16 words of 8 nibbles a column)
PLANE = 16                  # rows a plane holds; groups must be a multiple of it
GEMV_MAX_M = 1              # rows the rule gives the GEMV (TABLE may say otherwise per shape)
FOLD_SPLIT_K = True         # split-K's reduce in the GEMV and dot kernels' last program (False: a second kernel)
TICKETS = 1 << 16           # split-K tiles a folded call may have (more: the second kernel)


@dataclass(frozen=True, slots=True)
class W4a16Config:
    kernel: str             # gemv | gemvm (the GEMV for block_m = 2, 4 or 8 rows a program: w4a16_rows.py) | dot |
                            # dotshift (the dot, planes by shift and mask) | cublas (dequantize, then cuBLAS: TABLE
                            # may pick it up to MAX_GEMM_M)
    block_n: int
    split_k: int = 1
    block_m: int = 16       # dot and gemvm (the one-row GEMV takes one row a program)
    num_warps: int = 4
    num_stages: int = 3


def _m_bucket(m: int) -> int:
    return 1 if m <= 1 else 1 << (m - 1).bit_length()


# (N, K, M bucket) -> the config measured best on an H200 (benchmarks/int4_decode.py --sweep: each config's calls
# replayed in a CUDA graph, split-K reduced in the kernel); qwen3-8b's shapes
TABLE: dict[tuple[int, int, int], W4a16Config] = {
    (6144, 4096, 1): W4a16Config('gemv', 256, 16, 16, 4, 3),
    (4096, 4096, 1): W4a16Config('gemv', 256, 16, 16, 4, 3),
    (24576, 4096, 1): W4a16Config('gemv', 256, 4, 16, 4, 3),
    (4096, 12288, 1): W4a16Config('gemv', 256, 32, 16, 4, 3),
    (6144, 4096, 16): W4a16Config('dotshift', 128, 8, 16, 8, 3),
    (4096, 4096, 16): W4a16Config('dotshift', 128, 16, 16, 8, 3),
    (24576, 4096, 16): W4a16Config('dotshift', 128, 2, 16, 8, 3),
    (4096, 12288, 16): W4a16Config('dotshift', 128, 16, 16, 8, 3),
    (6144, 4096, 4): W4a16Config('dotshift', 128, 8, 16, 8, 3),
    (4096, 4096, 4): W4a16Config('dotshift', 128, 16, 16, 8, 3),
    (24576, 4096, 4): W4a16Config('dotshift', 128, 8, 16, 8, 3),
    (4096, 12288, 4): W4a16Config('dotshift', 128, 16, 16, 8, 3),
    (6144, 4096, 8): W4a16Config('dotshift', 128, 8, 16, 8, 3),
    (4096, 4096, 8): W4a16Config('dotshift', 128, 16, 16, 8, 3),
    (24576, 4096, 8): W4a16Config('dotshift', 128, 8, 16, 8, 3),
    (4096, 12288, 8): W4a16Config('dotshift', 128, 16, 16, 8, 3),
    (6144, 4096, 2): W4a16Config('gemv', 256, 8, 16, 4, 3),
    (4096, 4096, 2): W4a16Config('gemv', 256, 16, 16, 4, 3),
    (24576, 4096, 2): W4a16Config('gemv', 256, 8, 16, 4, 3),
    (4096, 12288, 2): W4a16Config('gemv', 256, 16, 16, 4, 3),
    (6144, 4096, 64): W4a16Config('cublas', 0, 1, 16, 4, 3),
    (4096, 4096, 64): W4a16Config('cublas', 0, 1, 16, 4, 3),
    (24576, 4096, 64): W4a16Config('dotshift', 128, 4, 64, 4, 3),
    (4096, 12288, 64): W4a16Config('dot', 128, 8, 64, 4, 3),
    (6144, 4096, 32): W4a16Config('dot', 128, 4, 32, 8, 3),
    (4096, 4096, 32): W4a16Config('cublas', 0, 1, 16, 4, 3),
    (24576, 4096, 32): W4a16Config('dot', 128, 4, 32, 8, 3),
    (4096, 12288, 32): W4a16Config('cublas', 0, 1, 16, 4, 3),
}


def _split(k: int, programs: int, target: int) -> int:
    """The split of K (a power of two whose slices are whole blocks) that brings the programs near `target`."""
    split = 1
    while k % (split * 2 * BLOCK_ROWS) == 0 and programs * split * 2 <= target and k // (split * 2) >= 2 * BLOCK_ROWS:
        split *= 2
    return split


def pick_config(m: int, n: int, k: int, num_sms: int) -> W4a16Config:
    """TABLE's config for this shape, or the rule: the GEMV for one row (256 columns a program, 4 warps), the
    dot above (16 rows x 128 columns, 4 warps; 64 x 128, 8 warps past 16 rows); split-K up to ~4 programs an SM.
    (The rule's tiles are those with the fewest instructions a weight in ptxas's code for sm_90, no spills:
    GEMV ~4.3, dot ~5.5 at 16 rows, ~9 at 64; not yet timed on a GPU.)"""
    cfg = TABLE.get((n, k, _m_bucket(m)))
    if cfg is not None and k % (cfg.split_k * BLOCK_ROWS) == 0:
        return cfg
    if m <= GEMV_MAX_M:
        return W4a16Config("gemv", 256, _split(k, m * triton.cdiv(n, 256), 4 * num_sms), num_warps=4)
    block_m, warps = (16, 4) if m <= 16 else (64, 8)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, 128)
    return W4a16Config("dot", 128, _split(k, tiles, 4 * num_sms), block_m, warps)


@triton.jit
def _finish(acc, part_ptr, y_ptr, t_ptr, offs, mask, stride_os, FOLD: tl.constexpr):
    """A program's sums stored: without FOLD to its slice of part_ptr (the output itself when there is no
    split-K; else fp32 partials for _w4a16_reduce). With FOLD, the split-K reduce without a second kernel: each
    program stores its partial and takes a ticket (t_ptr[tile], an atomic count); the tile's last one adds the
    partials in split order, as _w4a16_reduce does (the same sums: deterministic), stores y_ptr and resets the
    ticket for the next call."""
    pid_k = tl.program_id(2)
    if FOLD:
        tl.store(part_ptr + pid_k * stride_os + offs, acc, mask=mask)
        tl.debug_barrier()                        # every thread's partial written before the ticket is taken
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        splits = tl.num_programs(2)
        if tl.atomic_add(t_ptr + tile, 1, sem="acq_rel", scope="gpu") == splits - 1:
            total = tl.load(part_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
            for k in range(1, splits):
                total += tl.load(part_ptr + k * stride_os + offs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + offs, total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(t_ptr + tile, 0, sem="relaxed", scope="gpu")
    else:
        tl.store(part_ptr + pid_k * stride_os + offs, acc.to(part_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["K_SPLIT", "NIB"])
def _w4a16_gemv(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, N, K_SPLIT, stride_xm, stride_qk, stride_sg, stride_zg,
                stride_os, stride_om, NIB, y_ptr, t_ptr, GROUP: tl.constexpr, PPG: tl.constexpr,
                BLOCK_N: tl.constexpr, FOLD: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_i = tl.arange(0, 16)
    n_ok = offs_n < N
    x_row = x_ptr + pid_m * stride_xm + offs_i
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    k_start = pid_k * K_SPLIT
    for k0 in range(k_start, k_start + K_SPLIT, 128):
        words = tl.load(qw_ptr + (k0 // 8 + offs_i)[:, None] * stride_qk + offs_n[None, :], mask=n_ok[None, :], other=0)
        high = words >> 16                        # planes 4..7 in bits 0..15 (the bits above are never read)
        g = k0 // GROUP
        z = tl.load(z_ptr + g * stride_zg + offs_n, mask=n_ok, other=0).to(tl.float32)
        s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        t = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        for j in tl.static_range(8):
            if j % PPG == 0 and j > 0:            # (groups of 16..64 rows: a new group every PPG planes)
                acc += tl.sum(t, axis=0) * s
                g = (k0 + 16 * j) // GROUP
                z = tl.load(z_ptr + g * stride_zg + offs_n, mask=n_ok, other=0).to(tl.float32)
                s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
                t = tl.zeros((16, BLOCK_N), dtype=tl.float32)
            xj = tl.load(x_row + k0 + 16 * j).to(tl.float32)
            t += xj[:, None] * _plane(words, high, z, j, NIB)
        acc += tl.sum(t, axis=0) * s
    _finish(acc, out_ptr, y_ptr, t_ptr, pid_m * stride_om + offs_n, n_ok, stride_os, FOLD)


@triton.jit(do_not_specialize=["M", "K_SPLIT", "NIB"])
def _w4a16_dot(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, K_SPLIT, stride_xm, stride_qk, stride_sg, stride_zg,
               stride_os, stride_om, NIB, y_ptr, t_ptr, GROUP: tl.constexpr, PPG: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, SHIFT: tl.constexpr,
               FOLD: tl.constexpr):
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_i = tl.arange(0, 16)
    m_ok, n_ok = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m[:, None] * stride_xm + offs_i[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * K_SPLIT
    for k0 in range(k_start, k_start + K_SPLIT, 128):
        words = tl.load(qw_ptr + (k0 // 8 + offs_i)[:, None] * stride_qk + offs_n[None, :], mask=n_ok[None, :], other=0)
        high = words >> 16                        # planes 4..7 in bits 0..15 (the bits above are never read)
        g = k0 // GROUP
        z = tl.load(z_ptr + g * stride_zg + offs_n, mask=n_ok, other=0).to(tl.float32)
        s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for j in tl.static_range(8):
            if j % PPG == 0 and j > 0:
                acc += part * s[None, :]
                g = (k0 + 16 * j) // GROUP
                z = tl.load(z_ptr + g * stride_zg + offs_n, mask=n_ok, other=0).to(tl.float32)
                s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
                part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            a = tl.load(x_rows + k0 + 16 * j, mask=m_ok[:, None], other=0.0)
            if SHIFT:            # shift-and-mask: Triton 3.9 then unpacks in the MMA operand layout (no round trip)
                f = (((words >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
                b = (f - (z + 8388608.0)[None, :]).to(x_ptr.dtype.element_ty)
            else:                # in place: fewer instructions, the bf16 plane through shared memory
                b = _plane(words, high, z, j, NIB).to(x_ptr.dtype.element_ty)      # q - zero: exact
            if IEEE:
                part = tl.dot(a, b, part, input_precision="ieee")
            else:
                part = tl.dot(a, b, part)
        acc += part * s[None, :]
    _finish(acc, out_ptr, y_ptr, t_ptr, offs_m[:, None] * stride_om + offs_n[None, :], m_ok[:, None] & n_ok[None, :],
            stride_os, FOLD)


@triton.jit
def _w4a16_reduce(p_ptr, out_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.load(p_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(p_ptr + s * MN + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _w4a16_dequant(qw_ptr, s_ptr, z_ptr, w_ptr, N, stride_qk, stride_sg, stride_zg, stride_wk,
                   GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_b, pid_n = tl.program_id(0), tl.program_id(1)
    offs_i = tl.arange(0, 16)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = n < N
    words = tl.load(qw_ptr + (pid_b * 16 + offs_i)[:, None] * stride_qk + n[None, :], mask=ok[None, :], other=0)
    for j in tl.static_range(8):
        k0 = pid_b * 128 + 16 * j
        g = k0 // GROUP
        z = tl.load(z_ptr + g * stride_zg + n, mask=ok, other=0).to(tl.float32)
        s = tl.load(s_ptr + g * stride_sg + n, mask=ok, other=0.0).to(tl.float32)
        q = ((words >> (4 * j)) & 0xF).to(tl.float32)
        w = (q - z[None, :]) * s[None, :]
        tl.store(w_ptr + (k0 + offs_i)[:, None] * stride_wk + n[None, :], w.to(w_ptr.dtype.element_ty),
                 mask=ok[None, :])


_TICKETS: dict[torch.device, torch.Tensor] = {}


def _tickets(device: torch.device) -> torch.Tensor | None:
    """The device's split-K tickets (_finish): TICKETS int32 counters, zero between calls (each tile's last
    program resets its own), made on the first call outside a CUDA graph capture (the warm-up before capturing
    runs the same shapes); None while capturing before that, when the separate reduce runs instead. One buffer a
    device: the engine's projections run one after another on one stream, never two at once."""
    t = _TICKETS.get(device)
    if t is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        t = _TICKETS[device] = torch.zeros(TICKETS, dtype=torch.int32, device=device)
    return t


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8                          # the interpreter (tests on the CPU)
    return torch.cuda.get_device_properties(device).multi_processor_count


def supported(w) -> bool:
    """Whether the kernels take this layer: K in whole blocks of 128 rows, groups a multiple of 16 rows."""
    return w.in_features % BLOCK_ROWS == 0 and w.group_size % PLANE == 0


def relayout(w):
    """The weight (models/layers/int4.py's layout) in the kernels' (the module's docstring): within a block of
    128 rows, word 16b + i nibble j holds row 128b + 16j + i."""
    from baton.models.layers import int4
    q = int4.unpack_rows(w.qweight)
    k, n = q.shape
    q = q.reshape(k // BLOCK_ROWS, 8, 16, n).transpose(1, 2).reshape(k, n)
    return w._replace(qweight=int4.pack_rows(q).contiguous())


def w4a16_gemm(x: torch.Tensor, w, config: W4a16Config | None = None) -> torch.Tensor:
    """x [M, K] times the INT4 weight `w` in the kernels' layout (`relayout`; columns of x already in its row
    order) -> [M, N] in x's dtype, through the GEMV or the dot kernel at any M."""
    x = x.contiguous()
    m, k = x.shape
    n = w.out_features
    cfg = config or pick_config(m, n, k, _num_sms(x.device))
    if cfg.kernel == "cublas":
        cfg = W4a16Config("dot", 64, 1, 16 if m <= 16 else 64)
    split = cfg.split_k
    assert k % (split * BLOCK_ROWS) == 0, (k, cfg)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    stride_os = 0 if split == 1 else part.stride(0)
    ppg = min(8, w.group_size // PLANE)
    args = (x, w.qweight, w.scales, w.zeros, part)
    strides = (x.stride(0), w.qweight.stride(0), w.scales.stride(0), w.zeros.stride(0), stride_os, n, 0xF)
    rows = m if cfg.kernel == "gemv" else triton.cdiv(m, cfg.block_m)
    tiles = rows * triton.cdiv(n, cfg.block_n)
    fits = split > 1 and cfg.kernel != "gemvm" and FOLD_SPLIT_K and tiles <= TICKETS
    tickets = _tickets(x.device) if fits else None
    fold = tickets is not None
    folded = (out, tickets if fold else out)          # y_ptr, t_ptr (unused without FOLD)
    if cfg.kernel == "gemvm":
        assert cfg.block_m in (2, 4, 8), cfg
        grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split)
        w4a16_rows.gemv_rows[grid](*args, m, n, k // split, *strides, GROUP=w.group_size, PPG=ppg, ROWS=cfg.block_m,
                               BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    elif cfg.kernel == "gemv":
        grid = (m, triton.cdiv(n, cfg.block_n), split)
        _w4a16_gemv[grid](*args, n, k // split, *strides, *folded, GROUP=w.group_size, PPG=ppg, BLOCK_N=cfg.block_n,
                          FOLD=fold, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    else:
        grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), split)
        _w4a16_dot[grid](*args, m, n, k // split, *strides, *folded, GROUP=w.group_size, PPG=ppg,
                         BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, IEEE=x.dtype == torch.float32,
                         SHIFT=cfg.kernel == "dotshift", FOLD=fold, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split > 1 and not fold:
        block = 1024
        _w4a16_reduce[(triton.cdiv(m * n, block),)](part, out, m * n, SPLIT=split, BLOCK=block, num_warps=4)
    return out


def w4a16_dequantize(w, dtype: torch.dtype) -> torch.Tensor:
    """The INT4 weight (kernels' layout) widened to [K, N] in `dtype`: (q - zero) * scale in fp32, rounded once."""
    k, n = w.in_features, w.out_features
    out = torch.empty(k, n, dtype=dtype, device=w.qweight.device)
    grid = (k // BLOCK_ROWS, triton.cdiv(n, 64))
    _w4a16_dequant[grid](w.qweight, w.scales, w.zeros, out, n, w.qweight.stride(0), w.scales.stride(0),
                         w.zeros.stride(0), out.stride(0), GROUP=w.group_size, BLOCK_N=64)
    return out


def w4a16_layout(w):
    """CudaPlatform.w4a16_layout: the kernels' layout where they take the layer, the weight as it is otherwise."""
    return relayout(w) if supported(w) else w


def w4a16_matmul(x: torch.Tensor, w) -> torch.Tensor:
    """CudaPlatform.w4a16_matmul: the kernels up to MAX_GEMM_M rows, dequantize + cuBLAS above; a layer the
    kernels do not take (K not in blocks of 128, groups not a multiple of 16) takes the plain-torch reference."""
    if not supported(w):
        from baton.models.layers.int4 import dequantize
        return torch.nn.functional.linear(x, dequantize(w, x.dtype))
    m, k = x.shape
    if m <= MAX_GEMM_M:
        cfg = pick_config(m, w.out_features, k, _num_sms(x.device))
        if cfg.kernel != "cublas":
            return w4a16_gemm(x, w, cfg)
    return x @ w4a16_dequantize(w, x.dtype)
