"""A KV transfer's blocks copied out of the paged cache or into it, plain torch (every platform's
default; CUDA's copy takes the checksum in its own pass: triton_kernels/kv_pack.py), and the
checksum's arithmetic both follow (engine/runner/kv_checksum.py says what it proves).

Packed blocks are [rows = layers x (K, V), blocks, row bytes]. The checksum is int64 [A, B], sums
that wrap: A, every 8-byte word of the payload; B, each (row, block)'s word sum times its place,
(row << 32) + the block's number in the transfer, counted from 1.
"""
from __future__ import annotations

import functools

import torch


def pack(kv: torch.Tensor, index: torch.Tensor, checksum: torch.Tensor | None, first_block: int) -> torch.Tensor:
    data = kv.index_select(2, index).reshape(-1).view(torch.uint8)
    if checksum is not None:
        checksum += weigh(word_sums(data, kv.shape[0] * kv.shape[1], index.numel()), first_block)
    return data


def unpack(kv: torch.Tensor, index: torch.Tensor, data: torch.Tensor, checksum: torch.Tensor | None,
           first_block: int) -> None:
    n = index.numel()
    if checksum is not None:
        checksum += weigh(word_sums(data, kv.shape[0] * kv.shape[1], n), first_block)
    target = kv.view(torch.uint8) if kv.element_size() == 1 else kv    # (float8: no index_copy_ kernel everywhere)
    target.index_copy_(2, index, data.view(target.dtype).view(*kv.shape[:2], n, *kv.shape[3:]))


def word_sums(data: torch.Tensor, rows: int, num_blocks: int) -> torch.Tensor:
    """int64 [rows, num_blocks]: the sum of each (row, block)'s 8-byte words of a packed payload (a
    uint8 tensor, flattened), or of its bytes where a row is not whole words, queued on its device."""
    data = data.reshape(-1)
    if num_blocks < 1 or rows < 1 or data.numel() % (rows * num_blocks):
        raise ValueError(f"{data.numel()} bytes are not {num_blocks} blocks of {rows} rows")
    if (data.numel() // (rows * num_blocks)) % 8 == 0:
        try:
            data = data.view(torch.int64)
        except RuntimeError:            # an unaligned view (a slice of a larger buffer): copy it once
            data = data.clone().view(torch.int64)
    return data.view(rows, num_blocks, -1).sum(-1, dtype=torch.int64)


def weigh(sums: torch.Tensor, first_block: int) -> torch.Tensor:
    """[A, B] from the word sums [rows, n] of blocks first_block, first_block + 1, ... of a transfer."""
    return (sums * _weights(*sums.shape, first_block, sums.device)).sum((1, 2))


@functools.lru_cache(maxsize=32)
def _weights(rows: int, num_blocks: int, first_block: int, device: torch.device) -> torch.Tensor:
    """[2, rows, num_blocks]: ones (A), and each (row, block)'s place in the transfer (B)."""
    place = (torch.arange(rows, dtype=torch.int64, device=device) << 32)[:, None] \
        + torch.arange(first_block + 1, first_block + num_blocks + 1, dtype=torch.int64, device=device)
    return torch.stack((torch.ones_like(place), place))
