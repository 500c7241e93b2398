"""Fused MoE experts: routing alignment on the device, then two grouped GEMMs, no host sync.

1. Alignment (moe_routing.py): the T*k (token, choice) pairs sorted by expert into blocks of
   BLOCK_M rows, each block owned by one expert (padding rows point past the last pair): one
   Triton program for the smallest steps (`align`, up to ONE_PROGRAM_ALIGN_MAX_PAIRS pairs),
   three launches over chunks of pairs above; both give `moe_align.align_by_expert`'s (torch)
   rows exactly.
2. w13 [E, 2I, H]: one program per (block, N tile) computes the gate and the up tile together
   and writes SiLU(gate) * up, so the 2I-wide intermediate never reaches memory: [T*k, I].
3. w2 [E, H, I]: the same grouping, each row scaled by its routing weight, into a float32
   [T*k, H] buffer indexed by pair.
4. The k pairs of each token are summed in a fixed order (a plain reduction: deterministic, no
   atomics), rounded once to the activations' dtype.

FP8 experts (--quantization fp8): both stacks in e4m3 with one float32 scale per (expert, output
channel), run one of two ways (quantization.fp8_expert_dots, which the CPU's reference follows too;
FP8 x FP8 at every size by default, measured on an H100 and an H200):
- weight-only (deterministic mode, or at or below FP8_EXPERT_DOTS_ABOVE pairs an expert): the activations stay in the
  model dtype, each weight tile is widened
  in registers after its load (e4m3 fits bf16 exactly) and the scales multiply the float32 sums in
  the epilogue: decode, which streams the hit experts' weights, reads half the bytes, and no
  activation is quantized (no extra launch). Its widened tile goes back through shared memory
  (wgmma's B operand), which bounds it once a step's FLOPs matter.
- FP8 x FP8: x's rows quantized per token to e4m3 (quant.quantize_fp8_rows), the
  SiLU product likewise between the two GEMMs (its row scale needs the whole row, which the w13
  kernel spreads over its N tiles: one small launch), e4m3 x e4m3 dots into float32 accumulators
  (on sm_90 at the FP8 tensor cores' own accumulation precision, Triton's default there), and the
  epilogue multiplying by token scale x channel scale: the FP8 tensor cores' rate. At decode sizes
  (up to 24 pairs an expert) the dots run swapped (`MoeTiles.swap`: out^T = W . x^T), so the weight
  tile fills wgmma's 64-row M and an expert's 16-32 rows are its N; unswapped, those rows would be
  the M and Triton would take mma.sync.

Launch shapes depend on (T, k, E, H, I) only, never on the routing, so the step captures into
a CUDA graph. Each block loads its expert's weight tiles once for its BLOCK_M rows; at decode
(a few pairs per expert) one block per hit expert means each hit expert's weights are read once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from baton.engine.platforms.triton_kernels.moe_align import ExpertBlocks
from baton.engine.platforms.triton_kernels.moe_routing import align
from baton.engine.platforms.triton_kernels.quant import quantize_fp8_rows
from baton.models.layers.quantization import FP8, ExpertScales, fp8_expert_dots


@dataclass(frozen=True, slots=True)
class MoeTiles:
    """Tile sizes of both GEMMs; block_m is also the alignment's padding unit. The w2_* fields,
    where nonzero, override block_n / block_k / num_warps / num_stages for the w2 GEMM alone (its
    N is H and its K is I: the other way round from w13's)."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    w2_block_n: int = 0
    w2_block_k: int = 0
    w2_num_warps: int = 0
    w2_num_stages: int = 0
    swap: bool = False          # FP8 x FP8 only: out^T = W . x^T (the weights fill wgmma's 64-row M)

    def for_w2(self) -> MoeTiles:
        """The tiles the w2 GEMM runs with."""
        return MoeTiles(self.block_m, self.w2_block_n or self.block_n, self.w2_block_k or self.block_k,
                        self.w2_num_warps or self.num_warps, self.w2_num_stages or self.num_stages, swap=self.swap)


def pick_tiles(num_slots: int, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype) -> MoeTiles:
    """Per bucket of expected rows per expert (T*k/E under even routing). Decode (a few rows per
    expert) is a weight stream: the smallest BLOCK_M the tensor cores take, so one block per hit
    expert, and N tiles narrow enough that the hit experts' tiles cover every SM. Prefill is a
    GEMM: larger tiles for reuse. dtype FP8: the FP8 x FP8 dots' tiles (e4m3 activations: one byte
    an element, so twice bf16's BLOCK_K in the same shared memory); at decode sizes (up to 24 rows an
    expert) they run swapped, the weights' N tile as wgmma's M (64 rows) and the expert's few rows
    as its N (16 or 32), where unswapped tiles would take mma.sync."""
    per_expert = num_slots / num_experts
    if dtype == FP8 and per_expert > 96:
        tiles = MoeTiles(128, 128, 128, 8, 3, 256, 128, 8, 3)
    elif dtype == FP8 and per_expert > 24:
        tiles = MoeTiles(64, 64, 128, 4, 3)
    elif dtype == FP8:
        tiles = (MoeTiles(16, 64, 256, 4, 3, swap=True) if per_expert <= 4    # (H100 and H200: moe_kernel --fp8)
                 else MoeTiles(32, 64, 128, 4, 4, swap=True))
    elif per_expert <= 4:               # buckets and tiles from benchmarks/moe_kernel.py on an H200
        tiles = MoeTiles(16, 32, 128, 4, 5)
    elif per_expert <= 24:
        tiles = MoeTiles(32, 64, 128, 4, 3)
    elif per_expert <= 96:
        tiles = MoeTiles(64, 64, 64, 4, 3)
    else:                             # prefill; w2 (N = H, K = I) takes 128x256 tiles (-10% of w2 at T 2048-8192)
        tiles = MoeTiles(128, 128, 64, 8, 4, 256, 64, 8, 4)
    if dtype == torch.float32:        # twice the bytes per tile: halve K (shared memory), M (registers)
        tiles = MoeTiles(min(64, tiles.block_m), tiles.block_n, max(32, tiles.block_k // 2), tiles.num_warps, 2)
    smallest = triton.next_power_of_2(min(hidden, intermediate))   # (the w2 overrides are bf16/fp16 tunings)

    def fit(n: int) -> int:
        return n and max(16, min(n, smallest))
    return MoeTiles(tiles.block_m, fit(tiles.block_n), fit(tiles.block_k), tiles.num_warps, tiles.num_stages,
                    fit(tiles.w2_block_n), fit(tiles.w2_block_k), tiles.w2_num_warps, tiles.w2_num_stages, tiles.swap)


def invariant_tiles(num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype) -> MoeTiles:
    """Deterministic mode: one tile shape for every batch, a decode bucket's (BLOCK_K sets the
    pieces each output's sum is cut into, BLOCK_M the tensor-core instruction). Prefill pays for
    the small tiles."""
    return pick_tiles(10 * num_experts, num_experts, hidden, intermediate, dtype)


@triton.jit
def _sum_pairs_kernel(src_ptr, out_ptr, ids_ptr, E, H, TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK: tl.constexpr,
                      FOREIGN: tl.constexpr):
    """out[t] = sum_j src[t * TOP_K + j] in float32, in a fixed order, rounded once. FOREIGN: pairs
    whose id (ids [T, TOP_K]) is E are another rank's, their rows never written: left out."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    j = tl.arange(0, K_PAD)
    keep = j < TOP_K
    if FOREIGN:
        keep = keep & (tl.load(ids_ptr + t * TOP_K + j, mask=j < TOP_K, other=E) < E)
    v = tl.load(src_ptr + (t * TOP_K + j)[:, None] * H + cols[None, :], mask=keep[:, None] & (cols < H)[None, :],
                other=0.0)
    tl.store(out_ptr + t * H + cols, tl.sum(v, axis=0).to(out_ptr.dtype.element_ty), mask=cols < H)


@triton.jit
def _block_rows(slots_ptr, block, num_slots, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """An expert GEMM program's rows (the block's pair slots; valid: not padding) and output
    channels (its N tile; n_ok: inside N)."""
    slots = tl.load(slots_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return slots, slots < num_slots, offs_n, offs_n < N


@triton.jit
def _w13_silu_kernel(x_ptr, x_scale_ptr, w_ptr, scale_ptr, out_ptr, slots_ptr, block_expert_ptr, num_slots,
                     num_experts, N, K, top_k, stride_x, stride_we, stride_wn, stride_o,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PRECISION: tl.constexpr, FP8_W: tl.constexpr, FP8_A: tl.constexpr):
    """out[slot, n] = silu(x[token] . w[e, n]) * (x[token] . w[e, N + n]) for the block's rows.
    FP8_W: w is e4m3, and each output channel's scale[e, n] (float32 [E, 2N]) multiplies the
    float32 sums before SiLU; w is widened to x's dtype in registers (exactly), unless FP8_A: x
    is e4m3 too, with a float32 scale per token (x_scale [T, 1]), the dots e4m3 x e4m3 and the
    sums times x_scale[token] as well."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= num_experts:        # past the last expert's group: nothing to do
        return
    slots, valid, offs_n, n_ok = _block_rows(slots_ptr, block, num_slots, N, BLOCK_M, BLOCK_N)
    tokens = slots // top_k
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_x + offs_k[None, :]
    g_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + N * stride_wn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        wg = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        wu = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if FP8_W and not FP8_A:
            wg, wu = wg.to(a.dtype), wu.to(a.dtype)
        gate = tl.dot(a, wg, gate, input_precision=PRECISION)
        up = tl.dot(a, wu, up, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if FP8_W:
        scales = scale_ptr + expert * 2 * N + offs_n
        gate *= tl.load(scales, mask=n_ok, other=0.0)[None, :]
        up *= tl.load(scales + N, mask=n_ok, other=0.0)[None, :]
    if FP8_A:
        token_scale = tl.load(x_scale_ptr + tokens, mask=valid, other=0.0)[:, None]
        gate *= token_scale
        up *= token_scale
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + slots[:, None] * stride_o + offs_n[None, :], act.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _w2_kernel(a_ptr, a_scale_ptr, w_ptr, scale_ptr, out_ptr, slots_ptr, block_expert_ptr, route_ptr, num_slots,
               num_experts, N, K, stride_a, stride_we, stride_wn, stride_o,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
               FP8_W: tl.constexpr, FP8_A: tl.constexpr):
    """out[slot, n] = route[slot] * (a[slot] . w[e, n]), in float32 (FP8_W: times scale[e, n] too,
    float32 [E, N], the e4m3 weights widened in registers; FP8_A: a is e4m3 too, e4m3 x e4m3 dots,
    times a_scale[slot] as well)."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= num_experts:
        return
    slots, valid, offs_n, n_ok = _block_rows(slots_ptr, block, num_slots, N, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + slots[:, None] * stride_a + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if FP8_W and not FP8_A:
            w = w.to(a.dtype)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    route = tl.load(route_ptr + slots, mask=valid, other=0.0).to(tl.float32)
    if FP8_W:
        acc *= tl.load(scale_ptr + expert * N + offs_n, mask=n_ok, other=0.0)[None, :]
    if FP8_A:
        route *= tl.load(a_scale_ptr + slots, mask=valid, other=0.0)
    tl.store(out_ptr + slots[:, None] * stride_o + offs_n[None, :], acc * route[:, None],
             mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _w13_silu_swapped_kernel(x_ptr, x_scale_ptr, w_ptr, scale_ptr, out_ptr, slots_ptr, block_expert_ptr, num_slots,
                             num_experts, N, K, top_k, stride_x, stride_we, stride_wn, stride_o,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """_w13_silu_kernel's FP8 x FP8 case at decode sizes, transposed: gate^T [BLOCK_N, BLOCK_M] =
    w_gate[e, n-tile] . x[rows]^T, so the weight tile (64+ rows, K-major) is wgmma's A and the block's
    few rows (K-major too, as e4m3 wgmma wants both) its N; the same sums, scales and SiLU."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= num_experts:
        return
    slots, valid, offs_n, n_ok = _block_rows(slots_ptr, block, num_slots, N, BLOCK_M, BLOCK_N)
    tokens = slots // top_k
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_x + offs_k[None, :]
    g_ptrs = w_ptr + expert * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :]
    u_ptrs = g_ptrs + N * stride_wn
    gate = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.trans(tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0))
        wg = tl.load(g_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        wu = tl.load(u_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        gate = tl.dot(wg, a, gate)
        up = tl.dot(wu, a, up)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    scales = scale_ptr + expert * 2 * N + offs_n
    gate *= tl.load(scales, mask=n_ok, other=0.0)[:, None]
    up *= tl.load(scales + N, mask=n_ok, other=0.0)[:, None]
    token_scale = tl.load(x_scale_ptr + tokens, mask=valid, other=0.0)[None, :]
    gate *= token_scale
    up *= token_scale
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + slots[None, :] * stride_o + offs_n[:, None], act.to(out_ptr.dtype.element_ty),
             mask=valid[None, :] & n_ok[:, None])


@triton.jit
def _w2_swapped_kernel(a_ptr, a_scale_ptr, w_ptr, scale_ptr, out_ptr, slots_ptr, block_expert_ptr, route_ptr,
                       num_slots, num_experts, N, K, stride_a, stride_we, stride_wn, stride_o,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """_w2_kernel's FP8 x FP8 case at decode sizes, transposed as _w13_silu_swapped_kernel is."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= num_experts:
        return
    slots, valid, offs_n, n_ok = _block_rows(slots_ptr, block, num_slots, N, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + slots[:, None] * stride_a + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.trans(tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0))
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(w, a, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    route = tl.load(route_ptr + slots, mask=valid, other=0.0).to(tl.float32)
    acc *= tl.load(scale_ptr + expert * N + offs_n, mask=n_ok, other=0.0)[:, None]
    route *= tl.load(a_scale_ptr + slots, mask=valid, other=0.0)
    tl.store(out_ptr + slots[None, :] * stride_o + offs_n[:, None], acc * route[None, :],
             mask=valid[None, :] & n_ok[:, None])


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
           scales: ExpertScales | None) -> None:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"need x [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    e, two_i, h = w13.shape
    if w2.shape != (e, h, two_i // 2) or two_i % 2 or x.shape[1] != h:
        raise ValueError(f"expert shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"ids and weights must both be [T, k] with T = {x.shape[0]}; got {tuple(ids.shape)}, "
                         f"{tuple(weights.shape)}")
    if not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("stacked expert weights must be contiguous")
    fp8 = (w13.dtype == FP8, w2.dtype == FP8)
    if any(fp8) and not (all(fp8) and scales is not None):
        raise ValueError(f"e4m3 expert weights need both stacks in e4m3 and their scales; got {w13.dtype}, "
                         f"{w2.dtype}, scales {'given' if scales is not None else 'None'}")
    if scales is not None:
        want = ((e, two_i), (e, h))
        got = (tuple(scales.w13.shape), tuple(scales.w2.shape))
        if got != want or not all(s.dtype == torch.float32 and s.is_contiguous() for s in scales):
            raise ValueError(f"expert scales must be contiguous float32 {want}, got {got}")


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                  tiles: MoeTiles | None = None, invariant: bool = False,
                  scales: ExpertScales | None = None, fp8_dots: bool | None = None,
                  foreign: bool = False) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for SwiGLU experts w13 [E, 2I, H], w2 [E, H, I];
    x [T, H] -> [T, H] in x's dtype. `tiles` overrides the bucket's choice (benchmarks); `invariant`:
    the same tiles for every T (deterministic mode). FP8 experts (--quantization fp8): w13 and w2
    in e4m3 with `scales` per (expert, output channel), weight-only or FP8 x FP8 (`fp8_dots`; None:
    quantization.fp8_expert_dots by the step's shape, weight-only under `invariant`). `foreign`: ids
    equal to E mark pairs another rank computes (expert parallelism): aligned as an extra expert
    whose blocks the GEMMs skip and whose rows the sum leaves out."""
    _check(x, w13, w2, ids, weights, scales)
    t, k = ids.shape
    e, two_i, h = w13.shape
    inter = two_i // 2
    if t == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    if fp8_dots is None:
        fp8_dots = not invariant and fp8_expert_dots(t * k, e)
    dots = scales is not None and fp8_dots
    dtype = FP8 if dots else x.dtype
    tiles = tiles or (invariant_tiles(e, h, inter, dtype) if invariant else pick_tiles(t * k, e, h, inter, dtype))
    blocks = align(ids, e + foreign, tiles.block_m)
    blocks.num_experts = e                  # (foreign: the extra group's blocks count as past the last)
    act = torch.empty(t * k, inter, dtype=x.dtype, device=x.device)
    s13, s2 = (None, None) if scales is None else scales
    per_pair = torch.empty(t * k, h, dtype=torch.float32, device=x.device)
    route = weights.reshape(-1).contiguous()
    if dots:                 # FP8 x FP8: x's rows, then the SiLU product's, quantized per token
        xq, x_scale = quantize_fp8_rows(x)
        launch_w13(xq, w13, act, blocks, k, tiles, s13, x_scale=x_scale)
        aq, act_scale = quantize_fp8_rows(act)
        launch_w2(aq, w2, per_pair, blocks, route, tiles, s2, act_scale=act_scale)
    else:
        launch_w13(x, w13, act, blocks, k, tiles, s13)
        launch_w2(act, w2, per_pair, blocks, route, tiles, s2)
    out = torch.empty_like(x)
    launch_sum(per_pair, out, k, ids if foreign else None, e)
    return out


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def launch_w13(x: torch.Tensor, w13: torch.Tensor, act: torch.Tensor, blocks: ExpertBlocks, top_k: int,
               tiles: MoeTiles, scale: torch.Tensor | None = None, x_scale: torch.Tensor | None = None) -> None:
    """act[pair] = SiLU(x[token] . gate) * (x[token] . up): step 2 of the module's docstring
    (`scale` [E, 2I]: w13 is e4m3; `x_scale` [T, 1]: x is e4m3 too, FP8 x FP8)."""
    inter = w13.shape[1] // 2
    grid = (blocks.max_blocks, triton.cdiv(inter, tiles.block_n))
    if tiles.swap:
        _check_swap(scale, x_scale)
        _w13_silu_swapped_kernel[grid](x, x_scale, w13, scale, act, blocks.sorted_slots, blocks.block_expert,
                                       blocks.num_slots, blocks.num_experts, inter, w13.shape[2], top_k, x.stride(0),
                                       w13.stride(0), w13.stride(1), act.stride(0), BLOCK_M=tiles.block_m,
                                       BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, num_warps=tiles.num_warps,
                                       num_stages=tiles.num_stages)
        return
    _w13_silu_kernel[grid](x, x if x_scale is None else x_scale, w13, w13 if scale is None else scale, act,
                           blocks.sorted_slots, blocks.block_expert, blocks.num_slots, blocks.num_experts, inter,
                           w13.shape[2], top_k, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
                           BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                           PRECISION=_precision(x.dtype), FP8_W=scale is not None, FP8_A=x_scale is not None,
                           num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def launch_w2(act: torch.Tensor, w2: torch.Tensor, per_pair: torch.Tensor, blocks: ExpertBlocks, route: torch.Tensor,
              tiles: MoeTiles, scale: torch.Tensor | None = None, act_scale: torch.Tensor | None = None) -> None:
    """per_pair[pair] = route[pair] * (act[pair] . w2[e]) in float32: step 3; tiles.for_w2()
    (`scale` [E, H]: w2 is e4m3; `act_scale` [T*k, 1]: act is e4m3 too, FP8 x FP8)."""
    w = tiles.for_w2()
    h = w2.shape[1]
    grid = (blocks.max_blocks, triton.cdiv(h, w.block_n))
    if w.swap:
        _check_swap(scale, act_scale)
        _w2_swapped_kernel[grid](act, act_scale, w2, scale, per_pair, blocks.sorted_slots, blocks.block_expert, route,
                                 blocks.num_slots, blocks.num_experts, h, w2.shape[2], act.stride(0), w2.stride(0),
                                 w2.stride(1), per_pair.stride(0), BLOCK_M=w.block_m, BLOCK_N=w.block_n,
                                 BLOCK_K=w.block_k, num_warps=w.num_warps, num_stages=w.num_stages)
        return
    _w2_kernel[grid](act, act if act_scale is None else act_scale, w2, w2 if scale is None else scale, per_pair,
                     blocks.sorted_slots, blocks.block_expert, route, blocks.num_slots, blocks.num_experts, h,
                     w2.shape[2], act.stride(0), w2.stride(0), w2.stride(1), per_pair.stride(0),
                     BLOCK_M=w.block_m, BLOCK_N=w.block_n, BLOCK_K=w.block_k, PRECISION=_precision(act.dtype),
                     FP8_W=scale is not None, FP8_A=act_scale is not None, num_warps=w.num_warps,
                     num_stages=w.num_stages)


def _check_swap(scale: torch.Tensor | None, act_scale: torch.Tensor | None) -> None:
    if scale is None or act_scale is None:
        raise ValueError("swapped tiles (MoeTiles.swap) are for FP8 x FP8 only: e4m3 weights and activations")


def launch_sum(per_pair: torch.Tensor, out: torch.Tensor, top_k: int, foreign_ids: torch.Tensor | None = None,
               num_experts: int = 0) -> None:
    """out[t] = the sum of its top_k rows of per_pair, rounded once: step 4 (`foreign_ids`: the
    routing, whose ids equal to `num_experts` mark rows to leave out)."""
    t, h = out.shape
    ids = per_pair if foreign_ids is None else foreign_ids.contiguous()
    _sum_pairs_kernel[(t, triton.cdiv(h, 256))](per_pair, out, ids, num_experts, h, TOP_K=top_k,
                                                K_PAD=triton.next_power_of_2(top_k), BLOCK=256, num_warps=4,
                                                FOREIGN=foreign_ids is not None)
