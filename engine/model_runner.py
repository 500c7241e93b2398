"""Runs the model for one scheduled step: builds inputs and attention metadata, samples.

The runner owns the device state (weights, the paged KV cache, decode graphs); everything
above it is plain Python. KV capacity comes from a memory budget unless given exactly.
"""
from __future__ import annotations

import sys
import time

import numpy as np
import torch

from baton.engine import kv_scales
from baton.engine.config import EngineConfig
from baton.engine.draft_head import DraftHead, load_head
from baton.engine.kv_blocks import pack_blocks_on_device, unpack_blocks
from baton.engine.logits_processing import (
    MaskBuffers,
    apply_logits_processing,
    apply_token_bitmask,
    host_inputs,
    to_device,
)
from baton.engine.logprobs_device import (
    PromptLogprobRows,
    StepLogprobs,
    log_softmax,
    sampled_logprobs,
)
from baton.engine.logprobs_device import prompt as prompt_logprobs
from baton.engine.multimodal import step_positions
from baton.engine.platforms import Platform, get_platform
from baton.engine.platforms.base import is_fp8
from baton.engine.sampler import Sampler, SamplingBatch
from baton.engine.scheduler import SchedulerOutput
from baton.engine.sequence import PENDING
from baton.engine.staging import HostUpload
from baton.engine.step import LaunchedStep, StepInputs
from baton.engine.tensor_parallel import TensorParallel
from baton.models.attention_metadata import AttnMetadata
from baton.models.decoder import DecoderForCausalLM, fuse_fp8_inputs
from baton.models.forward_context import ForwardContext
from baton.models.layers.quantization import checkpoint_method, quantize_fp8, quantize_w8a8
from baton.models.loader import build_model, init_random_weights, load_weights
from baton.models.source import ModelSource, resolve_model

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_CACHE_MAX = 1 << 30              # the CPU's default KV cache: sized to the model, at most this
# A prompt chunk ending within this many tokens may run as decode rows (ModelRunner._as_rows): each of
# its rows reads its context again, which stays cheap (and in L2) this short
ROWS_PROMPT_CONTEXT = 512


