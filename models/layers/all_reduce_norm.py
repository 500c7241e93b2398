"""The tensor-parallel all-reduce fused with the residual add and RMSNorm after it: one kernel, over
symmetric (peer-mapped) memory, where three ran (the all-reduce's copy-in, its sum, then add-RMSNorm).

A row-parallel projection (o_proj, down_proj) leaves each rank a partial sum; the RMSNorm after it adds
the full sum to the residual stream and normalizes. Call e (counted on the device, the same count on
every rank) uses half e % 2 of each rank's fused region. Each program of the kernel takes rows p, p + P, ...:

 1. copies its rows of this rank's partial into this rank's half;
 2. writes e into its slot on every peer's signal pad (release: the rows are visible first) and waits
    until every peer's slot on its own pad holds e or more (acquire): the peers' rows are there;
 3. sums the rows of every rank's half in rank order in fp32 (so every rank gets the same bits), rounds
    to the dtype, adds the residual and normalizes, rounding as `add_rms_norm` does (layer_ops.py): the
    outputs are what the all-reduce and `add_rms_norm` would have written;
 4. the last program to finish stores e for the next call.

One barrier, not two: a rank that reaches call e has seen each peer reach call e - 1 (its kernel e - 1
waited for their signals), so each peer's kernel e - 2, the last to read the half that call e writes, has
ended. A slot only grows, so a signal is never lost to one sent later. No host counter: capturable in CUDA
graphs. The slots sit in the upper half of the pad, apart from torch's own symmetric-memory kernels'.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_PROGRAMS = 1024         # a row each up to here (and the pads' slots, and the SM count); rows in turn beyond


@triton.jit
def _barrier(pads, slot0, e, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Every peer's program of the same index has its rows of call e in place (slot0: this program's first
    slot; a slot a sending rank)."""
    tl.debug_barrier()                           # every thread's writes of this program are done
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            tl.atomic_xchg(tl.load(pads + peer).to(tl.pointer_type(tl.int32)) + slot0 + RANK, e,
                           sem="release", scope="sys")
    mine = tl.load(pads + RANK).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            # e or more (e + 1: the peer is one call ahead already); the difference, as the counts wrap
            while tl.atomic_add(mine + slot0 + peer, 0, sem="acquire", scope="sys") - e < 0:
                pass
    tl.debug_barrier()                           # no thread reads before the peers' writes are visible


@triton.jit
def _all_reduce_add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, bufs, pads, calls, rows, n, eps,
                                    first_slot, half_elems, RANK: tl.constexpr, WORLD: tl.constexpr,
                                    BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    dtype = x_ptr.dtype.element_ty
    e = tl.load(calls) + 1                      # this call's number: the last one's last program stored it
    base = (1 + (e & 1)) * half_elems           # past torch's region, the half this call writes
    mine = tl.load(bufs + RANK).to(tl.pointer_type(dtype)) + base
    for row in range(pid, rows, programs):
        tl.store(mine + row * n + cols, tl.load(x_ptr + row * n + cols, mask=mask), mask=mask)
    _barrier(pads, first_slot + pid * WORLD, e, RANK, WORLD)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    for row in range(pid, rows, programs):
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in tl.static_range(WORLD):
            buf = tl.load(bufs + i).to(tl.pointer_type(dtype)) + base
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
    if tl.atomic_add(calls + 1, 1) == programs - 1:       # the last program: the next call's number
        tl.store(calls + 1, 0)
        tl.store(calls, e)


def slots_needed(world: int, programs: int = MAX_PROGRAMS) -> int:
    """Signal-pad words the kernel uses: a slot per (program, sending rank)."""
    return programs * world


def buffer_bytes(max_bytes: int) -> int:
    """A rank's symmetric buffer for tensors of up to max_bytes: torch's one-shot region, then this kernel's
    two halves."""
    return 3 * max_bytes


def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            bufs: torch.Tensor, pads: torch.Tensor, calls: torch.Tensor, rank: int, world: int,
                            first_slot: int, max_bytes: int,
                            max_programs: int = MAX_PROGRAMS) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(sum over ranks of x + residual), sum over ranks of x + residual), every rank alike.
    x, residual: [rows, n] contiguous, this rank's partial sum and the residual stream, x at most max_bytes;
    bufs, pads: int64 tensors of every rank's symmetric buffer (buffer_bytes(max_bytes) each) and signal pad
    address (on x's device), in rank order; pads' slots_needed(world, max_programs) words from first_slot on
    are this kernel's, zero before its first call; calls: int32 [2] on the device, zero before the first call,
    this kernel's alone. Every rank makes the same calls with the same shapes (programs pair up by index)."""
    rows, n = x.shape
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    total = torch.empty_like(x)
    if rows == 0:
        return out, total
    block = triton.next_power_of_2(n)
    _all_reduce_add_rms_norm_kernel[(min(rows, max_programs),)](
        x, residual, weight, out, total, bufs, pads, calls, rows, n, eps, first_slot, max_bytes // x.element_size(),
        RANK=rank, WORLD=world, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return out, total
