"""A KV transfer's blocks packed out of the paged cache, or unpacked into it, with the checksum's
word sums taken in the same pass (engine/runner/kv_checksum.py): the bytes are read once, where a
copy and then a checksum read them twice.

The cache [layers, 2, blocks, block_size, kv_heads, head_dim] is seen as int64 words
[rows = layers x 2, blocks, W], so one (row, block) is W contiguous words; a payload is the same
[rows, n, W] with the transfer's n blocks in order. One program per (row, block of the transfer):
it copies its W words in chunks of CHUNK, adds them (wrapping int64, as torch's sum does, so the
sums equal the torch path's bit for bit) and stores the one sum. Indices are int64: a cache may
hold more than 2^31 words.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _pack_kernel(cache_ptr, out_ptr, index_ptr, sums_ptr, n, cache_blocks,
                 W: tl.constexpr, CHUNK: tl.constexpr, UNPACK: tl.constexpr, SUMS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    row = pid // n
    block = tl.load(index_ptr + pid % n).to(tl.int64)
    in_cache = (row * cache_blocks + block) * W
    in_payload = pid * W
    acc = tl.zeros([CHUNK], dtype=tl.int64)
    for start in range(0, W, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < W
        if UNPACK:
            words = tl.load(out_ptr + in_payload + offs, mask=mask, other=0)
            tl.store(cache_ptr + in_cache + offs, words, mask=mask)
        else:
            words = tl.load(cache_ptr + in_cache + offs, mask=mask, other=0)
            tl.store(out_ptr + in_payload + offs, words, mask=mask)
        if SUMS:
            acc += words
    if SUMS:
        tl.store(sums_ptr + pid, tl.sum(acc, axis=0))


def supported(kv: torch.Tensor) -> bool:
    """Can this cache be seen as whole int64 words per (row, block)?"""
    row_bytes = kv[0, 0, 0].numel() * kv.element_size()
    return kv.is_contiguous() and row_bytes % 8 == 0 and kv.data_ptr() % 8 == 0


def pack(kv: torch.Tensor, index: torch.Tensor, sums: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(kv[:, :, index] contiguous as uint8, and with `sums` the int64 word sum of each (row, block)
    [rows, n]), in one launch on the current stream."""
    words, rows, w = _words(kv)
    n = index.numel()
    out = torch.empty(rows * n * w, dtype=torch.int64, device=kv.device)
    total = torch.empty(rows, n, dtype=torch.int64, device=kv.device) if sums else out
    _launch(words, out, index, total, rows, n, w, unpack=False, sums=sums)
    return out.view(torch.uint8), (total if sums else None)


def unpack(kv: torch.Tensor, index: torch.Tensor, data: torch.Tensor, sums: bool) -> torch.Tensor | None:
    """Write the uint8 payload `data` ([rows, n, W] words) into blocks `index` of kv; with `sums`,
    the payload's word sums [rows, n], taken as it is copied."""
    words, rows, w = _words(kv)
    n = index.numel()
    payload = data.view(torch.int64)
    if payload.numel() != rows * n * w:
        raise ValueError(f"a payload of {data.numel()} bytes is not {n} blocks of {rows} rows of {w * 8} bytes")
    total = torch.empty(rows, n, dtype=torch.int64, device=kv.device) if sums else payload
    _launch(words, payload, index, total, rows, n, w, unpack=True, sums=sums)
    return total if sums else None


def _words(kv: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    rows, w = kv.shape[0] * kv.shape[1], kv[0, 0, 0].numel() * kv.element_size() // 8
    return kv.view(-1).view(torch.uint8).view(torch.int64), rows, w


def _launch(cache, payload, index, total, rows: int, n: int, w: int, unpack: bool, sums: bool) -> None:
    """`total` receives the sums (any int64 tensor when not `sums`: the kernel does not touch it)."""
    if rows * n == 0:
        return
    chunk = min(1024, triton.next_power_of_2(w))
    _pack_kernel[(rows * n,)](cache, payload, index, total, n, cache.numel() // (rows * w), W=w, CHUNK=chunk,
                              UNPACK=unpack, SUMS=sums, num_warps=4)
