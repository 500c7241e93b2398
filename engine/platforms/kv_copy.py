"""A KV transfer's blocks copied out of the paged cache or into it, plain torch (every platform's
default; CUDA's takes the sums in the copy's own pass: triton_kernels/kv_pack.py), and the word sums
the transfer's checksum is built from (engine/runner/kv_checksum.py)."""
from __future__ import annotations

import torch


def pack(kv: torch.Tensor, index: torch.Tensor, sums: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    data = kv.index_select(2, index).reshape(-1).view(torch.uint8)
    return data, (word_sums(data, kv.shape[0] * kv.shape[1], index.numel()) if sums else None)


def unpack(kv: torch.Tensor, index: torch.Tensor, data: torch.Tensor, sums: bool) -> torch.Tensor | None:
    rows, n = kv.shape[0] * kv.shape[1], index.numel()
    total = word_sums(data, rows, n) if sums else None
    target = kv.view(torch.uint8) if kv.element_size() == 1 else kv    # (float8: no index_copy_ kernel everywhere)
    target.index_copy_(2, index, data.view(target.dtype).view(*kv.shape[:2], n, *kv.shape[3:]))
    return total


def word_sums(data: torch.Tensor, rows: int, num_blocks: int) -> torch.Tensor:
    """int64 [rows, num_blocks]: the sum (wrapping) of each (row, block)'s 8-byte words of a packed KV
    payload (a uint8 tensor [rows, num_blocks, ...] flattened), or of its bytes where a row is not
    whole words, on data's device, queued there."""
    data = data.reshape(-1)
    if num_blocks < 1 or rows < 1 or data.numel() % (rows * num_blocks):
        raise ValueError(f"{data.numel()} bytes are not {num_blocks} blocks of {rows} rows")
    if (data.numel() // (rows * num_blocks)) % 8 == 0:
        try:
            data = data.view(torch.int64)
        except RuntimeError:            # an unaligned view (a slice of a larger buffer): copy it once
            data = data.clone().view(torch.int64)
    return data.view(rows, num_blocks, -1).sum(-1, dtype=torch.int64)
