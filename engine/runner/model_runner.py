"""Runs the model for one scheduled step: builds its inputs, queues it on the device, samples.

The runner owns the device state and composes it from one collaborator per concept: the model
(engine/runner/weights.py), the paged KV cache (engine/runner/kv_cache.py), the step-input builder
(engine/runner/input_builder.py), the executor that dispatches the forward and samples
(engine/runner/executor.py), the decode and prefill graphs, and an EAGLE-3 draft head. Everything above
it is plain Python. KV capacity comes from a memory budget unless given exactly.
"""
from __future__ import annotations

import numpy as np
import torch

from baton.engine.config import EngineConfig
from baton.engine.platforms import Platform, get_platform
from baton.engine.runner.draft_head import DraftHead, load_head
from baton.engine.runner.executor import StepExecutor
from baton.engine.runner.forward import Forward
from baton.engine.runner.host_tier import HostTier
from baton.engine.runner.input_builder import StepInputBuilder
from baton.engine.runner.kv_cache import KVCache, cpu_kv_cache_default
from baton.engine.runner.logits_processing import MaskBuffers
from baton.engine.runner.sampler import Sampler
from baton.engine.runner.staging import HostUpload
from baton.engine.runner.step import LaunchedStep, StepInputs
from baton.engine.runner.tensor_parallel import TensorParallel
from baton.engine.runner.warm_up import dummy_prompt, warm_up
from baton.engine.runner.weights import load_model, model_dtype
from baton.engine.scheduling.scheduler import SchedulerOutput
from baton.models.attention_metadata import AttnMetadata
from baton.models.decoder import DecoderForCausalLM
from baton.models.layers.rope_config import check_max_model_len
from baton.models.source import ModelSource, resolve_model