def cpu_kv_cache_default(weight_bytes: int, one_sequence_bytes: int) -> int:
    """The CPU's KV cache when none is asked for: as many bytes as the weights (a small model
    gets a small cache), room for at least one sequence of the full context, at most CPU_KV_CACHE_MAX."""
    return min(CPU_KV_CACHE_MAX, max(weight_bytes, one_sequence_bytes))


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource | None = None,
                 tp_rank: int = 0, tp_group=None, device: str | None = None):
        self.config = config
        self.tp_rank = tp_rank
        self.tp: TensorParallel | None = None
        if config.tp_size > 1 and tp_group is None:          # rank 0: start the other ranks first
            self.tp = TensorParallel(config, type(self))
            tp_group, device = self.tp.group, self.tp.devices[0]
        self.tp_group = tp_group
        self.platform: Platform = get_platform(device or config.device, config.platform_options())
        self.device = self.platform.device
        self.platform.bind_thread()          # the engine thread binds itself too (AsyncEngine)
        self.source = source or resolve_model(config.model, config.cache_dir, config.tokenizer, config.revision)
        hf = self.source.hf_config
        self.dtype = _DTYPES[config.dtype] if config.dtype else self.platform.default_dtype()
        self.vocab_size = hf.vocab_size
        self.model = self._load_model(tp_rank, tp_group)
        # an EAGLE-3 draft head (engine/draft_head.py): its KV is one more layer of the paged cache, and
        # the model hands it three of its hidden states with every step's output
        self.head = load_head(config, self.model, self.platform.ops, self.dtype, self.device)
        self.num_cache_layers = self.model.num_layers + (self.head is not None)
        self.drafts = DraftHead(self) if self.head is not None else None
        self.platform.ops.fp8_fast_accum = config.fp8_accumulation == "fast"
        # what the model's attention layers call: the platform, or deterministic mode's row attention
        self.attention = self.platform
        if config.deterministic:
            from baton.engine.batch_invariant import RowAttention, make_batch_invariant
            make_batch_invariant(self.model, self.platform.ops, self.platform.invariant_rows)
            self.attention = RowAttention(self.platform)
        self.block_size = config.block_size
        # the KV cache's dtype: the model's, or float8 e4m3 (--kv-cache-dtype fp8)
        self.kv_dtype = torch.float8_e4m3fn if config.kv_cache_dtype == "fp8" else self.dtype
        self.platform.check_kv_layout(self.block_size, self.model.head_dim, self.kv_dtype)
        self.num_blocks = self._size_kv_cache()
        self.kv_cache = self.platform.allocate_kv_cache(
            self.num_cache_layers, self.num_blocks, self.block_size, self.model.num_kv_heads,
            self.model.head_dim, self.kv_dtype)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(self.num_cache_layers)]
        self.scale = self.model.head_dim ** -0.5
        # a float8 cache's K and V scales per (layer, kv head), fixed from here on (graphs read them)
        self.kv_scales = self._kv_scales()
        self.kv_scales_checksum = kv_scales.checksum(self.kv_scales)     # what the KV handshake compares
        self.sampler = Sampler(self.platform.fused_sample, per_row=config.deterministic)
        self.eos_token_ids: list[int] = []     # min_tokens masks them (the engine sets them)
        self.upload = HostUpload(self.device)
        self.masks = MaskBuffers(self.device)          # structured output's bitmasks
        self._token_buffers: list[torch.Tensor | None] = [None, None]   # pinned copies of sampled tokens
        self._turn = 0
        self.max_model_len = self._max_model_len()
        self.graphs = None
        self.prefill_graphs = None       # prefill and mixed steps, piecewise (engine/prefill_graphs.py)
        # short prompt chunks as decode rows (_as_rows) where decode graphs replay them; True: without
        # graphs too (tests: the same rows, eager)
        self.eager_prompt_rows = False
        if self.device.type != "cpu":
            self._warm_up()
        if self.platform.supports_graphs and not config.enforce_eager and self._graph_safe():
            from baton.engine.graph_runner import DecodeGraphs
            self.graphs = DecodeGraphs(self)
            if self._piecewise_safe():
                from baton.engine.prefill_graphs import PrefillGraphs
                self.prefill_graphs = PrefillGraphs(self)
        if self.tp is not None:
            self.tp.wait_ready()

    def close(self) -> None:
        """Stops the other tensor-parallel ranks (nothing to do without them)."""
        if self.tp is not None:
            self.graphs = None          # captured graphs hold communicator resources: free them first
            self.tp.close()
            self.tp = None

    def _graph_safe(self) -> bool:
        """A model may opt out (`graph_safe = False`); one with routed experts captures only where
        the platform's ops group them without a host sync (LayerOps.moe_graph_safe)."""
        if not getattr(self.model, "graph_safe", True):
            return False
        return not getattr(self.model, "uses_moe", False) or self.platform.ops.moe_graph_safe

    def _piecewise_safe(self) -> bool:
        """Piecewise prefill graphs: a decoder-only model on one rank, no draft head, not deterministic."""
        c = self.config
        return (c.prefill_graphs and self.platform.supports_piecewise_graphs and c.tp_size == 1
                and not c.deterministic and self.drafts is None and isinstance(self.model, DecoderForCausalLM))

    # -- set-up -----------------------------------------------------------------------------
    def _load_model(self, tp_rank: int, tp_group) -> torch.nn.Module:
        t0 = time.perf_counter()
        torch.manual_seed(self.config.seed)
        with torch.device(self.device):
            model = build_model(self.source.hf_config, self.dtype, self.device, self.platform.ops,
                                       tp_rank=tp_rank, tp_size=self.config.tp_size, tp_group=tp_group)
        if self.source.weights_path is None:
            init_random_weights(model, self.source.random_seed)
        else:
            load_weights(model, self.source.weights_path)
        model.eval()
        self.quantization = self._quantize(model)
        if time.perf_counter() - t0 > 5:
            print(f"[baton] model {self.source.name} ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        return model

    def _split_aux(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the model's output, the hidden states the head reads: None without a head)."""
        if self.head is None:
            return hidden, None
        width = self.source.hf_config.hidden_size
        return hidden[:, :width], hidden[:, width:]

    def _quantize(self, model: torch.nn.Module) -> str | None:
        """--quantization, else what the checkpoint was quantized with: the linear layers' weights
        to FP8 or int8 (models/layers/quantization.py); their bf16 copies go back to the device first."""
        method = self.config.quantization or checkpoint_method(self.source.hf_config)
        if method is None:
            return None
        if self.config.deterministic:
            raise ValueError(f"--deterministic does not cover quantized matmuls, and this checkpoint is {method}: "
                             "serve it without --deterministic")
        if method == "w8a8":
            self.platform.int8_linear()               # ValueError where the platform has no int8 GEMM path
            quantize_w8a8(model, self.platform)
        else:
            mode = self.platform.fp8_linear()          # ValueError where the platform has no FP8 matmul
            if self.config.fp8_rounding == "gptq":
                self._round_with_gptq(model, mode)
            quantize_fp8(model, self.platform.ops, mode)
            fuse_fp8_inputs(model)                     # the norms and SiLU-and-mul before them quantize
        if self.platform.runtime is not None and hasattr(self.platform.runtime, "empty_cache"):
            self.platform.runtime.empty_cache()      # the KV cache is sized from what is free now
        return method

    def _round_with_gptq(self, model: torch.nn.Module, mode: str) -> None:
        """--fp8-rounding gptq: the decoder layers' projections rounded layer by layer, calibrated on a
        fixed text (engine/fp8_rounding.py); quantize_fp8 then does the rest to nearest."""
        from baton.engine import fp8_rounding
        if checkpoint_method(self.source.hf_config) is not None:
            raise ValueError("--fp8-rounding gptq rounds bf16 weights at load; this checkpoint's weights are "
                             "already quantized: serve it without --fp8-rounding")
        hf = self.source.hf_config
        windows = fp8_rounding.calibration_windows(self.source.tokenizer_dir(),
                                                   getattr(hf, "max_position_embeddings", fp8_rounding.CALIBRATION_WINDOW))
        fp8_rounding.round_with_gptq(model, self.platform, model.head_dim ** -0.5, windows, self.platform.ops, mode,
                                     self.device)

    def _kv_scales(self) -> torch.Tensor | None:
        """[layers, 2, kv_heads] float32: the checkpoint's K/V cache scales, else calibrated now
        (engine/kv_scales.py); None without a float8 cache or with --kv-cache-scales one (1)."""
        if not is_fp8(self.kv_dtype) or self.config.kv_cache_scales == "one":
            return None
        m = self.model
        found = kv_scales.from_checkpoint(getattr(m, "checkpoint_kv_scales", {}), m.num_layers, m.num_kv_heads,
                                          self.device)
        if found is not None:
            return found
        positions = getattr(self.source.hf_config, "max_position_embeddings", kv_scales.CALIBRATION_TOKENS)
        return kv_scales.calibrate(m, self.attention, self.scale, self.vocab_size, positions, self.device)

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """Run each prefill kernel variant once (long and short prompts, with and without cached
        context) and a full-budget step, so JIT compiles and allocator growth happen here, not
        in some request's TTFT. The KV it writes lands in blocks no sequence owns yet."""
        t0 = time.perf_counter()
        capacity = min(self.num_blocks * self.block_size, self.max_model_len)
        budget = min(self.config.max_num_batched_tokens, capacity - 16)
        shapes = [(budget, 0), (16, 0), (16, 16), (min(2048, budget), 16)]
        for new, context in shapes:
            if new > 0 and new + context <= capacity:
                self._dummy_prefill(new, context)
        self.platform.synchronize()
        if time.perf_counter() - t0 > 2:
            print(f"[baton] prefill kernels warmed up in {time.perf_counter() - t0:.1f}s", file=sys.stderr)

    def dummy_prompt(self, new: int, context: int = 0) -> tuple[torch.Tensor, torch.Tensor, AttnMetadata]:
        """(ids, positions, metadata) of one prompt's `new` tokens after `context` cached ones, in the
        first blocks (identity table: slot == position), which no sequence owns before serving starts."""
        seq_len = new + context
        blocks = np.arange(-(-seq_len // self.block_size), dtype=np.int32)
        positions = np.arange(context, seq_len, dtype=np.int64)
        starts = np.array([0, new], np.int32)
        ids, pos, slots, starts_d, lens, tables = self.upload(
            np.zeros(new, np.int64), positions, positions.copy(), starts, np.array([seq_len], np.int32), blocks[None])
        return ids, pos, AttnMetadata(
            is_decode=False, slot_mapping=slots, query_start_loc=starts_d, seq_lens=lens, block_tables=tables,
            max_query_len=new, max_seq_len=seq_len, has_context=context > 0, query_start_loc_cpu=[0, new],
            seq_lens_cpu=[seq_len])

    def _dummy_prefill(self, new: int, context: int) -> None:
        ids, pos, meta = self.dummy_prompt(new, context)
        hidden = self.model(ids, pos, ForwardContext(meta, self.kv_caches, self.attention, self.scale, self.kv_scales))
        self.model.compute_logits(self._split_aux(hidden)[0][-1:])

    def pack_kv(self, block_ids: list[int]):
        """(a contiguous uint8 copy of these blocks on the device, the event after which it is
        final; None on the CPU). Queued on the engine's stream, so later steps cannot overwrite
        the blocks before the copy has read them."""
        return pack_blocks_on_device(self.kv_cache, block_ids), self.platform.record_event()

    def write_kv(self, block_ids: list[int], payload) -> None:
        """Copy a transferred payload (bytes, a uint8 tensor, or Pieces) into these blocks."""
        unpack_blocks(self.kv_cache, block_ids, payload)

    def block_bytes(self) -> int:
        m = self.model
        return 2 * self.num_cache_layers * self.block_size * m.num_kv_heads * m.head_dim * self.kv_dtype.itemsize

    def _size_kv_cache(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        budget = self.config.kv_cache_memory
        if budget is None:
            free, total = self.platform.memory_info()
            if self.device.type == "cpu":
                budget = min(self._cpu_kv_default(), free // 4)
            else:
                used = total - free
                budget = int(total * self.config.gpu_memory_utilization) - used - self._activation_reserve()
        num = budget // self.block_bytes()
        if self.config.tp_size > 1:            # every rank holds the same blocks: the smallest budget wins
            n = torch.tensor([num], dtype=torch.int64, device=self.device)
            torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MIN, group=self.tp_group)
            num = int(n.item())
        if num < 1:
            where = " on the tightest tensor-parallel rank" if self.config.tp_size > 1 else ""
            raise ValueError(f"no memory left for the KV cache{where} (this rank's budget {budget} bytes, "
                             f"{self.block_bytes()} per block); lower the model size or raise "
                             "--gpu-memory-utilization")
        return int(num)

    def _cpu_kv_default(self) -> int:
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        context = self.config.max_model_len or getattr(self.source.hf_config, "max_position_embeddings", 4096)
        return cpu_kv_cache_default(weights, -(-context // self.block_size) * self.block_bytes())

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
    def execute(self, out: SchedulerOutput) -> list[int | None]:
        """Run the model on the scheduled tokens; the sampled token per sequence, or None."""
        return self.launch(out).tokens()

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
        sampled = self.run(inputs, prev.device_tokens if prev is not None else None)
        launched = LaunchedStep(out, inputs.sample_items.tolist(), [item.seq.seq_id for item in out.scheduled],
                                None, None, None, wanted_logprobs=inputs.wanted_logprobs)
        if inputs.deferred is not None:                # structured output: sampled once its masks are known
            launched.deferred = inputs
        else:
            self._sampled(launched, inputs, sampled)
        return launched

    @torch.inference_mode()
    def sample(self, launched: LaunchedStep, bitmask: torch.Tensor | np.ndarray | None) -> None:
        """Sample a step launched with structured-output rows (`launched.deferred`), under `bitmask`
        ([N, ceil(vocab / 32)] int32 on the host, one row per sampling row, filled in place in one of
        `masks.take`'s pinned buffers; None: nothing masked). The host builds the masks while the
        device runs the step's forward, which never needs them."""
        inputs, launched.deferred = launched.deferred, None
        logits, sampling, input_ids = inputs.deferred
        inputs.deferred = None
        mask = self.masks.upload(bitmask) if bitmask is not None else None
        self._sampled(launched, inputs, self._sample(inputs, logits, sampling, input_ids, mask))

    def _sampled(self, launched: LaunchedStep, inputs: StepInputs, sampled: torch.Tensor | None) -> None:
        if inputs.head_args is not None:
            launched.head_hidden = self.drafts.pass_over_step(inputs, sampled)
            launched.head_rows = inputs.sample_logit_rows
        launched.device_tokens = sampled
        launched.host_tokens, launched.event = self._copy_back(sampled)
        launched.step_logprobs = inputs.logprobs_dev

    def _copy_back(self, sampled: torch.Tensor | None):
        """A host copy of the sampled tokens, under way (pinned buffers alternate: a step's copy is
        read only after the next step has been queued)."""
        if sampled is None or sampled.device.type == "cpu":
            return sampled, None
        self._turn ^= 1
        buf = self._token_buffers[self._turn]
        if buf is None or buf.numel() < sampled.numel():
            buf = self._token_buffers[self._turn] = torch.empty(max(sampled.numel(), self.config.max_num_seqs),
                                                                dtype=torch.int64, pin_memory=True)
        host = buf[:sampled.numel()]
        host.copy_(sampled, non_blocking=True)
        return host, self.platform.record_event()

    @torch.inference_mode()
    def run(self, inputs: StepInputs, prev_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Forward (and, on rank 0, sampling) for host inputs; every rank runs this. Returns the
        sampled tokens on the device (None on the other ranks)."""
        meta, input_ids, positions, sampling = self._device_inputs(inputs)
        if len(inputs.pending_dst):                    # tokens sampled by the step still in flight
            input_ids.index_copy_(0, inputs.pending_dst_dev, prev_tokens.index_select(0, inputs.pending_src_dev))
        graphed = self.graphs is not None and meta.is_decode and self.graphs.can_run(meta.num_seqs)
        if graphed:
            hidden = self.graphs.run(input_ids, positions, meta)
        else:
            ctx = ForwardContext(meta, self.kv_caches, self.attention, self.scale, self.kv_scales)
            if inputs.mrope_positions is not None:    # images in the step: vision embeddings and MRoPE
                from baton.engine.vision_step import multimodal_step  # (text models never load it)
                mm = multimodal_step(self.model, self.source.hf_config, inputs.image_chunks,
                                     inputs.mrope_positions, self.device)
                hidden = self.model(input_ids, positions, ctx, mm=mm)
            elif self.prefill_graphs is not None and self.prefill_graphs.can_run(input_ids.shape[0]):
                hidden = self.prefill_graphs.run(input_ids, positions, ctx)   # all but attention replayed
            else:
                hidden = self.model(input_ids, positions, ctx)
        hidden, aux = self._split_aux(hidden)
        if aux is not None:                            # the head's pass runs once the step's tokens are drawn
            inputs.head_args = (meta, positions, aux, graphed)
        step_lp = StepLogprobs() if inputs.num_logprobs >= 0 or inputs.prompt_logprob_rows else None
        if inputs.prompt_logprob_rows:                 # (every rank: the LM head may gather across them;
            prompt_logprobs(hidden, self.model.compute_logits, inputs.prompt_logprob_rows, step_lp)  # and a
        inputs.logprobs_dev = step_lp                  # prompt's earlier chunks sample nothing)
        if not len(inputs.rows):
            return None
        if inputs.logit_rows is not None:
            picked = hidden[inputs.logit_rows_dev]
        else:                                          # every item samples, at its last token
            picked = hidden[meta.query_start_loc[1:].long() - 1]
        logits = self.model.compute_logits(picked)
        if self.tp_rank != 0:                          # the LM head's gather was the last collective
            return None
        if inputs.constrained:                         # the engine calls sample() with the masks
            inputs.deferred = (logits, sampling, input_ids)
            return None
        return self._sample(inputs, logits, sampling, input_ids)

    def _sample(self, inputs: StepInputs, logits: torch.Tensor, sampling: SamplingBatch, input_ids: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        raw = log_softmax(logits) if inputs.num_logprobs >= 0 else None     # of the raw logits, as vLLM
        if inputs.processing_dev is not None:          # penalties, biases, min_tokens, min_p
            if mask is not None:                       # (of the allowed tokens: structured output's mask first)
                logits, mask = apply_token_bitmask(logits, mask), None
            logits = apply_logits_processing(logits, inputs.processing_dev, sampling.temperatures, input_ids)
        sampled = self.sampler(logits, sampling, mask)     # (the mask, if any, read in the sampling pass)
        if inputs.draft_checks is not None:           # drafts drawn from a distribution: rejection sampling
            sampled = self.drafts.reject(logits, sampling, sampled, inputs.draft_checks)
        if raw is not None:
            sampled_logprobs(raw, sampled, inputs.num_logprobs, inputs.logprobs_dev)
        return sampled

    def step_inputs(self, out: SchedulerOutput, prev: LaunchedStep | None = None) -> StepInputs:
        """The step's inputs as small numpy arrays: what the device needs, and what rank 0
        sends to the other tensor-parallel ranks. Rows of one token (decodes) come first, so a
        mixed step's attention can run them through the decode kernel."""
        inputs = self._row_inputs(out, prev) if self._as_rows(out) else self._step_inputs(out, prev)
        if self.drafts is not None:
            inputs.draft_checks = self.drafts.checks(out, inputs.sample_items)
            inputs.head_full = self.drafts.wants_states(out)
        return inputs

    def _step_inputs(self, out: SchedulerOutput, prev: LaunchedStep | None) -> StepInputs:
        bs = self.block_size
        order = list(range(len(out.scheduled))) if out.is_decode else \
            sorted(range(len(out.scheduled)), key=lambda i: out.scheduled[i].num_new_tokens != 1)
        items = [out.scheduled[i] for i in order]
        counts = np.fromiter((item.num_new_tokens for item in items), np.int64, len(items))
        begins = np.fromiter((item.seq.num_computed_tokens for item in items), np.int64, len(items))
        ends = begins + counts
        starts = np.zeros(len(items) + 1, np.int32)
        np.cumsum(counts, out=starts[1:])
        width = max(len(item.seq.block_table) for item in items)
        tables = np.full((len(items), width), -1, np.int32)
        input_ids: list[int] = []
        for i, item in enumerate(items):
            seq = item.seq
            tables[i, :len(seq.block_table)] = seq.block_table
            input_ids += seq.token_ids[begins[i]:ends[i] - len(item.draft)] + item.draft
        if out.is_decode:                                  # one token each: no per-token loop
            positions = begins
        else:
            positions = np.concatenate([np.arange(b, e) for b, e in zip(begins, ends, strict=True)])
        token_rows = np.repeat(np.arange(len(items)), counts)
        slots = tables[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        positions, mrope, image_chunks = step_positions(items, begins, ends, positions, starts, out.is_decode)
        ids = np.asarray(input_ids, np.int64)
        pending_dst = np.flatnonzero(ids == PENDING)
        pending_src = _rows_in(prev, [items[r].seq.seq_id for r in token_rows[pending_dst]])
        rows = np.array([i for i, item in enumerate(items) if item.samples], np.int64)
        logit_rows = None
        sample_positions = [items[r].seq.num_tokens for r in rows.tolist()]
        if any(items[r].draft for r in rows.tolist()):
            # a verified step: a token is sampled at the last real token and after each guess
            per_row = [len(items[r].draft) + 1 for r in rows.tolist()]
            logit_rows = np.concatenate([np.arange(starts[r + 1] - n, starts[r + 1]) for r, n in zip(rows, per_row,
                                                                                                   strict=True)])
            sample_positions = [p + j for p, n in zip(sample_positions, per_row, strict=True) for j in range(n)]
            rows = np.repeat(rows, per_row)
        elif len(rows) < len(items):                       # some items sample nothing (a prompt's earlier chunk)
            logit_rows = (starts[1:] - 1)[rows].astype(np.int64)
        seqs = [items[r].seq for r in rows.tolist()]
        params = [q.params for q in seqs]
        wanted = [p.logprobs for p in params]
        if self.head is not None:       # the head's pass: each row's next token, and where tokens are drawn
            # (a decode step draws every row's next token: all filled in on the device)
            next_ids = np.zeros_like(ids) if out.is_decode and len(rows) == len(items) else \
                _next_ids(ids, starts, items, ends)
            sample_logit_rows = logit_rows if logit_rows is not None else (starts[1:] - 1)[rows].astype(np.int64)
        else:
            next_ids = sample_logit_rows = None
        return StepInputs(
            is_decode=out.is_decode, input_ids=ids, positions=positions, slots=slots,
            query_starts=starts, seq_lens=ends.astype(np.int32), block_tables=tables,
            max_query_len=int(counts.max()), has_context=bool((begins > 0).any()), rows=rows,
            sample_items=np.array([order[r] for r in rows.tolist()], np.int64),
            num_decode_rows=len(items) if out.is_decode else int(np.argmax(counts != 1)),
            temperatures=np.array([p.temperature for p in params], np.float32),
            top_ks=np.array([p.top_k for p in params], np.int64),
            top_ps=np.array([p.top_p for p in params], np.float32),
            seeds=np.array([_signed64(q.sampling_seed or 0) for q in seqs], np.int64),
            has_seed=np.array([q.sampling_seed is not None for q in seqs], np.bool_),
            sample_positions=np.array(sample_positions, np.int64),
            pending_dst=pending_dst.astype(np.int64), pending_src=pending_src,
            mrope_positions=mrope, image_chunks=image_chunks, logit_rows=logit_rows,
            processing=host_inputs(seqs, [int(starts[r] - begins[r]) for r in rows.tolist()], self.eos_token_ids),
            num_logprobs=max((n for n in wanted if n is not None), default=-1), wanted_logprobs=wanted,
            constrained=any(p.structured is not None for p in params),
            prompt_logprob_rows=None if out.is_decode else _prompt_logprob_rows(items, order, begins, ends, starts),
            next_ids=next_ids, sample_logit_rows=sample_logit_rows,
        )

    def _as_rows(self, out: SchedulerOutput) -> bool:
        """Run the step as decode rows, one per token (`_row_inputs`): a step verifying guesses, and,
        where the platform's decode graphs can replay all its rows (CUDA), a step with short prompt chunks (each ending within
        ROWS_PROMPT_CONTEXT tokens), whose eager forward costs the host far more than the device (~25 ms
        against ~1 ms of kernels for a 135M model on an H100: a Triton launch per op per layer). Requests
        with penalties, logprobs, prompt logprobs, a grammar or images take the generic path, as does
        every prompt chunk under --deterministic (its rows must not depend on the step) or a draft head."""
        items = out.scheduled
        if out.is_decode or not all(_row_ready(item) for item in items):     # (is_decode: no guesses either)
            return False
        chunks = [item for item in items if not _is_last_token(item)]
        if not chunks:
            return any(item.draft for item in items)           # plain decode steps: the generic path
        if self.head is not None or self.config.deterministic \
                or any(item.draft or item.seq.num_computed_tokens + item.num_new_tokens > ROWS_PROMPT_CONTEXT
                       for item in chunks):
            return False
        rows = sum(item.num_new_tokens for item in items)
        graphed = self.platform.graphs_take_prompt_rows and self.graphs is not None and self.graphs.can_run(rows)
        return self.eager_prompt_rows or graphed

    def _row_inputs(self, out: SchedulerOutput, prev: LaunchedStep | None) -> StepInputs:
        """A step as a decode step of one row per token: each row attends to its sequence's context up
        to itself (its own length over the sequence's block table; the step's keys are stored before any
        row attends), so the decode graphs and kernels serve it, with no padding. A verifying sequence
        samples at every row (after its last token and after each guess), a prompt's last chunk at its
        last row, an earlier chunk nowhere. A last token still being sampled by `prev` (scheduled past
        its guesses, as if they all held) is taken from its tokens on the device."""
        bs, items = self.block_size, out.scheduled
        n = len(items)
        counts = np.fromiter((item.num_new_tokens for item in items), np.int64, n)
        begins = np.fromiter((item.seq.num_computed_tokens for item in items), np.int64, n)
        tables = np.full((n, max(len(item.seq.block_table) for item in items)), -1, np.int32)
        ids: list[int] = []
        sampled = np.zeros(int(counts.sum()), np.bool_)
        starts = np.zeros(n + 1, np.int64)
        np.cumsum(counts, out=starts[1:])
        for i, item in enumerate(items):
            seq, b, e = item.seq, int(begins[i]), int(begins[i] + counts[i])
            tables[i, :len(seq.block_table)] = seq.block_table
            ids += seq.token_ids[b:e - len(item.draft)] + item.draft
            if item.samples:
                sampled[starts[i + 1] - 1 - len(item.draft):starts[i + 1]] = True
        seq_of = np.repeat(np.arange(n), counts)                       # each row's scheduled item
        total = len(seq_of)
        positions = begins[seq_of] + np.arange(total) - starts[seq_of]
        row_tables = tables[seq_of]
        slots = row_tables[np.arange(total), positions // bs].astype(np.int64) * bs + positions % bs
        rows = np.flatnonzero(sampled)
        seqs = [items[r].seq for r in seq_of[rows].tolist()]
        params = [q.params for q in seqs]
        input_ids = np.asarray(ids, np.int64)
        pending_dst = np.flatnonzero(input_ids == PENDING)
        pending_src = _rows_in(prev, [items[r].seq.seq_id for r in seq_of[pending_dst].tolist()])
        return StepInputs(
            is_decode=True, input_ids=input_ids, positions=positions, slots=slots,
            query_starts=np.arange(total + 1, dtype=np.int32), seq_lens=(positions + 1).astype(np.int32),
            block_tables=row_tables, max_query_len=1, has_context=True, rows=rows,
            logit_rows=None if len(rows) == total else rows,       # (None: every row's)
            sample_items=seq_of[rows], num_decode_rows=total,
            temperatures=np.array([p.temperature for p in params], np.float32),
            top_ks=np.array([p.top_k for p in params], np.int64),
            top_ps=np.array([p.top_p for p in params], np.float32),
            seeds=np.array([_signed64(q.sampling_seed or 0) for q in seqs], np.int64),
            has_seed=np.array([q.sampling_seed is not None for q in seqs], np.bool_),
            sample_positions=positions[rows] + 1, pending_dst=pending_dst.astype(np.int64), pending_src=pending_src,
            next_ids=np.zeros(total, np.int64), sample_logit_rows=rows)

    def _device_inputs(self, h: StepInputs) -> tuple[AttnMetadata, torch.Tensor, torch.Tensor, SamplingBatch]:
        """Everything to the device in one copy (HostUpload)."""
        # (the sampled rows' indices too, when not every row samples: a pageable copy would wait for the device)
        rows = (h.logit_rows,) if h.logit_rows is not None else ()
        extra = h.processing.arrays() if h.processing is not None else ()
        (ids, pos, slots, starts, lens, tables, temperatures, top_ks, top_ps, seeds, has_seed, sample_pos,
         h.pending_dst_dev, h.pending_src_dev, *processing) = self.upload(
            h.input_ids, h.positions, h.slots, h.query_starts, h.seq_lens, h.block_tables, h.temperatures, h.top_ks,
            h.top_ps, h.seeds, h.has_seed, h.sample_positions, h.pending_dst, h.pending_src, *rows, *extra)
        if rows:
            h.logit_rows_dev, *processing = processing
        h.processing_dev = to_device(processing) if processing else None
        seq_lens = h.seq_lens.tolist()
        meta = AttnMetadata(
            is_decode=h.is_decode, slot_mapping=slots, query_start_loc=starts, seq_lens=lens, block_tables=tables,
            max_query_len=h.max_query_len, max_seq_len=max(seq_lens), has_context=h.has_context,
            query_start_loc_cpu=h.query_starts.tolist(), seq_lens_cpu=seq_lens, num_decode_rows=h.num_decode_rows,
        )
        sampling = SamplingBatch(
            temperatures=temperatures, top_ks=top_ks, top_ps=top_ps, seeds=seeds, has_seed=has_seed,
            positions=sample_pos, all_greedy=bool((h.temperatures == 0).all()),
            any_greedy=bool((h.temperatures == 0).any()), any_top_k=bool((h.top_ks > 0).any()),
            any_top_p=bool((h.top_ps < 1.0).any()), any_seed=bool(h.has_seed.any()),
        )
        return meta, ids, pos, sampling


def _row_ready(item) -> bool:
    """Can this item's tokens run as decode rows: no penalties, logprobs, prompt logprobs, grammar
    or images (the generic path serves those: a chunk of tokens per sequence)."""
    p = item.seq.params
    return not p.processes_logits and p.logprobs is None and p.prompt_logprobs is None and p.structured is None \
        and item.seq.mm is None


def _is_last_token(item) -> bool:
    """A decode item: the sequence's last token (and its guesses, if any)."""
    return item.num_new_tokens == 1 + len(item.draft) and item.seq.num_computed_tokens == item.seq.num_tokens - 1


def _rows_in(prev: LaunchedStep | None, seq_ids: list[int]) -> np.ndarray:
    """The rows of `prev`'s sampled tokens that hold these sequences' pending tokens."""
    if not seq_ids:
        return np.zeros(0, np.int64)
    if prev is None:
        raise RuntimeError("a scheduled token is still pending but no step in flight sampled it")
    where = prev.row_of()
    return np.array([where[s] for s in seq_ids], np.int64)


def _prompt_logprob_rows(items, order, begins, ends, starts) -> list[PromptLogprobRows]:
    """The prompt chunks of this step whose sequences asked for prompt logprobs: each position
    scores the prompt's next token (the last prompt position scores none: its token is sampled)."""
    rows = []
    for i, item in enumerate(items):
        seq = item.seq
        n = seq.params.prompt_logprobs
        end = min(int(ends[i]), seq.num_prompt_tokens - 1)
        if n is None or end <= begins[i]:
            continue
        count = end - int(begins[i])
        rows.append(PromptLogprobRows(order[i], np.arange(starts[i], starts[i] + count, dtype=np.int64),
                                      np.asarray(seq.token_ids[begins[i] + 1:end + 1], np.int64), int(begins[i]) + 1, n))
    return rows


def _next_ids(ids: np.ndarray, starts: np.ndarray, items, ends: np.ndarray) -> np.ndarray:
    """The token after each input row: the next row's, at a chunk's end the next prompt token (0 where
    the step draws it: filled in on the device)."""
    nxt = np.zeros_like(ids)
    nxt[:-1] = ids[1:]
    for i, item in enumerate(items):
        nxt[starts[i + 1] - 1] = 0 if item.samples else item.seq.token_ids[ends[i]]
    return nxt


def _signed64(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x
