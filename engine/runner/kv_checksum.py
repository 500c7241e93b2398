"""The checksum a KV transfer carries (engine/kv_proof.py): computed where the bytes are, on the
device, as the prefill packs them, and again where they land, before a token is decoded from them.

Packed blocks are [rows = layers x (K, V), blocks, row bytes]. The checksum is two int64 sums,
exact on any device in any order (wrapping integer addition): A, every 8-byte word of the payload
summed; B, each (row, block)'s word sum weighted by its place in the whole transfer. A single
flipped byte always changes A; a block landed in another's place, or rows swapped, change B. Both
are additive over pieces, so the prefill sums its pieces' parts (on the device, no host sync) and
the decode side checks the payload however it came split, or the blocks it was written into.
The engine's checksums are taken by the copies that pack and unpack the blocks (Platform.pack_kv /
unpack_kv; the arithmetic is engine/platforms/kv_copy.py's): on CUDA in the copy's own pass, so the
bytes are read once; elsewhere by one more read. The functions here are the torch path's, for
payloads and blocks no copy touches. What it costs: benchmarks/kv_checksum.py.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from baton.engine.platforms.kv_copy import weigh, word_sums
from baton.engine.runner.kv_blocks import Pieces, _as_uint8, _block_index

MASK = (1 << 64) - 1


@dataclass(slots=True)
class Proof:
    """A prefill's running checksum through one piece: `total` on the device (the next piece adds
    to it there), `host` its copy, final once `ready` has passed (None: final already)."""

    total: torch.Tensor
    host: torch.Tensor
    ready: object | None = None

    def done(self) -> bool:
        """Has the device finished it (reading it waits for nothing)?"""
        return self.ready is None or self.ready.query()

    def hex(self) -> str:
        """The checksum as the transfer's meta carries it; waits for the device (call it off the
        event loop)."""
        if self.ready is not None:
            self.ready.synchronize()
        return to_hex(self.host)


def partial(data: torch.Tensor, rows: int, num_blocks: int, first_block: int = 0) -> torch.Tensor:
    """int64 [A, B] of packed blocks [first_block, first_block + num_blocks) of a transfer (a uint8
    payload of `rows` = 2 x layers rows), on data's device, queued there (no host sync)."""
    return weigh(word_sums(data, rows, num_blocks), first_block)


def of_payload(payload, rows: int, num_blocks: int, device: torch.device | None = None) -> torch.Tensor:
    """The checksum of a landed payload (bytes-like, a uint8 tensor, or `Pieces`), on its device
    (a host payload: on `device` when given, copied there first)."""
    if isinstance(payload, Pieces):
        return sum(_at(data, rows, n, first, device) for first, n, data in payload.parts)
    return _at(payload, rows, num_blocks, 0, device)


def of_blocks(kv: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
    """The checksum of blocks `block_ids` of the paged cache `kv`, as if packed in that order: the
    blocks' words gathered as whole rows (a cache's block dimension is not its first)."""
    index = _block_index(kv, block_ids)
    rows, num_blocks = kv.shape[0] * kv.shape[1], kv.shape[2]
    data = kv.reshape(-1).view(torch.uint8)
    words = _words(data, data.numel() // (rows * num_blocks)).view(rows, num_blocks, -1)
    return weigh(words.index_select(1, index).sum(-1, dtype=torch.int64), 0)


def to_hex(total: torch.Tensor) -> str:
    a, b = (int(v) & MASK for v in total.tolist())
    return f"{a:016x}{b:016x}"


def _at(data, rows: int, num_blocks: int, first_block: int, device: torch.device | None) -> torch.Tensor:
    data = _as_uint8(data)
    if device is not None and data.device != device:
        data = data.to(device)
    return partial(data, rows, num_blocks, first_block)


def _words(data: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """The payload as int64 words where its rows are whole words (every real layout), else bytes."""
    if row_bytes % 8:
        return data
    try:
        return data.view(torch.int64)
    except RuntimeError:            # an unaligned view (a slice of a larger buffer): copy it once
        return data.clone().view(torch.int64)
