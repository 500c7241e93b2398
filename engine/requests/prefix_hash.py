"""What a prefix-cache block is found by: hash(parent block's hash, its tokens), chained from the
first block. The same in every process (no per-process salt: the first block's parent is a fixed
number, not None, whose hash Python 3.11 takes from its address), so a router computes a prompt's
block hashes exactly as the workers' block managers do (engine/scheduling/block_manager.py) and
can look them up in the index their KV events build (router/prefix_index.py). A match there is a
routing hint; the block manager still verifies tokens and parent before reusing a block."""
from __future__ import annotations

from collections.abc import Sequence

ROOT = -1                   # the parent of a prompt's first block


def block_hash(parent: int | None, tokens: tuple) -> int:
    return hash((ROOT if parent is None else parent, tokens))


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of a prompt's full blocks that a prefix cache could serve (as
    BlockManager.match_prefix looks them up: at least one token is left to compute)."""
    out, parent = [], None
    for i in range((len(token_ids) - 1) // block_size):
        parent = block_hash(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        out.append(parent)
    return out
