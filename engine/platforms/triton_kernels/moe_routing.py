"""The MoE step's routing on the device (Triton), no host sync: the gating (`route`: softmax, top-k,
renormalisation, one program a token) and the alignment (`align`: the T*k (token, choice) pairs
sorted by expert into blocks of BLOCK_M rows, each block owned by one expert, padding rows
pointing past the last pair), which gives `moe_align.align_by_expert`'s (torch) rows exactly.
The grouped expert GEMMs that read those blocks are moe.py's."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton.engine.platforms.triton_kernels.moe_align import ExpertBlocks, max_blocks

# up to this many (token, choice) pairs the alignment runs as one Triton program (one launch);
# its time grows with the pairs (one CTA walks them twice; on an H200: 7 us at 8 pairs, 8.6 at 64,
# 36 at 512, 124 at 2048), so above this it runs as three launches over chunks of pairs
# (_align_chunked: 8.6-10.6 us up to 64 pairs, 13 at 512-2048, 26 at 16k, 87 at 64k; torch's
# moe_align.align_by_expert, the reference, took 44-79 us up to 2048 pairs and 131-164 at 16k-128k)
ONE_PROGRAM_ALIGN_MAX_PAIRS = 128


@triton.jit
def _align_kernel(ids_ptr, slots_ptr, block_expert_ptr, num_slots, num_experts, num_blocks,
                  BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """moe_align.align_by_expert in one program: per-expert counts, padded group offsets (a
    cumsum), block owners, then each pair's row = its group's start + its rank among the earlier
    pairs of its expert (a running count plus a cumsum over a one-hot chunk)."""
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, num_slots, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded
    rows = num_blocks * BLOCK_M
    for start in range(0, rows, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        tl.store(slots_ptr + offs, num_slots, mask=offs < rows)
    for start in range(0, num_blocks, CHUNK):
        b = start + tl.arange(0, CHUNK)
        owner = tl.sum((padded_end[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.minimum(owner, num_experts), mask=b < num_blocks)
    tl.debug_barrier()               # the padding fill lands before the pairs overwrite it
    seen = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, num_slots, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1)
        hot = (e[:, None] == experts[None, :]).to(tl.int32)
        rank = tl.sum(hot * (tl.cumsum(hot, axis=0) - 1 + seen[None, :]), axis=1)
        first = tl.sum(hot * padded_start[None, :], axis=1)
        tl.store(slots_ptr + first + rank, offs, mask=offs < num_slots)
        seen += tl.sum(hot, axis=0)


@triton.jit
def _chunk_counts_kernel(ids_ptr, counts_ptr, slots_ptr, num_slots, rows,
                         E_PAD: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr):
    """counts[c, e] = the pairs of chunk c routed to e; and the padding fill of FILL rows."""
    c = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1)
    tl.store(counts_ptr + c * E_PAD + experts, tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0))
    fill = c * FILL + tl.arange(0, FILL)
    tl.store(slots_ptr + fill, num_slots, mask=fill < rows)


@triton.jit
def _chunk_offsets_kernel(counts_ptr, start_ptr, block_expert_ptr, num_chunks, num_experts, num_blocks,
                          BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CH: tl.constexpr):
    """One program: counts[c, e] -> the pairs of e in the chunks before c (in place); each expert's
    padded group start; the blocks' owners."""
    experts = tl.arange(0, E_PAD)
    total = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, num_chunks, CH):
        c = start + tl.arange(0, CH)
        ptrs = counts_ptr + c[:, None] * E_PAD + experts[None, :]
        tile = tl.load(ptrs, mask=(c < num_chunks)[:, None], other=0)
        tl.store(ptrs, tl.cumsum(tile, axis=0) - tile + total[None, :], mask=(c < num_chunks)[:, None])
        total += tl.sum(tile, axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    tl.store(start_ptr + experts, padded_end - padded)
    for start in range(0, num_blocks, CH):
        b = start + tl.arange(0, CH)
        owner = tl.sum((padded_end[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.minimum(owner, num_experts), mask=b < num_blocks)


@triton.jit
def _chunk_scatter_kernel(ids_ptr, offsets_ptr, start_ptr, slots_ptr, num_slots,
                          E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Each pair's row: its expert's group start + the pairs of its expert in earlier chunks + its
    rank among the earlier pairs of its expert in this chunk (token order: a stable grouping)."""
    c = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1)
    hot = (e[:, None] == experts[None, :]).to(tl.int32)
    base = tl.load(start_ptr + experts) + tl.load(offsets_ptr + c * E_PAD + experts)
    row = tl.sum(hot * (tl.cumsum(hot, axis=0) - 1 + base[None, :]), axis=1)
    tl.store(slots_ptr + row, offs, mask=offs < num_slots)


def _align_chunked(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """align_by_expert's result (the same rows, bit for bit) in three Triton launches over chunks of
    pairs: per-chunk counts (+ the padding fill), one program for the prefix over chunks and the
    groups' starts and owners, then the scatter. On an H200: 13 us at 512-2048 pairs, 26 at 16k,
    87 at 64k, 151 at 128k (the one-program prefix over chunks grows with them), where torch's ~20
    ops took 73-79 us, 131, 141 and 162."""
    n = ids.numel()
    e_pad = triton.next_power_of_2(num_experts)
    chunk = max(16, min(256, 8192 // e_pad))
    chunks = triton.cdiv(n, chunk)
    blocks = max_blocks(n, num_experts, block_m)
    rows = blocks * block_m
    slots = torch.empty(rows, dtype=torch.int32, device=ids.device)
    owners = torch.empty(blocks, dtype=torch.int32, device=ids.device)
    counts = torch.empty(chunks, e_pad, dtype=torch.int32, device=ids.device)
    starts = torch.empty(e_pad, dtype=torch.int32, device=ids.device)
    ids = ids.contiguous()
    _chunk_counts_kernel[(chunks,)](ids, counts, slots, n, rows, E_PAD=e_pad, CHUNK=chunk,
                                    FILL=triton.next_power_of_2(triton.cdiv(rows, chunks)), num_warps=4)
    _chunk_offsets_kernel[(1,)](counts, starts, owners, chunks, num_experts, blocks, BLOCK_M=block_m, E_PAD=e_pad,
                                CH=max(16, 8192 // e_pad), num_warps=8)
    _chunk_scatter_kernel[(chunks,)](ids, counts, starts, slots, n, E_PAD=e_pad, CHUNK=chunk, num_warps=4)
    return ExpertBlocks(slots, owners, block_m, n, num_experts)


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """align_by_expert's result: one Triton program up to ONE_PROGRAM_ALIGN_MAX_PAIRS pairs, three
    launches over chunks of pairs above."""
    if ids.numel() > ONE_PROGRAM_ALIGN_MAX_PAIRS:
        return _align_chunked(ids, num_experts, block_m)
    return _align_one_program(ids, num_experts, block_m)


def _align_one_program(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    n = ids.numel()
    blocks = max_blocks(n, num_experts, block_m)
    slots = torch.empty(blocks * block_m, dtype=torch.int32, device=ids.device)
    owners = torch.empty(blocks, dtype=torch.int32, device=ids.device)
    e_pad = triton.next_power_of_2(num_experts)
    _align_kernel[(1,)](ids.contiguous(), slots, owners, n, num_experts, blocks, BLOCK_M=block_m, E_PAD=e_pad,
                        CHUNK=max(16, 8192 // e_pad), num_warps=4)
    return ExpertBlocks(slots, owners, block_m, n, num_experts)


@triton.jit
def _route_kernel(logits_ptr, ids_ptr, weights_ptr, E, stride_l, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                  E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr):
    """One token's gating (LayerOps.moe_route's): the softmax over its E logits in float32, the top-k
    picked one at a time (the largest left, the lowest expert on a tie), renormalised to sum 1."""
    t = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, E_PAD)
    x = tl.load(logits_ptr + t * stride_l + experts, mask=experts < E, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    probs = p / tl.sum(p, axis=0)
    left = tl.where(experts < E, probs, -1.0)
    picks = tl.arange(0, K_PAD)
    chosen = tl.zeros([K_PAD], dtype=tl.int64)
    weights = tl.zeros([K_PAD], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(left, axis=0)
        e = tl.min(tl.where(left == best, experts, E_PAD), axis=0)
        chosen = tl.where(picks == j, e, chosen)
        weights = tl.where(picks == j, best, weights)
        left = tl.where(experts == e, -1.0, left)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)
    tl.store(ids_ptr + t * TOP_K + picks, chosen, mask=picks < TOP_K)
    tl.store(weights_ptr + t * TOP_K + picks, weights, mask=picks < TOP_K)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """LayerOps.moe_route in one launch (softmax, top-k and renormalisation in one program a token,
    where torch takes six kernels): (expert ids [T, k] int64, weights [T, k] float32)."""
    t, e = router_logits.shape
    ids = torch.empty(t, top_k, dtype=torch.int64, device=router_logits.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=router_logits.device)
    if t:
        _route_kernel[(t,)](router_logits, ids, weights, e, router_logits.stride(0), TOP_K=top_k,
                            K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(e), RENORMALIZE=renormalize, num_warps=4)
    return ids, weights
