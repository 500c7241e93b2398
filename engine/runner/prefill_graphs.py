"""Prefill and mixed steps replayed piecewise: every op of the forward but attention, from graphs.

A prefill-sized step launches ~20 kernels a layer (norms, projections, their FP8 quantizers, the
experts' routing, alignment and GEMMs), each costing the host tens of microseconds in Python and
Triton's launcher. Eager, a 48-layer MoE step can spend longer launching than its kernels run
(qwen3-30b-a3b, FP8, 4,096 tokens: 60-116 ms a step on an H200, depending on the process, against
~56 ms of kernels; replayed, 61-65 ms in every run: docs/benchmarks.md, issue 33). Attention cannot
be captured whole (its launch grid follows the step's sequences and their lengths), but everything
between two attention calls depends only on the number of tokens.

So the forward is cut at each attention call (vLLM's piecewise graphs, built here without a
compiler: `ForwardContext.pieces`). For each bucket of tokens one capturing pass over the model
makes one graph per stretch between attentions, L + 1 in all; the attention calls run eagerly in
between. A step of T tokens runs the smallest bucket >= T: its inputs copied into static buffers,
then graph 0, attention of layer 0 (eager, with the step's own metadata, over the first T rows of
static q/k/v buffers, its output copied into a static buffer that graph 1 reads), graph 1, ... The
host launches one graph and the attention kernels per layer. The rows past T compute on stale
inputs (earlier steps' tokens and positions: finite) and are dropped; no attention or KV write
sees them, and every op between attentions is row-wise, so they change no real row.

All buckets share one memory pool, captured largest first; within a bucket graph i+1 reuses what
graph i freed, which is safe because they replay in capture order and never concurrently. What
crosses an attention call goes through the static q/k/v/out buffers, outside the pool.

Used where decode graphs are (CUDA, not --enforce-eager), for decoder-only models on one rank,
off in deterministic mode (a bucket's GEMM shapes are not the step's) and with a draft head, and
not for steps with images (their embeddings come from the vision tower). --no-prefill-graphs: eager.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from baton.engine.platforms import Platform
from baton.engine.runner.forward import Forward
from baton.models.attention_metadata import AttnMetadata
from baton.models.forward_context import ForwardContext
from baton.progress import Progress

SMALLEST = 256      # steps this short are few (short prompt chunks run as decode rows) and cheap


def buckets(max_tokens: int) -> list[int]:
    """Token counts captured: every 256 up to 4,096, every 512 up to 8,192, then every 1,024, and
    the step budget itself. A step pads by under a quarter past 1,024 tokens, an eighth past 2,048."""
    ladder, n = [], SMALLEST
    while n < max_tokens:
        ladder.append(n)
        n += 256 if n < 4096 else 512 if n < 8192 else 1024
    return ladder + [max_tokens]


class _Pieces:
    """What a capturing forward calls at each attention (through `ForwardContext.pieces`): end the
    graph being captured, run the attention eagerly, begin the next graph."""

    def __init__(self, owner: PrefillGraphs, tokens: int, capture: bool):
        self.owner, self.tokens, self.capture = owner, tokens, capture
        self.graphs: list = []
        self.layers: list[int] = []
        self._graph = None

    def begin(self) -> None:
        if self.capture:
            self._graph = self.owner.platform.begin_capture(self.owner.pool)

    def end(self) -> None:
        if self.capture:
            self.owner.platform.end_capture(self._graph)
            self.graphs.append(self._graph)

    def attend(self, ctx: ForwardContext, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        o, n = self.owner, self.tokens
        o.q[:n].copy_(q)
        o.k[:n].copy_(k)
        o.v[:n].copy_(v)
        self.end()
        self.layers.append(layer_idx)
        o.out[:n].copy_(ctx.attend_now(layer_idx, o.q[:n], o.k[:n], o.v[:n]))
        self.begin()
        return o.out[:n]


class PrefillGraphs:
    """The pieces of every bucket and their static buffers; `run` replays a step (engine/runner/executor.py).
    `dummy_meta(n)`: the metadata of a prompt of n tokens in blocks no sequence owns yet (what the
    attention calls between captures run on, engine/runner/warm_up.py)."""

    def __init__(self, forward: Forward, platform: Platform, max_tokens: int, dtype: torch.dtype,
                 dummy_meta: Callable[[int], AttnMetadata]):
        self.forward = forward
        self.platform = platform
        self.dummy_meta = dummy_meta
        self.buckets = buckets(max_tokens)
        n, dev = self.buckets[-1], platform.device
        attn = forward.model.model.layers[0].self_attn
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.q = torch.zeros(n, attn.num_heads, attn.head_dim, dtype=dtype, device=dev)
        self.k = torch.zeros(n, attn.num_kv_heads, attn.head_dim, dtype=dtype, device=dev)
        self.v = torch.zeros_like(self.k)
        self.out = torch.zeros_like(self.q)
        self.pool = self.platform.graph_pool()
        self.pieces: dict[int, _Pieces] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture()

    def can_run(self, tokens: int) -> bool:
        return tokens <= self.buckets[-1]

    @torch.inference_mode()
    def _capture(self) -> None:
        t0, free0 = time.perf_counter(), self.platform.memory_info()[0]
        model = self.forward.model
        with self.platform.capture_stream():
            progress = Progress("capturing prefill graphs", len(self.buckets))
            for i, n in enumerate(reversed(self.buckets)):     # largest first: it sizes the pool
                for capture in (False, True):                  # a pass to compile and size, then the capture
                    pieces = _Pieces(self, n, capture)
                    ctx = self.forward.context(self.dummy_meta(n), pieces=pieces)
                    pieces.begin()
                    out = model(self.input_ids[:n], self.positions[:n], ctx)
                    pieces.end()
                    self.platform.synchronize()
                self.pieces[n], self.outputs[n] = pieces, out
                progress.update(i + 1)
        held = max(0, free0 - self.platform.memory_info()[0]) >> 20     # the graphs' pool, past eager's cache
        progress.done(f"captured prefill graphs for {len(self.buckets)} step sizes ({self.buckets[0]}.."
                      f"{self.buckets[-1]} tokens, {len(pieces.graphs)} pieces each) in "
                      f"{time.perf_counter() - t0:.1f}s, {held} MiB more device memory held")

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = input_ids.shape[0]
        n = next(b for b in self.buckets if b >= t)
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        pieces = self.pieces[n]
        for graph, layer in zip(pieces.graphs[:-1], pieces.layers, strict=True):
            graph.replay()
            self.out[:t].copy_(ctx.attend_now(layer, self.q[:t], self.k[:t], self.v[:t]))
        pieces.graphs[-1].replay()
        return self.outputs[n][:t]
