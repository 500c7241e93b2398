"""FP8 projections at decode sizes: e4m3 x e4m3 with row-wise scales, a Triton GEMM where it measured
faster than `torch._scaled_mm` (its one 128x128 cuBLAS tile leaves most SMs idle on the 4096-wide
outputs at M <= 256), `_scaled_mm` everywhere else.

The numbers are `_scaled_mm`'s, in either of --fp8-accumulation's modes: fast (the default, as vLLM's
FP8 GEMMs on Hopper) keeps the FP8 tensor cores' own sums (Triton's sm_90 default for
`max_num_imprecise_acc`, `_scaled_mm`'s use_fast_accum); fp32 promotes the partial sums to float32
every 128 products. Then token scale x channel scale, rounded once. The table's tiles were measured in
the default mode (its entry's "accumulation").

Small M: the weight tile is the MMA's 64-row side and the tokens its narrow side (SWAP_AB), so 16
tokens still run wgmma. Split-K: SPLIT_K programs share an output tile, each summing a slice of K
into a float32 partial in a workspace; the last one to finish (an atomic count per tile) adds the
partials in split order, so the result does not depend on which finished first, and resets the
count for the next call. The workspace is allocated once per device, sized for the whole table, so
captured graphs keep valid pointers.
"""
from __future__ import annotations

import json
import sys
from dataclasses import astuple, dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

PROMOTE_EVERY = 128         # products summed by the tensor cores before a float32 add (CUTLASS's default)


@dataclass(frozen=True, slots=True)
class Fp8GemmConfig:
    block_m: int            # tokens a tile
    block_n: int            # output channels a tile
    block_k: int
    split_k: int = 1
    swap_ab: bool = True    # weights as the MMA's A operand (tokens on the narrow side)
    num_warps: int = 4
    num_stages: int = 4

    def grid(self, m: int, n: int) -> tuple[int, int, int]:
        return triton.cdiv(n, self.block_n), triton.cdiv(m, self.block_m), self.split_k

    def fields(self) -> list:
        return list(astuple(self))

    def partial_floats(self, m: int, n: int) -> int:
        """The workspace this config needs at M = m (0 without split-K)."""
        if self.split_k == 1:
            return 0
        tiles_n, tiles_m, _ = self.grid(m, n)
        return self.split_k * tiles_n * tiles_m * self.block_m * self.block_n


Table = dict[tuple[int, int], tuple[tuple[int, Fp8GemmConfig | None], ...]]

# Measured tables, one per GPU name: {name: {"shapes": {"NxK": [[largest M, config fields or null], ...]}}},
# written by `python -m baton.benchmarks.quant_kernels --write-table` (docs/benchmarks.md, "Quantized
# serving"). For (N, K), the first row whose M is >= the step's M; null, and shapes, sizes or GPUs not
# listed, run `_scaled_mm`.
TABLES_FILE = Path(__file__).with_name("fp8_gemm_tables.json")
TABLE: Table | None = None          # set: used on every device instead of the measured tables (tests, the sweep)
_measured: dict[torch.device, Table] = {}


def parse_table(entry: dict) -> Table:
    return {tuple(int(d) for d in shape.split("x")): tuple((int(m), Fp8GemmConfig(*cfg) if cfg else None)
                                                          for m, cfg in rows)
            for shape, rows in entry.get("shapes", {}).items()}


def table(device: torch.device) -> Table:
    """TABLE if set, else the measured table of `device`'s GPU (empty where none was measured)."""
    if TABLE is not None:
        return TABLE
    if device not in _measured:
        tables = json.loads(TABLES_FILE.read_text()) if TABLES_FILE.exists() else {}
        gpu = torch.cuda.get_device_name(device)
        _measured[device] = parse_table(tables.get(gpu, {}))
        print(f"[baton] FP8 GEMMs on {gpu}: a measured Triton tile for {len(_measured[device])} weight shapes "
              f"({TABLES_FILE.name}), _scaled_mm elsewhere", file=sys.stderr)
    return _measured[device]


def pick(m: int, n: int, k: int, device: torch.device) -> Fp8GemmConfig | None:
    for largest, cfg in table(device).get((n, k), ()):
        if m <= largest:
            return cfg
    return None


