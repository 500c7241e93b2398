"""A KV transfer's blocks packed out of the paged cache, or unpacked into it, with the transfer's
checksum taken in the same pass (engine/platforms/kv_copy.py defines it, engine/runner/
kv_checksum.py says what it proves): the bytes are read once, where a copy and then a checksum
read them twice, and no launch is added.

The cache [layers, 2, blocks, block_size, kv_heads, head_dim] is seen as int64 words
[rows = layers x 2, blocks, W], so one (row, block) is W contiguous words; a payload is the same
[rows, n, W] with the transfer's n blocks in order. A program takes PER consecutive (row, block)
pairs of the transfer: it copies each one's W words in chunks of CHUNK, adds them up (wrapping
int64, as torch's sum does), and at the end adds its share of A and B (each pair's sum times its
place) to the checksum [A, B] with two atomic adds. Integer
addition wraps and commutes, so the result is the torch path's, bit for bit, in any order.
Indices are int64: a cache may hold more than 2^31 words.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _pack_kernel(cache_ptr, payload_ptr, index_ptr, checksum_ptr, n, pairs, cache_blocks, first_block,
                 W: tl.constexpr, CHUNK: tl.constexpr, PER: tl.constexpr, UNPACK: tl.constexpr,
                 CHECKSUM: tl.constexpr):
    a = tl.zeros([CHUNK], dtype=tl.int64)     # this program's share of A and B, per lane until the end
    b = tl.zeros([CHUNK], dtype=tl.int64)
    for k in range(PER):                      # PER consecutive (row, block) pairs: fewer atomics at the end
        pair = tl.program_id(0).to(tl.int64) * PER + k
        limit = tl.where(pair < pairs, W, 0)            # a pair past the last moves no word
        row, j = pair // n, pair % n
        block = tl.load(index_ptr + j).to(tl.int64)          # (j < n even past the last pair)
        in_cache = (row * cache_blocks + block) * W
        in_payload = pair * W
        acc = tl.zeros([CHUNK], dtype=tl.int64)
        for start in range(0, W, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            mask = offs < limit
            if UNPACK:
                words = tl.load(payload_ptr + in_payload + offs, mask=mask, other=0)
                tl.store(cache_ptr + in_cache + offs, words, mask=mask)
            else:
                words = tl.load(cache_ptr + in_cache + offs, mask=mask, other=0)
                tl.store(payload_ptr + in_payload + offs, words, mask=mask)
            if CHECKSUM:
                acc += words
        if CHECKSUM:
            a += acc
            b += acc * ((row << 32) + first_block + j + 1)     # (masked lanes and pairs add zeros)
    if CHECKSUM:
        tl.atomic_add(checksum_ptr, tl.sum(a, axis=0), sem="relaxed")
        tl.atomic_add(checksum_ptr + 1, tl.sum(b, axis=0), sem="relaxed")


def supported(kv: torch.Tensor) -> bool:
    """Can this cache be seen as whole int64 words per (row, block)?"""
    row_bytes = kv[0, 0, 0].numel() * kv.element_size()
    return kv.is_contiguous() and row_bytes % 8 == 0 and kv.data_ptr() % 8 == 0


def pack(kv: torch.Tensor, index: torch.Tensor, checksum: torch.Tensor | None, first_block: int) -> torch.Tensor:
    """kv[:, :, index] contiguous as uint8, in one launch on the current stream; with `checksum`
    (int64 [2] on kv's device), these blocks' checksum as blocks first_block, ... added to it."""
    words, rows, w = _words(kv)
    out = torch.empty(rows * index.numel() * w, dtype=torch.int64, device=kv.device)
    _launch(words, out, index, checksum, first_block, rows, w, unpack=False)
    return out.view(torch.uint8)


def unpack(kv: torch.Tensor, index: torch.Tensor, data: torch.Tensor, checksum: torch.Tensor | None,
           first_block: int) -> None:
    """Write the uint8 payload `data` ([rows, n, W] words) into blocks `index` of kv, in one launch;
    with `checksum`, the payload's checksum added to it as it is copied."""
    words, rows, w = _words(kv)
    payload = data.view(torch.int64)
    if payload.numel() != rows * index.numel() * w:
        raise ValueError(f"a payload of {data.numel()} bytes is not {index.numel()} blocks of {rows} rows "
                         f"of {w * 8} bytes")
    _launch(words, payload, index, checksum, first_block, rows, w, unpack=True)


def _words(kv: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    rows, w = kv.shape[0] * kv.shape[1], kv[0, 0, 0].numel() * kv.element_size() // 8
    return kv.view(-1).view(torch.uint8).view(torch.int64), rows, w


def _launch(cache, payload, index, checksum, first_block: int, rows: int, w: int, unpack: bool) -> None:
    n = index.numel()
    pairs = rows * n
    if pairs == 0:
        return
    if checksum is not None and (checksum.dtype != torch.int64 or checksum.numel() != 2):
        raise ValueError(f"a checksum is int64 [2], got {checksum.dtype} {tuple(checksum.shape)}")
    # pairs a program: at least ~1,000 programs (to fill the device), at most 16 (every program ends in two
    # atomic adds to the same two words, which the device serializes: 9,216 programs cost ~13 us at 288 MiB)
    per = min(16, triton.next_power_of_2(max(1, pairs // 2048)))
    _pack_kernel[(triton.cdiv(pairs, per),)](
        cache, payload, index, payload if checksum is None else checksum, n, pairs, cache.numel() // (rows * w),
        first_block, W=w, CHUNK=min(1024, triton.next_power_of_2(w)), PER=per, UNPACK=unpack,
        CHECKSUM=checksum is not None, num_warps=4)
