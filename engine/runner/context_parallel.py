"""Context parallelism (--context-parallel-size N): one prefill step's tokens split across N ranks.

Every rank holds the full weights and a full, identical copy of the paged KV cache (the ranks are the
tensor-parallel machinery's processes, engine/runner/tensor_parallel.py: rank 0 owns the scheduler and
sends every step's host inputs to the others, which run the same step in lockstep).

A prefill step (no decode rows, no images, at least CP_MIN_TOKENS tokens) is sharded: each sequence's
new tokens are cut into 2N near-equal pieces and rank r takes pieces r and 2N-1-r ("zigzag"). Under a
causal mask a later piece attends to more keys, so pairing the i-th earliest piece with the i-th latest
gives every rank the same attention work whatever the chunk's offset into its prompt (a contiguous
split would leave the last rank up to (2N-1)x the first's on a prompt's first chunk). Each rank runs
embeddings, the QKV and MLP projections and the norms for its pieces only. In each attention layer
(`ShardContext.attend_now`) the ranks all-gather the step's K and V (one collective per layer: K and
V together, padded to the longest shard), every rank writes all of them into its cache at their
slots (every cache stays complete: rank 0's is what decode and the KV hand-off read), and each rank
attends its queries to the cache: a piece of sequence s spanning new tokens [a, b) after c cached ones
is a chunked prefill of b - a queries over c + b keys, which every platform's prefill attention
already computes (bottom-right causal alignment), so no new kernel is involved. The final hidden
states are all-gathered back into the step's row order, so logits, prompt logprobs and sampling on
rank 0 read the step exactly as without CP.

Everything else (decode steps, mixed steps with decode rows, multimodal prefills, steps shorter than
CP_MIN_TOKENS) runs replicated: every rank runs the whole step on the same inputs, with identical
weights and caches, so their caches stay identical; only rank 0 samples. That keeps decode graphs
(captured per rank, with no collective inside) working unchanged, and costs the other ranks only idle
device time. This is all-gather attention rather than ring attention: a step's K/V (one chunk of the
scheduler's token budget) is small next to the attention over the whole context it joins, and a
full cache on every rank is what lets later chunks and decode read any earlier token without
communication.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from baton.engine.runner.staging import HostUpload
from baton.models.attention_metadata import AttnMetadata
from baton.models.forward_context import ForwardContext

CP_MIN_TOKENS = 16        # shorter prefill steps run replicated (the per-layer collectives would dominate)


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """This rank's share of one prefill step, on the host: its step rows (in step order within each
    piece), one attention row per piece (query starts over the shard, keys up to the piece's end,
    its sequence's block table), and where each step row lands in the all-gathered buffer."""
    rows: np.ndarray            # [t] int64: step rows this rank computes
    query_starts: np.ndarray    # [P+1] int32
    seq_lens: np.ndarray        # [P] int32: cached context + new tokens up to the piece's end
    tables: np.ndarray          # [P, W] int32
    max_query_len: int
    pad: int                    # the longest shard: every rank's slot in the gathered buffer
    order: np.ndarray           # [T] int64: step row i is gathered row order[i]
    gathered_slots: np.ndarray  # [N * pad] int64: the KV slot of every gathered row (-1: padding)


def zigzag_pieces(num_new: int, world: int, rank: int) -> list[tuple[int, int]]:
    """[start, end) of this rank's two pieces of a sequence's `num_new` new tokens (empty ones left out)."""
    cuts = [num_new * i // (2 * world) for i in range(2 * world + 1)]
    pieces = [(cuts[rank], cuts[rank + 1]), (cuts[2 * world - 1 - rank], cuts[2 * world - rank])]
    return [(a, b) for a, b in pieces if b > a]


def plan_step(inputs, world: int, rank: int) -> ShardPlan | None:
    """This rank's share of the step (StepInputs), or None where the step runs replicated."""
    if (inputs.is_decode or inputs.num_decode_rows or inputs.mrope_positions is not None or inputs.draft is not None
            or len(inputs.input_ids) < CP_MIN_TOKENS):
        return None
    starts, lens = inputs.query_starts, inputs.seq_lens
    if int(starts[-1]) != len(inputs.input_ids):      # rows outside every sequence (padding): not planned for
        return None
    owned: list[list[int]] = []                        # per rank: its step rows
    mine_pieces: list[tuple[int, int, int, int]] = []  # (sequence, first step row, rows, keys) of this rank
    for r in range(world):
        rows: list[int] = []
        for s in range(len(lens)):
            q0, num_new = int(starts[s]), int(starts[s + 1] - starts[s])
            context = int(lens[s]) - num_new
            for a, b in zigzag_pieces(num_new, world, r):
                rows.extend(range(q0 + a, q0 + b))
                if r == rank:
                    mine_pieces.append((s, q0 + a, b - a, context + b))
        if not rows:                                   # a rank with nothing to do: not worth sharding
            return None
        owned.append(rows)
    pad = max(len(rows) for rows in owned)
    order = np.empty(len(inputs.input_ids), dtype=np.int64)
    gathered_slots = np.full(world * pad, -1, dtype=np.int64)
    for r, rows in enumerate(owned):
        at = r * pad + np.arange(len(rows))
        order[rows] = at
        gathered_slots[at] = inputs.slots[rows]
    counts = [n for _, _, n, _ in mine_pieces]
    return ShardPlan(
        rows=np.asarray(owned[rank], dtype=np.int64),
        query_starts=np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
        seq_lens=np.asarray([keys for *_, keys in mine_pieces], dtype=np.int32),
        tables=inputs.block_tables[[s for s, *_ in mine_pieces]], max_query_len=max(counts), pad=pad,
        order=order, gathered_slots=gathered_slots)


@dataclass(slots=True)
class ShardContext(ForwardContext):
    """A sharded step's forward context: `meta` is this rank's pieces (attending from the cache);
    each attention layer first gathers the step's K/V from every rank into every rank's cache."""
    gather: ContextParallel | None = None
    gathered_slots: torch.Tensor | None = None

    def attend_now(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.kv_caches[layer_idx]
        kv_scale = None if self.kv_scales is None else self.kv_scales[layer_idx]
        both = self.gather.all_gather(torch.stack((k, v), dim=1))       # [N * pad, 2, Hkv, D]
        self.platform.store_kv(both[:, 0], both[:, 1], k_cache, v_cache, self.gathered_slots, kv_scale)
        return self.platform.prefill_attention(q, k, v, k_cache, v_cache, self.meta, self.scale, kv_scale)


def fingerprint(model: torch.nn.Module) -> torch.Tensor:
    """A float64 sum over a strided sample of every parameter (the same weights: the same value)."""
    sums = [p.detach().flatten()[::max(1, p.numel() // 4096)].double().sum() for p in model.parameters()]
    return torch.stack(sums).sum().reshape(1)


class ContextParallel:
    """One rank's side of context parallelism: plans each step's shard and runs the model on it.
    Built on every rank at the same point of start-up: it checks that the ranks loaded the same weights."""

    def __init__(self, world: int, rank: int, group, device: torch.device, model: torch.nn.Module):
        self.world, self.rank, self.group = world, rank, group
        self.backend = dist.get_backend(group)
        self.upload = HostUpload(device)               # (its own staging buffers: the step's are in use)
        self.pad = 1
        prints = self.all_gather(fingerprint(model)).tolist()
        if len(set(prints)) != 1:
            raise RuntimeError(f"context-parallel ranks loaded different weights (fingerprints {prints}); every "
                               "rank must load the same checkpoint, dtype and quantization")
        self.pad = 0

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` (this rank's first rows, zero-padded to the plan's `pad`), stacked by rank."""
        if x.shape[0] < self.pad:
            x = torch.cat([x, x.new_zeros(self.pad - x.shape[0], *x.shape[1:])])
        out = x.new_empty(self.world * self.pad, *x.shape[1:])
        if self.backend == "gloo":                     # (gloo has no all_gather_into_tensor)
            dist.all_gather(list(out.chunk(self.world)), x.contiguous(), group=self.group)
        else:
            dist.all_gather_into_tensor(out, x.contiguous(), group=self.group)
        return out

    def forward(self, model, forward, inputs, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The step's final hidden states [T, H] in step order on every rank, computed sharded; None
        where the step is to run replicated."""
        plan = plan_step(inputs, self.world, self.rank)
        if plan is None:
            return None
        rows, starts, lens, tables, order, slots = self.upload(
            plan.rows, plan.query_starts, plan.seq_lens, plan.tables, plan.order, plan.gathered_slots)
        seq_lens = plan.seq_lens.tolist()
        meta = AttnMetadata(is_decode=False, slot_mapping=slots, query_start_loc=starts, seq_lens=lens,
                            block_tables=tables, max_query_len=plan.max_query_len, max_seq_len=max(seq_lens),
                            has_context=True, query_start_loc_cpu=plan.query_starts.tolist(),
                            seq_lens_cpu=seq_lens)
        ctx = ShardContext(meta, forward.kv_caches, forward.attention, forward.scale, forward.kv_scales,
                           gather=self, gathered_slots=slots)
        self.pad = plan.pad
        hidden = model(input_ids.index_select(0, rows), positions.index_select(0, rows), ctx)
        return self.all_gather(hidden).index_select(0, order)