__all__ = ["ModelRunner", "cpu_kv_cache_default"]     # (benchmarks/offline_transformers.py imports the second)


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource | None = None,
                 tp_rank: int = 0, tp_group=None, device: str | None = None):
        self.config = config
        self.tp_rank = tp_rank
        self.tp: TensorParallel | None = None
        if config.num_ranks > 1 and tp_group is None:        # rank 0: start the other ranks first
            self.tp = TensorParallel(config, type(self))
            tp_group, device = self.tp.group, self.tp.devices[0]
        group = tp_group                                     # every rank's (tensor- or context-parallel)
        if config.context_parallel_size > 1:                 # full weights on every rank
            tp_rank, tp_group = 0, None
        self.tp_group = tp_group
        self.platform: Platform = get_platform(device or config.device, config.platform_options())
        self.device = self.platform.device
        self.platform.bind_thread()          # the engine thread binds itself too (AsyncEngine)
        self.source = source or resolve_model(config.model, config.cache_dir, config.tokenizer, config.revision,
                                              baton_config=True)
        hf = self.source.hf_config
        check_max_model_len(hf, config.max_model_len)        # before loading: rope scaling bounds it
        self.dtype = model_dtype(config, self.platform)
        self.vocab_size = hf.vocab_size
        self.model, self.quantization = load_model(config, self.source, self.platform, self.dtype, tp_rank, tp_group)
        # an EAGLE-3 draft head (engine/runner/draft_head.py): its KV is one more layer of the paged cache, and
        # the model hands it three of its hidden states with every step's output
        self.head, draft_targets = load_head(config, self.model, self.platform.ops, self.dtype, self.device)
        self.platform.ops.fp8_fast_accum = config.fp8_accumulation == "fast"
        # what the model's attention layers call: the platform, or deterministic mode's row attention
        self.attention = self.platform
        if config.deterministic:
            from baton.engine.runner.batch_invariant import RowAttention, make_batch_invariant
            make_batch_invariant(self.model, self.platform.ops, self.platform.invariant_rows)
            self.attention = RowAttention(self.platform)
        self.block_size = config.block_size
        self.scale = self.model.head_dim ** -0.5
        # the KV cache's dtype: the model's, or float8 e4m3 (--kv-cache-dtype fp8)
        kv_dtype = torch.float8_e4m3fn if config.kv_cache_dtype == "fp8" else self.dtype
        self.kv = KVCache(config, self.platform, self.model, hf, self.model.num_layers + (self.head is not None),
                          kv_dtype, self.attention, self.scale, group)
        self.host_tier = None if not config.kv_offloading_size else HostTier(   # --kv-offloading-size
            self.kv.tensor, self.kv.block_bytes(), int(config.kv_offloading_size * (1 << 30)))
        self.forward = Forward(self.model, self.kv.layers, self.attention, self.scale, self.kv.scales,
                               hf.hidden_size if self.head is not None else None)
        self.upload = HostUpload(self.device)
        self.drafts = DraftHead(self.head, draft_targets, self.forward, self.upload, config, self.dtype) \
            if self.head is not None else None
        self.sampler = Sampler(self.platform.fused_sample, per_row=config.deterministic)
        self.masks = MaskBuffers(self.device)          # structured output's bitmasks
        self.max_model_len = self._max_model_len()
        self.executor = StepExecutor(self.forward, self.platform, self.upload, self.sampler, self.drafts, hf,
                                     tp_rank if group is None else torch.distributed.get_rank(group),
                                     config.max_num_seqs)
        if self.tokens_on_every_rank and config.num_ranks > 1:
            self.executor.token_group = group
        if config.context_parallel_size > 1:
            from baton.engine.runner.context_parallel import ContextParallel
            self.executor.cp = ContextParallel(config.context_parallel_size, self.executor.tp_rank, group, self.device,
                                            self.model)
        self.inputs = StepInputBuilder(config, self.drafts, self.executor.graphs_replay)
        if self.device.type != "cpu":
            capacity = min(self.num_blocks * self.block_size, self.max_model_len)
            warm_up(self.forward, self.platform, self.dummy_prompt, capacity,
                    min(config.max_num_batched_tokens, capacity - 16))
        if self.platform.supports_graphs and not config.enforce_eager and self._graph_safe():
            self._capture_graphs()
        if self.tp is not None:
            self.tp.wait_ready()

    def close(self) -> None:
        """Stops the other tensor-parallel ranks (nothing to do without them)."""
        if self.tp is not None:
            self.graphs = None          # captured graphs hold communicator resources: free them first
            self.tp.close()
            self.tp = None

    # -- set-up -----------------------------------------------------------------------------
    def _graph_safe(self) -> bool:
        """A model may opt out (`graph_safe = False`); one with routed experts captures only where
        the platform's ops group them without a host sync (LayerOps.moe_graph_safe)."""
        if not getattr(self.model, "graph_safe", True):
            return False
        return not getattr(self.model, "uses_moe", False) or self.platform.ops.moe_graph_safe

    def _piecewise_safe(self) -> bool:
        """Piecewise prefill graphs: a decoder-only model on one rank, no draft head, not deterministic."""
        c = self.config
        return (c.prefill_graphs and self.platform.supports_piecewise_graphs and c.num_ranks == 1
                and not c.deterministic and self.drafts is None and isinstance(self.model, DecoderForCausalLM))

    def _capture_graphs(self) -> None:
        from baton.engine.runner.graph_runner import DecodeGraphs
        self.executor.graphs = DecodeGraphs(self.forward, self.platform, self.config, self.max_model_len,
                                            self.drafts)
        if self._piecewise_safe():
            from baton.engine.runner.prefill_graphs import PrefillGraphs
            self.executor.prefill_graphs = PrefillGraphs(self.forward, self.platform,
                                                         self.config.max_num_batched_tokens, self.dtype,
                                                         lambda n: self.dummy_prompt(n)[2])

    def _max_model_len(self) -> int:
        hf = self.source.hf_config
        limit = self.config.max_model_len or getattr(hf, "max_position_embeddings", 4096)
        return min(limit, self.num_blocks * self.block_size)

    def dummy_prompt(self, new: int, context: int = 0) -> tuple[torch.Tensor, torch.Tensor, AttnMetadata]:
        """(ids, positions, metadata) of one prompt in blocks no sequence owns yet (engine/runner/warm_up.py)."""
        return dummy_prompt(self.upload, self.block_size, new, context)

    # -- what the engine, the KV hand-off and the tests read -------------------------------
    @property
    def graphs(self):
        """The decode graphs (engine/runner/graph_runner.py); None: eager. Set None to free them."""
        return self.executor.graphs

    @graphs.setter
    def graphs(self, graphs) -> None:
        self.executor.graphs = graphs

    @property
    def prefill_graphs(self):
        """The piecewise prefill graphs (engine/runner/prefill_graphs.py); None: eager."""
        return self.executor.prefill_graphs

    @property
    def eos_token_ids(self) -> list[int]:
        """What min_tokens masks (the engine sets them)."""
        return self.inputs.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: list[int]) -> None:
        self.inputs.eos_token_ids = ids

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.kv.tensor

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.kv.layers

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.kv.dtype

    @property
    def kv_scales(self) -> torch.Tensor | None:
        return self.kv.scales

    @property
    def kv_scales_checksum(self) -> str:
        return self.kv.scales_checksum

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    @property
    def num_cache_layers(self) -> int:
        return self.kv.num_layers

    def block_bytes(self) -> int:
        return self.kv.block_bytes()

    def pack_kv(self, block_ids: list[int], first_block: int = 0, so_far=None):
        """(these blocks packed on the device, the event after which they are final, the transfer's
        checksum through them): KVCache.pack."""
        return self.kv.pack(block_ids, first_block, so_far)

    def write_kv(self, block_ids: list[int], payload) -> None:
        """Copy a transferred payload (bytes, a uint8 tensor, or Pieces) into these blocks."""
        self._one_cache()
        self.kv.write(block_ids, payload)

    def land_kv(self, block_ids: list[int], payload, prove: bool):
        """Write a landed payload into these blocks, and its checksum (queued): KVCache.land."""
        self._one_cache()
        return self.kv.land(block_ids, payload, prove)

    def _one_cache(self) -> None:
        if self.config.context_parallel_size > 1:
            raise RuntimeError("KV landed from another worker would reach rank 0's cache only, and every "
                               "context-parallel rank reads its own full copy: land KV on a worker without "
                               "--context-parallel-size")

    @property
    def tokens_on_every_rank(self) -> bool:
        """Does every rank hold each step's sampled tokens on its device, so the next step can be queued
        before they are back on the host (asynchronous scheduling)? One rank, or tensor-parallel ranks
        (rank 0 broadcasts them); not context parallelism, nor speculation (its rows and rollbacks)."""
        c = self.config
        return c.num_ranks == 1 or (c.context_parallel_size == 1 and c.speculative_method is None)

    # -- one step ---------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> list[int | None]:
        """Run the model on the scheduled tokens; the sampled token per sequence, or None."""
        return self.launch(out).tokens()

    def step_inputs(self, out: SchedulerOutput, prev: LaunchedStep | None = None) -> StepInputs:
        """The step's host inputs (engine/runner/input_builder.py)."""
        return self.inputs.build(out, prev)

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, prev: LaunchedStep | None = None) -> LaunchedStep:
        """Queue the step on the device and return at once; its sampled tokens come back to
        the host asynchronously (`LaunchedStep.tokens`). Input tokens still pending (sampled by
        `prev`, not yet back) are taken from `prev`'s tokens on the device."""
        inputs = self.step_inputs(out, prev)
        if prev is not None:
            prev.complete()                            # its sampling queued before this step needs its tokens
        if self.tp is not None:
            self.tp.send(inputs)                       # the other ranks run the same step
        output = self.executor.run(inputs, prev.device_tokens if prev is not None else None)
        launched = LaunchedStep(out, inputs.sample_items.tolist(), [item.seq.seq_id for item in out.scheduled],
                                None, None, None, wanted_logprobs=inputs.wanted_logprobs)
        if output.deferred is not None:                # structured output: sampled once its masks are known
            launched.deferred = output
        else:
            self.executor.finish(launched, output, output.sampled)
        return launched

    @torch.inference_mode()
    def sample(self, launched: LaunchedStep, bitmask: torch.Tensor | np.ndarray | None) -> None:
        """Sample a step launched with structured-output rows (`launched.deferred`), under `bitmask`
        ([N, ceil(vocab / 32)] int32 on the host, one row per sampling row, filled in place in one of
        `masks.take`'s pinned buffers; None: nothing masked). The host builds the masks while the
        device runs the step's forward, which never needs them."""
        output, launched.deferred = launched.deferred, None
        mask = self.masks.upload(bitmask) if bitmask is not None else None
        self.executor.finish(launched, output, self.executor.sample(output.deferred, output.logprobs, mask))

    def run(self, inputs: StepInputs, prev_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Forward (and, on rank 0, sampling) for host inputs; every rank runs this (the other
        tensor-parallel ranks through it). Returns the sampled tokens on the device (on the other
        ranks rank 0's, received, where `tokens_on_every_rank`; else None)."""
        return self.executor.run(inputs, prev_tokens).sampled
