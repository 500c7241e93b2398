"""A request's KV blocks <-> one contiguous byte payload.

The payload of `block_ids` is `kv[:, :, block_ids]` of the paged cache
[layers, 2, num_blocks, block_size, kv_heads, head_dim], contiguous, viewed as uint8: the
prefill side packs it on the host (through pinned memory from an accelerator), the decode
side unpacks it into the blocks it reserved. A device-direct transfer may arrive as `Pieces`:
consecutive block ranges, each packed on its own as the prefill computed them.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

KV_DIMS = 6     # [layers, 2, num_blocks, block_size, kv_heads, head_dim]


def payload_shape(kv: torch.Tensor, n_blocks: int) -> tuple[int, ...]:
    return (kv.shape[0], kv.shape[1], n_blocks, *kv.shape[3:])


def payload_nbytes(kv: torch.Tensor, n_blocks: int) -> int:
    return n_blocks * kv[:, :, :1].numel() * kv.element_size()


def pack_blocks(kv: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
    """Copy blocks `block_ids` of `kv` into a contiguous host uint8 tensor, in that order."""
    index = _block_index(kv, block_ids)
    gathered = kv.index_select(2, index)             # contiguous, on kv's device
    if gathered.device.type != "cpu":
        host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=can_pin())
        host.copy_(gathered)                          # waits for the device: bytes are final on return
        gathered = host
    return gathered.reshape(-1).view(torch.uint8)


def pack_blocks_on_device(kv: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
    """Like pack_blocks, but the contiguous copy stays on kv's device (device-direct backends),
    ordered on the calling thread's current stream: consume it on that same stream."""
    return kv.index_select(2, _block_index(kv, block_ids)).reshape(-1).view(torch.uint8)


@dataclass(frozen=True, slots=True)
class Pieces:
    """A payload in parts: `parts[i] = (first_block, num_blocks, data)`, where data holds blocks
    [first_block, first_block + num_blocks) of the transfer packed on their own; the parts
    cover the transfer's blocks in order."""

    parts: tuple[tuple[int, int, object], ...]

    def __len__(self) -> int:
        """Bytes in all, like a payload's len()."""
        return sum(len(data) for _, _, data in self.parts)


def unpack_blocks(kv: torch.Tensor, block_ids: Sequence[int], payload) -> None:
    """Write a payload (bytes-like or uint8 tensor from `pack_blocks`, or `Pieces` of them)
    into blocks `block_ids` of `kv`."""
    if isinstance(payload, Pieces):
        for first, n, data in parts_of(payload, len(block_ids)):
            unpack_blocks(kv, block_ids[first:first + n], data)
        return
    index = _block_index(kv, block_ids)
    if len(set(block_ids)) != len(block_ids):
        raise ValueError(f"block ids must be distinct to unpack into, got {list(block_ids)}")
    data = _as_uint8(payload)
    expected = payload_nbytes(kv, len(block_ids))
    if data.numel() != expected:
        raise ValueError(f"KV payload has {data.numel()} bytes but {len(block_ids)} blocks of "
                         f"{tuple(kv.shape[3:])} {kv.dtype} per layer need {expected} "
                         f"({kv.shape[0]} layers x K,V): were both ends started with the same layout?")
    if kv.element_size() == 1:      # float8 has no index_copy_ kernel everywhere: copy its bytes
        kv = kv.view(torch.uint8)
    values = data.view(kv.dtype).view(payload_shape(kv, len(block_ids)))
    kv.index_copy_(2, index, values.to(kv.device))


def parts_of(payload, num_blocks: int) -> tuple[tuple[int, int, object], ...]:
    """A payload's parts, (first_block, num_blocks, data) each: a Pieces' own, checked to cover
    `num_blocks` blocks in order, or the whole payload as one."""
    if not isinstance(payload, Pieces):
        return ((0, num_blocks, payload),)
    covered = 0
    for first, n, _ in payload.parts:
        if first != covered:
            raise ValueError(f"KV pieces must cover the blocks in order: a piece starts at block {first}, "
                             f"expected {covered}")
        covered += n
    if covered != num_blocks:
        raise ValueError(f"KV pieces hold {covered} blocks, the request reserved {num_blocks}")
    return payload.parts


def _block_index(kv: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
    if kv.dim() != KV_DIMS:
        raise ValueError(f"KV cache must be [layers, 2, blocks, block_size, kv_heads, head_dim], "
                         f"got shape {tuple(kv.shape)}")
    if not kv.is_contiguous():
        raise ValueError("KV cache must be contiguous")
    num_blocks = kv.shape[2]
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"block ids {bad[:8]} are outside the cache's {num_blocks} blocks")
    index = torch.tensor(list(block_ids), dtype=torch.long)
    # non_blocking: a pageable host -> device copy is staged at once, without waiting for the
    # device's queued work (a blocking one would stall the engine thread until its step ends)
    return index if kv.device.type == "cpu" else index.to(kv.device, non_blocking=True)


def _as_uint8(payload) -> torch.Tensor:
    if isinstance(payload, torch.Tensor):
        if payload.dtype != torch.uint8:
            raise ValueError(f"a tensor payload must be a uint8 tensor, got {payload.dtype} on {payload.device}")
        return payload.reshape(-1)
    view = memoryview(payload).cast("B")
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():      # read-only buffers (bytes) are only read here
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8)


def can_pin() -> bool:
    try:
        return torch.cuda.is_available() or (hasattr(torch, "npu") and torch.npu.is_available())
    except RuntimeError:
        return False