class _Workspace:
    """Per device: float32 partials and int32 tile counts (zero between calls), sized once for the
    device's whole table."""

    def __init__(self):
        self.by_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def needed(rows_by_shape: Table) -> tuple[int, int]:
        floats, tiles = 1, 1
        for (n, _k), rows in rows_by_shape.items():
            for largest, cfg in rows:
                if cfg is None:
                    continue
                floats = max(floats, cfg.partial_floats(largest, n))
                tn, tm, _ = cfg.grid(largest, n)
                tiles = max(tiles, tn * tm)
        return floats, tiles

    def get(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        floats, tiles = self.needed(table(device))
        have = self.by_device.get(device)
        if have is None or have[0].numel() < floats or have[1].numel() < tiles:
            # first use (the eager warm-up before capture), or a TABLE grown since (tests, the sweep)
            have = (torch.empty(floats, dtype=torch.float32, device=device),
                    torch.zeros(tiles, dtype=torch.int32, device=device))
            self.by_device[device] = have
        return have


WORKSPACE = _Workspace()


@triton.jit
def _fp8_gemm_kernel(a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, out_ptr, partial_ptr, count_ptr,
                     M, N, K, stride_am, stride_wn, stride_om, split_k, per_split,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SWAP_AB: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                     PROMOTE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    first = pid_k * per_split
    a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * stride_am + (first * BLOCK_K + rk)[None, :]
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + (first * BLOCK_K + rk)[None, :]
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, per_split):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
            if EVEN_N:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = ((first + kb) * BLOCK_K + rk < K)[None, :]
            a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok, other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok, other=0.0)
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(a), acc, max_num_imprecise_acc=PROMOTE)
        else:
            acc = tl.dot(a, tl.trans(w), acc, max_num_imprecise_acc=PROMOTE)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SWAP_AB:
        acc = tl.trans(acc)                                   # [BLOCK_M, BLOCK_N]
    out_ptrs = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    out_mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT:
        tile = pid_m * tl.num_programs(0) + pid_n
        tile_elems = BLOCK_M * BLOCK_N
        inner = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        split_stride = tl.num_programs(0) * tl.num_programs(1) * tile_elems
        mine = partial_ptr + tile.to(tl.int64) * tile_elems + inner
        tl.store(mine + pid_k.to(tl.int64) * split_stride, acc)
        tl.debug_barrier()                                    # every thread's partial before the count
        done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == split_k - 1:                               # the last of the tile's splits: reduce in order
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(0, split_k):
                acc += tl.load(mine + s * split_stride, cache_modifier=".cg")
            sa = tl.load(a_scale_ptr + rm, mask=m_ok, other=0.0)
            sw = tl.load(w_scale_ptr + rn, mask=n_ok, other=0.0)
            tl.store(out_ptrs, (acc * sa[:, None] * sw[None, :]).to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(count_ptr + tile, 0)                # ready for the next call (and graph replay)
    else:
        sa = tl.load(a_scale_ptr + rm, mask=m_ok, other=0.0)
        sw = tl.load(w_scale_ptr + rn, mask=n_ok, other=0.0)
        tl.store(out_ptrs, (acc * sa[:, None] * sw[None, :]).to(out_ptr.dtype.element_ty), mask=out_mask)


def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
             cfg: Fp8GemmConfig, out_dtype: torch.dtype = torch.bfloat16, fast_accum: bool = False) -> torch.Tensor:
    """a e4m3 [M, K] (rows contiguous), a_scale float32 [M, 1]; w e4m3 [N, K], w_scale float32 [1, N]
    -> a @ w.T times both scales, [M, N] in out_dtype. Capturable: no host sync, no allocation
    but the output once the workspace exists. fast_accum: the tensor cores' sums are never promoted
    to float32 (`_scaled_mm`'s use_fast_accum)."""
    m, k = a.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    if triton.cdiv(k, cfg.block_k) % cfg.split_k:
        raise ValueError(f"fp8_gemm: split_k {cfg.split_k} does not divide K={k}'s blocks of {cfg.block_k}")
    if cfg.split_k > 1:
        partials, counts = WORKSPACE.get(a.device)
        if cfg.partial_floats(m, n) > partials.numel() or cfg.grid(m, n)[0] * cfg.grid(m, n)[1] > counts.numel():
            raise ValueError(f"fp8_gemm: {cfg} at M={m}, N={n} exceeds the workspace sized for the table")
    else:
        partials = counts = out                               # unused
    if a.stride(1) != 1:
        a = a.contiguous()
    _fp8_gemm_kernel[cfg.grid(m, n)](
        a, w, a_scale, w_scale, out, partials, counts, m, n, k, a.stride(0), w.stride(0), out.stride(0), cfg.split_k,
        triton.cdiv(k, cfg.block_k) // cfg.split_k,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SWAP_AB=cfg.swap_ab, SPLIT=cfg.split_k > 1,
        EVEN_K=k % cfg.block_k == 0, EVEN_N=n % cfg.block_n == 0,
        PROMOTE=None if fast_accum else min(PROMOTE_EVERY, cfg.block_k),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
              out_dtype: torch.dtype = torch.bfloat16, fast_accum: bool = False) -> torch.Tensor:
    """What an FP8 linear runs on CUDA: the device's table's Triton config for (M, N, K), else `_scaled_mm`."""
    cfg = pick(a.shape[0], w.shape[0], a.shape[1], a.device)
    if cfg is None:
        return torch._scaled_mm(a, w.t(), scale_a=a_scale, scale_b=w_scale, out_dtype=out_dtype,
                                use_fast_accum=fast_accum)
    return fp8_gemm(a, a_scale, w, w_scale, cfg, out_dtype, fast_accum)
