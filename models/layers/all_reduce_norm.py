"""The tensor-parallel all-reduce fused with the residual add and RMSNorm after it: one kernel, over
symmetric (peer-mapped) memory, where three ran (the all-reduce's copy-in, its sum, then add-RMSNorm).

A row-parallel projection (o_proj, down_proj) leaves each rank a partial sum; the RMSNorm after it adds
the full sum to the residual stream and normalizes. No barrier: the data is its own signal. Every rank's
region holds two halves of one slot per sending rank, every element negative zero ("empty") between
calls. Call e (counted on the device, the same count on every rank) uses half e % 2. Each program of the
kernel takes rows p, p + P, ...:

 1. writes its rows of this rank's partial into this rank's slot of every peer's half (push: stores over
    NVLink, which need no answer); a negative zero in them is written as a positive one, so no written
    element reads as empty (this rank sums the same, written values: every rank gets the same bits);
 2. reads each peer's slot of its own half until no element of the row is empty, then empties it again;
 3. sums the rows of every rank in rank order in fp32 (so every rank gets the same bits), rounds to the
    dtype, adds the residual and normalizes, rounding as `add_rms_norm` does (layer_ops.py): the outputs
    are what the all-reduce and `add_rms_norm` would have written (up to the sign of a zero sum);
 4. the last program to finish stores e for the next call.

Why a slot is empty before a peer writes it: a peer in call e writes half e % 2, last read (and emptied)
by this rank in call e - 2. The peer is in call e, so it has read this rank's rows of call e - 1, which
this rank wrote after its call e - 2 had ended. An element is read only once it is no longer empty, and
it is written once a call, so what is read is final. No host counter and no host wait: capturable in
CUDA graphs. The slots lie past torch's one-shot region (its first max_bytes).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_PROGRAMS = 1024         # a row each up to here (and the SM count); rows in turn beyond
_BITS = {2: (torch.int16, -(1 << 15)), 4: (torch.int32, -(1 << 31))}     # a negative zero's bits, by width


@triton.jit
def _all_reduce_add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, bufs, calls, rows, n, eps,
                                    slot_elems, EMPTY: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
                                    BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    bits = x_ptr.dtype.element_ty                # x and the buffers as integers of the dtype's width
    dtype = res_ptr.dtype.element_ty
    empty = tl.full([BLOCK], EMPTY, bits)
    e = tl.load(calls) + 1                      # this call's number: the last one's last program stored it
    half = (1 + (e & 1) * WORLD) * slot_elems   # past torch's region; a slot a sending rank
    for row in range(pid, rows, programs):
        v = tl.load(x_ptr + row * n + cols, mask=mask)
        v = tl.where(v == EMPTY, tl.zeros_like(v), v)
        for peer in tl.static_range(WORLD):
            if peer != RANK:
                to = tl.load(bufs + peer).to(tl.pointer_type(bits)) + half + RANK * slot_elems
                tl.store(to + row * n + cols, v, mask=mask)
    mine = tl.load(bufs + RANK).to(tl.pointer_type(bits)) + half
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    for row in range(pid, rows, programs):
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in tl.static_range(WORLD):
            if i == RANK:
                v = tl.load(x_ptr + row * n + cols, mask=mask, other=0)
                v = tl.where(v == EMPTY, tl.zeros_like(v), v)
            else:
                at = mine + i * slot_elems + row * n + cols
                v = tl.load(at, mask=mask, other=0, volatile=True)
                while tl.max((v == EMPTY).to(tl.int32), 0) > 0:      # the peer's row has not all landed
                    v = tl.load(at, mask=mask, other=0, volatile=True)
                tl.store(at, empty, mask=mask)
            acc += v.to(dtype, bitcast=True).to(tl.float32)
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


def buffer_bytes(max_bytes: int, world: int) -> int:
    """A rank's symmetric buffer for tensors of up to max_bytes: torch's one-shot region, then this kernel's
    two halves of a slot a rank."""
    return (1 + 2 * world) * max_bytes


def empty_slots(buffer: torch.Tensor, max_bytes: int, dtype: torch.dtype) -> None:
    """Every element of the kernel's slots in `buffer` (a rank's, uint8) empty, for values of `dtype`: once,
    before any rank's first call."""
    kind, value = _BITS[torch.empty(0, dtype=dtype).element_size()]
    buffer[max_bytes:].view(kind).fill_(value)


def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            bufs: torch.Tensor, calls: torch.Tensor, rank: int, world: int, max_bytes: int,
                            max_programs: int = MAX_PROGRAMS) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(sum over ranks of x + residual), sum over ranks of x + residual), every rank alike.
    x, residual: [rows, n] contiguous, this rank's partial sum and the residual stream, x at most max_bytes,
    of the dtype the slots were emptied for (`empty_slots`); bufs: int64, every rank's symmetric buffer's
    address (buffer_bytes(max_bytes, world) each, on x's device), in rank order; calls: int32 [2] on the device,
    zero before the first call, this kernel's alone. Every rank makes the same calls with the same shapes."""
    rows, n = x.shape
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    total = torch.empty_like(x)
    if rows == 0:
        return out, total
    kind, value = _BITS[x.element_size()]
    block = triton.next_power_of_2(n)
    _all_reduce_add_rms_norm_kernel[(min(rows, max_programs),)](
        x.view(kind), residual, weight, out, total, bufs, calls, rows, n, eps, max_bytes // x.element_size(),
        EMPTY=value, RANK=rank, WORLD=world, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return out, total
