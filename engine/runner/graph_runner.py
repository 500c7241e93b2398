"""Decode steps replayed from captured device graphs (CUDA graphs, NPU aclgraph).

One graph per batch-size bucket, all sharing one memory pool; a step of n sequences runs
the smallest bucket >= n. Padding rows are provably harmless: their slot is -1 (no KV
write), their context is one token of block 0 (valid memory), and their outputs are
dropped. Buffers are static, so a step only copies its inputs in and replays.

With an EAGLE-3 draft head (engine/runner/draft_head.py) each bucket has two more graphs, the head's pass
over the step (its full pass, and the one that writes only its KV), over the same buffers: the
step's metadata and positions, and the target graph's output (the hidden states the head reads),
plus the head's input ids. They replay after the step's tokens are drawn (the head reads them).
"""
from __future__ import annotations

import time

import torch

from baton.engine.config import EngineConfig
from baton.engine.platforms import Platform
from baton.engine.runner.forward import Forward
from baton.engine.speculation.speculative import guesses_each
from baton.models.attention_metadata import AttnMetadata
from baton.models.forward_context import ForwardContext
from baton.progress import Progress


def batch_buckets(max_num_seqs: int) -> list[int]:
    ladder = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))
    return [b for b in ladder if b < max_num_seqs] + [max_num_seqs]


# Steps with short prompt chunks run as decode rows (input_builder.py `runs_as_rows`): graphs go up to this
# many rows past --max-num-seqs, so that a few short prompts joining a full batch replay too
PROMPT_ROWS = 256


def graph_rows(config, prompt_rows: bool = True) -> int:
    """The most rows a decode graph replays: a row per running sequence, or with speculation, while
    the batch is small enough for it, a row per token verified (each sequence's last and its guesses:
    16 sequences with 8 guesses are 144 rows, which a graph of --max-num-seqs 16 would leave eager);
    and PROMPT_ROWS more (within the step's token budget) for steps with short prompt chunks, where
    the platform's graphs take them (`prompt_rows`) and neither --deterministic nor a draft head
    leaves them to the generic path."""
    rows = config.max_num_seqs
    if config.speculative_method is not None:
        rows = max(rows, *(n * (guesses_each(n, config.speculative_tokens) + 1)
                           for n in range(1, min(rows, config.speculative_max_batch) + 1)))
    if prompt_rows and not config.deterministic and config.speculative_method != "eagle3":
        rows = max(rows, min(config.max_num_seqs + PROMPT_ROWS, config.max_num_batched_tokens))
    return rows


class DecodeGraphs:
    """One token per row: decode steps, and steps verifying guesses or with short prompt chunks,
    which run as decode steps of one row per token (engine/runner/input_builder.py `row_inputs`). `drafts`:
    an EAGLE-3 head (engine/runner/draft_head.py), whose passes are captured too."""

    def __init__(self, forward: Forward, platform: Platform, config: EngineConfig, max_model_len: int,
                 drafts=None):
        self.forward = forward
        self.platform = platform
        self.drafts = drafts
        self.max_model_len = max_model_len
        self.buckets = batch_buckets(graph_rows(config, platform.graphs_take_prompt_rows))
        self.max_bs = self.buckets[-1]
        dev = platform.device
        max_blocks = (max_model_len + config.block_size - 1) // config.block_size
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((self.max_bs,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(self.max_bs, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(self.max_bs, max_blocks, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(self.max_bs + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # the draft head's: its input ids, its two graphs per bucket (keyed (bucket, full)) and their outputs
        self.head_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=dev) if drafts is not None else None
        self.head_graphs: dict[tuple[int, bool], tuple[object, torch.Tensor | None]] = {}
        self._last: tuple[int, AttnMetadata] | None = None      # the bucket and metadata of the last replay
        self._capture()

    def can_run(self, n: int) -> bool:
        return n <= self.max_bs

    def _meta(self, bs: int) -> AttnMetadata:
        return AttnMetadata(
            is_decode=True, slot_mapping=self.slot_mapping[:bs], query_start_loc=self.query_start_loc[:bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs], max_query_len=1,
            max_seq_len=self.max_model_len, has_context=True,
            query_start_loc_cpu=list(range(bs + 1)), seq_lens_cpu=[1] * bs, num_decode_rows=bs)

    @torch.inference_mode()
    def _capture(self) -> None:
        t0 = time.perf_counter()
        pool = None
        model = self.forward.model
        progress = Progress("capturing decode graphs", len(self.buckets))
        for i, bs in enumerate(reversed(self.buckets)):        # largest first: it sizes the pool
            ctx = self.forward.context(self._meta(bs))
            args = (self.input_ids[:bs], self.positions[:bs], ctx)
            model(*args)                                       # warm-up: kernels compiled, workspaces sized
            self.platform.synchronize()
            graph, self.outputs[bs] = self.platform.capture_graph(lambda a=args: model(*a), pool)
            pool = graph.pool()
            self.graphs[bs] = graph
            if self.drafts is not None:
                self._capture_head(bs, ctx, pool)
            progress.update(i + 1)
        self.platform.synchronize()
        progress.done(f"captured {len(self.buckets)} decode graphs (batch 1..{self.max_bs}) "
                      f"in {time.perf_counter() - t0:.1f}s")

    def _capture_head(self, bs: int, ctx: ForwardContext, pool) -> None:
        drafts = self.drafts
        aux = self.forward.split_aux(self.outputs[bs])[1]
        for full in (True, False):
            args = (self.head_ids[:bs], self.positions[:bs], aux, ctx, full)
            drafts.run_pass(*args)                             # warm-up (slots are -1: nothing written)
            self.platform.synchronize()
            self.head_graphs[bs, full] = self.platform.capture_graph(lambda a=args: drafts.run_pass(*a), pool)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        n = meta.num_seqs
        bs = next(b for b in self.buckets if b >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:bs].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:bs].fill_(1)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.block_tables[n:bs, 0].fill_(0)
        self.platform.before_replay(self.graphs[bs], meta, bs)
        self.graphs[bs].replay()
        self._last = bs, meta
        return self.outputs[bs][:n]

    def run_head(self, next_ids: torch.Tensor, full: bool) -> torch.Tensor | None:
        """The draft head's pass over the step `run` replayed last (its buffers still hold it): the
        head's outputs [n, width] (a copy: the next replay reuses the graph's), or None (`full` False:
        only its KV written)."""
        bs, meta = self._last
        n = next_ids.shape[0]
        self.head_ids[:n].copy_(next_ids)
        graph, out = self.head_graphs[bs, full]
        self.platform.before_replay(graph, meta, bs)
        graph.replay()
        return out[:n].clone() if full else None
