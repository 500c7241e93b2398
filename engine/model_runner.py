"""Runs the model for one scheduled step: builds inputs and attention metadata, samples.

The runner owns the device state (weights, the paged KV cache, decode graphs); everything
above it is plain Python. KV capacity comes from a memory budget unless given exactly.
"""
from __future__ import annotations

import sys
import time

import torch

import models
from engine.attention_metadata import AttnMetadata
from engine.config import EngineConfig
from engine.forward_context import ForwardContext
from engine.platforms import Platform, get_platform
from engine.sampler import Sampler, SamplingBatch
from engine.scheduler import SchedulerOutput

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_CACHE_DEFAULT = 1 << 30          # 1 GiB: plenty for tests and a laptop


class ModelRunner:
    def __init__(self, config: EngineConfig, source: models.ModelSource | None = None,
                 tp_rank: int = 0, tp_group=None):
        self.config = config
        self.platform: Platform = get_platform(config.device)
        self.device = self.platform.device
        self.source = source or models.resolve_model(config.model)
        hf = self.source.hf_config
        self.dtype = _DTYPES[config.dtype] if config.dtype else self.platform.default_dtype()
        self.vocab_size = hf.vocab_size
        self.model = self._load_model(tp_rank, tp_group)
        self.block_size = config.block_size
        self.platform.check_kv_layout(self.block_size, self.model.head_dim, self.dtype)
        self.num_blocks = self._size_kv_cache()
        self.kv_cache = self.platform.allocate_kv_cache(
            self.model.num_layers, self.num_blocks, self.block_size, self.model.num_kv_heads,
            self.model.head_dim, self.dtype)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(self.model.num_layers)]
        self.scale = self.model.head_dim ** -0.5
        self.sampler = Sampler()
        self.max_model_len = self._max_model_len()
        self.graphs = None
        if self.platform.supports_graphs and not config.enforce_eager:
            from engine.graph_runner import DecodeGraphs
            self.graphs = DecodeGraphs(self)

    # -- set-up -----------------------------------------------------------------------------
    def _load_model(self, tp_rank: int, tp_group) -> torch.nn.Module:
        t0 = time.perf_counter()
        torch.manual_seed(self.config.seed)
        with torch.device(self.device):
            model = models.build_model(self.source.hf_config, self.dtype, self.device, self.platform.ops,
                                       tp_rank=tp_rank, tp_size=self.config.tp_size, tp_group=tp_group)
        if self.source.weights_path is None:
            models.init_random_weights(model, self.source.random_seed)
        else:
            models.load_weights(model, self.source.weights_path)
        model.eval()
        if time.perf_counter() - t0 > 5:
            print(f"[baton] model {self.source.name} ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        return model

    def block_bytes(self) -> int:
        m = self.model
        return 2 * m.num_layers * self.block_size * m.num_kv_heads * m.head_dim * self.dtype.itemsize

    def _size_kv_cache(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        budget = self.config.kv_cache_memory
        if budget is None:
            free, total = self.platform.memory_info()
            if self.device.type == "cpu":
                budget = min(CPU_KV_CACHE_DEFAULT, free // 4)
            else:
                used = total - free
                budget = int(total * self.config.gpu_memory_utilization) - used - self._activation_reserve()
        num = budget // self.block_bytes()
        if num < 1:
            raise ValueError(f"no memory left for the KV cache (budget {budget} bytes); "
                             "lower the model size or raise --gpu-memory-utilization")
        return int(num)

    def _activation_reserve(self) -> int:
        hf = self.source.hf_config
        tokens = self.config.max_num_batched_tokens
        per_token = (hf.hidden_size * 6 + hf.intermediate_size * 3) * 4 + hf.vocab_size * 4 // 8
        return tokens * per_token + (512 << 20)

    def _max_model_len(self) -> int:
        hf = self.source.hf_config
        limit = self.config.max_model_len or getattr(hf, "max_position_embeddings", 4096)
        return min(limit, self.num_blocks * self.block_size)

    # -- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> list[int | None]:
        """Run the model on the scheduled tokens; the sampled token per sequence, or None."""
        meta, input_ids, positions = self._prepare(out)
        rows = [i for i, s in enumerate(out.scheduled) if s.samples]
        if self.graphs is not None and meta.is_decode and self.graphs.can_run(meta.num_seqs):
            hidden = self.graphs.run(input_ids, positions, meta)
        else:
            ctx = ForwardContext(meta, self.kv_caches, self.platform, self.scale)
            hidden = self.model(input_ids, positions, ctx)
        result: list[int | None] = [None] * len(out.scheduled)
        if not rows:
            return result
        last = meta.query_start_loc[1:].long() - 1
        logits = self.model.compute_logits(hidden[last[rows]] if len(rows) < len(last) else hidden[last])
        tokens = self.sampler(logits, self._sampling_batch(out, rows)).tolist()
        for row, token in zip(rows, tokens, strict=True):
            result[row] = token
        return result

    def _prepare(self, out: SchedulerOutput) -> tuple[AttnMetadata, torch.Tensor, torch.Tensor]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts, seq_lens, tables = [0], [], []
        has_context = False
        for item in out.scheduled:
            seq, n = item.seq, item.num_new_tokens
            begin, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            has_context |= begin > 0
            input_ids += seq.token_ids[begin:end]
            positions += range(begin, end)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(begin, end)]
            starts.append(starts[-1] + n)
            seq_lens.append(end)
            tables.append(table)
        width = max(len(t) for t in tables)
        padded = [t + [-1] * (width - len(t)) for t in tables]
        dev = self.device
        meta = AttnMetadata(
            is_decode=out.is_decode,
            slot_mapping=_tensor(slots, torch.int64, dev),
            query_start_loc=_tensor(starts, torch.int32, dev),
            seq_lens=_tensor(seq_lens, torch.int32, dev),
            block_tables=_tensor(padded, torch.int32, dev),
            max_query_len=max(s.num_new_tokens for s in out.scheduled),
            max_seq_len=max(seq_lens),
            has_context=has_context,
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
        )
        return meta, _tensor(input_ids, torch.int64, dev), _tensor(positions, torch.int64, dev)

    def _sampling_batch(self, out: SchedulerOutput, rows: list[int]) -> SamplingBatch:
        seqs = [out.scheduled[r].seq for r in rows]
        params = [s.params for s in seqs]
        dev = self.device
        seeds = [s.sampling_seed if s.sampling_seed is not None else 0 for s in seqs]
        return SamplingBatch(
            temperatures=_tensor([p.temperature for p in params], torch.float32, dev),
            top_ks=_tensor([p.top_k for p in params], torch.int64, dev),
            top_ps=_tensor([p.top_p for p in params], torch.float32, dev),
            seeds=_tensor([_signed64(x) for x in seeds], torch.int64, dev),
            has_seed=_tensor([s.sampling_seed is not None for s in seqs], torch.bool, dev),
            positions=_tensor([s.num_tokens for s in seqs], torch.int64, dev),
            all_greedy=all(p.temperature == 0 for p in params),
            any_top_k=any(p.top_k > 0 for p in params),
            any_top_p=any(p.top_p < 1.0 for p in params),
            any_seed=any(s.sampling_seed is not None for s in seqs),
        )


def _signed64(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _tensor(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.tensor(data, dtype=dtype)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
