"""The tensor-parallel all-reduce fused with the residual add and RMSNorm after it: one kernel, over
symmetric (peer-mapped) memory, where three ran (the all-reduce's copy-in, its sum, then add-RMSNorm).

A row-parallel projection (o_proj, down_proj) leaves each rank a partial sum; the RMSNorm after it adds
the full sum to the residual stream and normalizes. Each program of the kernel takes rows p, p + P, ...:

 1. copies its rows of this rank's partial into this rank's symmetric buffer;
 2. barrier: sets its slot on every peer's signal pad (release: the rows are visible first) and waits for
    every peer's slot on its own pad (acquire);
 3. sums the rows of every rank's buffer in rank order in fp32 (so every rank gets the same bits), rounds
    to the dtype, adds the residual and normalizes, rounding as `add_rms_norm` does (layer_ops.py): the
    outputs are what the all-reduce and `add_rms_norm` would have written;
 4. barrier again once its reads are done, so that a later kernel may overwrite this rank's buffer.

A signal is set 0 -> 1 by its sender and taken 1 -> 0 by its receiver (compare-and-swap at system scope),
so the pads are back at zero after every call: no host counter, hence capturable in CUDA graphs. The
slots sit in the upper half of the pad, apart from torch's own symmetric-memory kernels' slots.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_PROGRAMS = 1024         # a row each up to here (if the signal pads hold their slots); rows in turn beyond


@triton.jit
def _signal(pad, slot):
    # wait until the slot is free, then set it; release: this program's earlier writes are seen first. (A plain
    # st.release.sys by one thread, fire and forget, measured ~1 us faster a call; Triton's interpreter has no
    # inline PTX, so the CPU tests could not run it.)
    while tl.atomic_cas(pad + slot, 0, 1, sem="release", scope="sys") != 0:
        pass


@triton.jit
def _wait(pad, slot):
    while tl.atomic_cas(pad + slot, 1, 0, sem="acquire", scope="sys") != 1:
        pass


@triton.jit
def _barrier(pads, slot0, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Every peer's program of the same index has reached this point too (slot0: this barrier's first slot
    for this program; a slot a sending rank)."""
    tl.debug_barrier()                           # every thread's writes (or reads) of this program are done
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            _signal(tl.load(pads + peer).to(tl.pointer_type(tl.int32)), slot0 + RANK)
    mine = tl.load(pads + RANK).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            _wait(mine, slot0 + peer)
    tl.debug_barrier()                           # no thread reads before the peers' writes are visible


@triton.jit
def _all_reduce_add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, bufs, pads, rows, n, eps,
                                    first_slot, RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    dtype = x_ptr.dtype.element_ty
    mine = tl.load(bufs + RANK).to(tl.pointer_type(dtype))
    for row in range(pid, rows, programs):
        tl.store(mine + row * n + cols, tl.load(x_ptr + row * n + cols, mask=mask), mask=mask)
    _barrier(pads, first_slot + pid * WORLD, RANK, WORLD)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    for row in range(pid, rows, programs):
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in tl.static_range(WORLD):
            buf = tl.load(bufs + i).to(tl.pointer_type(dtype))
            acc += tl.load(buf + row * n + cols, mask=mask, other=0.0).to(tl.float32)
        # the sum rounded to the dtype, then the residual added and rounded, as add_rms_norm does (in fp32 here:
        # a correctly rounded sum of two bf16 values either way)
        res = tl.load(res_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
        s = (acc.to(dtype).to(tl.float32) + res).to(dtype)
        tl.store(sum_ptr + row * n + cols, s, mask=mask)
        h = s.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(h * h, 0) / n + eps)
        normed = (h * rstd).to(dtype).to(tl.float32)
        tl.store(out_ptr + row * n + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)
    _barrier(pads, first_slot + (programs + pid) * WORLD, RANK, WORLD)


def slots_needed(world: int, programs: int = MAX_PROGRAMS) -> int:
    """Signal-pad words one call uses: two barriers, a slot per (program, sending rank)."""
    return 2 * programs * world


def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            bufs: torch.Tensor, pads: torch.Tensor, rank: int, world: int, first_slot: int,
                            max_programs: int = MAX_PROGRAMS) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(sum over ranks of x + residual), sum over ranks of x + residual), every rank alike.
    x, residual: [rows, n] contiguous, this rank's partial sum and the residual stream; bufs, pads: int64
    tensors of every rank's symmetric buffer and signal pad address (on x's device), in rank order; the
    buffers hold at least rows x n of x's dtype; pads' slots_needed(world, max_programs) words from first_slot
    on are this kernel's. Every rank calls it with the same shapes (the ranks' programs pair up by index)."""
    rows, n = x.shape
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    total = torch.empty_like(x)
    if rows == 0:
        return out, total
    block = triton.next_power_of_2(n)
    _all_reduce_add_rms_norm_kernel[(min(rows, max_programs),)](
        x, residual, weight, out, total, bufs, pads, rows, n, eps, first_slot, RANK=rank, WORLD=world,
        BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return out, total
