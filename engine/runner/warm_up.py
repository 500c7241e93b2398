"""Before serving: a dummy prompt in KV blocks no sequence owns yet, and each prefill kernel variant
run once over one (long and short prompts, with and without cached context, a full-budget step), so
JIT compiles and allocator growth happen here, not in some request's TTFT.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from baton.engine.platforms import Platform
from baton.engine.runner.forward import Forward
from baton.engine.runner.staging import HostUpload
from baton.models.attention_metadata import AttnMetadata

DummyPrompt = Callable[..., tuple[torch.Tensor, torch.Tensor, AttnMetadata]]


def dummy_prompt(upload: HostUpload, block_size: int, new: int,
                 context: int = 0) -> tuple[torch.Tensor, torch.Tensor, AttnMetadata]:
    """(ids, positions, metadata) of one prompt's `new` tokens after `context` cached ones, in the
    first blocks (identity table: slot == position), which no sequence owns before serving starts."""
    seq_len = new + context
    blocks = np.arange(-(-seq_len // block_size), dtype=np.int32)
    positions = np.arange(context, seq_len, dtype=np.int64)
    starts = np.array([0, new], np.int32)
    ids, pos, slots, starts_d, lens, tables = upload(
        np.zeros(new, np.int64), positions, positions.copy(), starts, np.array([seq_len], np.int32), blocks[None])
    return ids, pos, AttnMetadata(
        is_decode=False, slot_mapping=slots, query_start_loc=starts_d, seq_lens=lens, block_tables=tables,
        max_query_len=new, max_seq_len=seq_len, has_context=context > 0, query_start_loc_cpu=[0, new],
        seq_lens_cpu=[seq_len])


@torch.inference_mode()
def warm_up(forward: Forward, platform: Platform, prompt: DummyPrompt, capacity: int, budget: int) -> None:
    """The prompt shapes every step resembles, each once: `capacity` tokens fit in the cache (and the
    context), `budget` is the step's token budget (what one step may hold, a little below capacity)."""
    t0 = time.perf_counter()
    shapes = [(budget, 0), (16, 0), (16, 16), (min(2048, budget), 16)]
    for new, context in shapes:
        if new > 0 and new + context <= capacity:
            _dummy_prefill(forward, *prompt(new, context))
    platform.synchronize()
    if time.perf_counter() - t0 > 2:
        print(f"[baton] prefill kernels warmed up in {time.perf_counter() - t0:.1f}s", file=sys.stderr)


def _dummy_prefill(forward: Forward, ids: torch.Tensor, pos: torch.Tensor, meta: AttnMetadata) -> None:
    hidden = forward.model(ids, pos, forward.context(meta))
    forward.model.compute_logits(forward.split_aux(hidden)[0][-1:])
