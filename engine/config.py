"""The engine's one config object: validated once, shared by the offline API and the services."""
from __future__ import annotations

from dataclasses import dataclass

from baton.engine.requests.policies import DEFAULT_SCHEDULING_POLICY, SCHEDULING_POLICIES
from baton.models.cache import cache_root

DEFAULT_MODEL = "smollm2-135m-instruct"
SPECULATIVE_METHODS = ("ngram", "eagle3")   # engine/speculative.py
DETERMINISTIC_MAX_TP = 2                # engine/batch_invariant.py: an all-reduce of two is one addition
NPU_GRAPH_MODES = ("aclgraph", "torchair")
QUANTIZATION_METHODS = ("fp8", "w8a8")  # models/layers/quantization.py
KV_CACHE_DTYPES = ("auto", "fp8")       # auto: the model dtype; fp8: float8 e4m3 (engine/platforms/base.py)
KV_CACHE_SCALES = ("calibrate", "one")  # a float8 cache's per-head K/V scales (engine/kv_scales.py)
FP8_ROUNDINGS = ("nearest", "gptq")     # how --quantization fp8 rounds weights (engine/fp8_rounding.py)
FP8_ACCUMULATIONS = ("fp32", "fast")    # FP8 GEMMs' sums on CUDA: promoted to float32, or the tensor cores' own
EP_DISPATCHES = ("allreduce", "alltoall")   # how expert-parallel ranks reach their experts (models/layers/expert_parallel.py)
# the tensor-parallel all-reduce (models/layers/custom_all_reduce.py); symm-unfused: symm without the all-reduce
# fused into the RMSNorm after it (models/layers/all_reduce_norm.py), each its own kernel
ALL_REDUCES = ("auto", "nccl", "symm", "symm-unfused")


@dataclass(frozen=True, slots=True)
class PlatformOptions:
    """The engine knobs a platform reads (engine/platforms)."""
    fused_ops: bool = True
    npu_graph_mode: str = "aclgraph"
    graph_cache_dir: str | None = None
    npu_emulation: bool = False


PLATFORM = PlatformOptions()            # the defaults EngineConfig shares with it


@dataclass(slots=True)
class EngineConfig:
    model: str = DEFAULT_MODEL          # preset name, HF directory, .gguf file or Hub name (ORG/NAME)
    revision: str | None = None         # a Hub model's branch, tag or commit; None = main
    device: str = "cpu"                 # cpu | cuda:N | npu:N
    dtype: str | None = None            # float32 | bfloat16 | float16; None = platform default
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None    # None = the model's context length (capped by KV capacity)
    num_kv_blocks: int | None = None    # exact KV cache size; overrides the memory budget
    kv_cache_memory: int | None = None  # bytes for the KV cache; None = platform default
    gpu_memory_utilization: float = 0.90
    enable_prefix_caching: bool = True
    kv_offloading_size: float = 0.0     # GiB of host memory for blocks the prefix cache evicts (0: none)
    kv_checksum: str = "auto"           # landed KV's checksum checked: on | off | auto (on a CPU engine only)
    enforce_eager: bool = False         # no graph capture
    prefill_graphs: bool = True         # prefill and mixed steps replayed piecewise (engine/prefill_graphs.py)
    seed: int = 0                       # random weights for presets and unseeded sampling
    tp_size: int = 1                    # tensor-parallel ranks (processes), one device each
    tp_devices: str | None = None       # "cuda:0,cuda:1"; default: counted up from `device`
    tp_port: int = 0                    # rendezvous port on 127.0.0.1; 0 = a free one
    context_parallel_size: int = 1      # ranks that split each prefill step's tokens (engine/runner/context_parallel.py)
    enable_expert_parallel: bool = False    # MoE layers: each rank holds E/tp_size whole experts, not a slice of each
    expert_parallel_dispatch: str = "allreduce"   # allreduce (graph-safe) | alltoall (eager): EP_DISPATCHES
    ep_redundant_experts: int = 0       # a second copy of the K hottest experts (of ep_expert_load), K/tp_size a rank
    ep_expert_load: str | None = None   # JSON load profile {"tokens_per_expert": [...]} picking them
    all_reduce: str = "auto"            # nccl: torch.distributed's; symm: one-shot over CUDA symmetric memory, fused with
    #                                     the RMSNorm after it; auto: symm where it runs
    tokenizer: str | None = None        # tokenizer directory; None = the model's (presets: the embedded one's)
    cache_dir: str | None = None        # converted models, compiled graphs; None = ~/.cache/baton
    fused_ops: bool = PLATFORM.fused_ops        # fused layer kernels (Triton on CUDA, torch_npu on Ascend)
    npu_graph_mode: str = PLATFORM.npu_graph_mode   # aclgraph | torchair
    npu_emulation: bool = PLATFORM.npu_emulation    # TEST ONLY: npu:N is the host CPU running the documented op semantics
    async_scheduling: bool | None = None   # schedule step N+1 while step N runs; None: on accelerators
    generation_config: str = "auto"     # sampling defaults: auto (the model's generation_config.json) | none | DIR
    deterministic: bool = False         # a request's tokens independent of its batch (engine/batch_invariant.py)
    speculative_method: str | None = None   # ngram | eagle3: guess tokens, verify them in one step (engine/speculative.py)
    speculative_model: str | None = None    # eagle3: the draft head's directory (config.json + safetensors)
    num_speculative_tokens: int | None = None   # most guesses per sequence and step; None: 16 (ngram), 4 (eagle3)
    speculative_max_batch: int = 32     # speculate only while at most this many sequences run
    scheduling_policy: str = DEFAULT_SCHEDULING_POLICY   # fcfs | priority: which waiting request runs next
    quantization: str | None = None     # fp8 | w8a8 (int8, Ascend and CPU); None = the checkpoint's
    kv_cache_dtype: str = "auto"        # auto: the model dtype; fp8: e4m3, half the bytes of bf16 per token
    kv_cache_scales: str = "calibrate"  # fp8 cache: the checkpoint's k/v scales, else calibrated at load | one
    fp8_rounding: str = "nearest"       # --quantization fp8's weights: to nearest, or GPTQ's error feedback
    fp8_accumulation: str = "fast"      # FP8 GEMMs on CUDA: the tensor cores' own sums (vLLM's), or fp32

    @property
    def num_ranks(self) -> int:
        """Processes (one device each) the engine runs in lockstep: tensor- or context-parallel ranks."""
        return self.tp_size * self.context_parallel_size

    @property
    def expert_parallel(self) -> str | None:
        """The expert-parallel dispatch the MoE layers use; None: experts tensor-parallel."""
        return self.expert_parallel_dispatch if self.enable_expert_parallel else None

    def _validate_expert_parallel(self) -> None:
        if self.expert_parallel_dispatch not in EP_DISPATCHES:
            raise ValueError(f"expert_parallel_dispatch must be one of {', '.join(EP_DISPATCHES)}, "
                             f"got {self.expert_parallel_dispatch!r}")
        if self.ep_redundant_experts and not (self.enable_expert_parallel and self.ep_expert_load
                                              and self.ep_redundant_experts > 0
                                              and self.ep_redundant_experts % self.tp_size == 0):
            raise ValueError(f"--ep-redundant-experts {self.ep_redundant_experts} copies the hottest experts of "
                             "--ep-expert-load's profile under --enable-expert-parallel, the same number on each "
                             f"rank: give all three, with a multiple of --tp-size ({self.tp_size})")
        if not self.enable_expert_parallel:
            return
        if self.tp_size < 2:
            raise ValueError("--enable-expert-parallel splits the experts over the tensor-parallel ranks: it needs "
                             f"--tp-size 2 or more, got {self.tp_size}")
        if self.device.startswith("npu"):
            raise ValueError("--enable-expert-parallel is not built for Ascend yet (its grouped-matmul MoE has no "
                             "path for another rank's experts): serve without it")
        if self.quantization == "w8a8" or self.deterministic:
            raise ValueError("--enable-expert-parallel is built for bf16/fp16/fp32 and --quantization fp8 experts, "
                             "not w8a8 or --deterministic")

    @property
    def speculative_tokens(self) -> int:
        """The most guesses a sequence makes in a step: --num-speculative-tokens, else 16 for n-gram
        lookup (a guess costs nothing to make, and a small batch verifies 17 rows for what 1 costs;
        GUESS_ROWS shortens them as the batch grows) and 4 for a draft head (each guess is a pass of
        the head)."""
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        return 4 if self.speculative_method == "eagle3" else 16

    def _validate_all_reduce(self) -> None:
        if self.all_reduce not in ALL_REDUCES:
            raise ValueError(f"all_reduce must be one of {', '.join(ALL_REDUCES)}, got {self.all_reduce!r}")
        if not self.all_reduce.startswith("symm"):
            return
        if not self.device.startswith("cuda"):
            raise ValueError(f"--all-reduce symm maps the ranks' memory into each other over CUDA peer access; the "
                             f"ranks here are on {self.device}: use --all-reduce auto or nccl")
        if self.tp_size not in (2, 4, 8):
            raise ValueError(f"--all-reduce symm is built for --tp-size 2, 4 or 8, got {self.tp_size}: use "
                             "--all-reduce auto or nccl")
        if self.deterministic:
            raise ValueError("--deterministic keeps NCCL's fixed reduction: use --all-reduce auto or nccl with it")

    def _validate_draft_head(self) -> None:
        eagle = self.speculative_method == "eagle3"
        if eagle != (self.speculative_model is not None):
            raise ValueError("--speculative-model names the draft head of --speculative-method eagle3, and that "
                             "method needs one" if eagle else
                             "--speculative-model is only for --speculative-method eagle3")
        if eagle and self.tp_size > 1:
            raise ValueError("--speculative-method eagle3 runs on one rank for now (--tensor-parallel-size 1)")
        if eagle and self.kv_cache_dtype != "auto":
            raise ValueError("--speculative-method eagle3 keeps its head's KV in the model's dtype for now "
                             "(--kv-cache-dtype auto)")

    def _validate_context_parallel(self) -> None:
        cp = self.context_parallel_size
        if cp < 1:
            raise ValueError(f"context_parallel_size must be >= 1, got {cp}")
        if cp == 1:
            return
        if self.tp_size > 1:
            raise ValueError(f"--context-parallel-size {cp} with --tensor-parallel-size {self.tp_size}: context "
                             "parallelism keeps the full weights on every rank and is not combined with tensor "
                             "parallelism yet (pick one)")
        for on, flag in ((self.speculative_method == "eagle3", "--speculative-method eagle3"),
                         (self.kv_offloading_size > 0, "--kv-offloading-size"),
                         (self.deterministic, "--deterministic"),
                         (self.async_scheduling is True, "--async-scheduling")):
            if on:
                raise ValueError(f"--context-parallel-size {cp} does not combine with {flag} yet (every rank keeps a "
                                 "full, identical KV cache and runs each step from rank 0's host inputs; that option breaks one or the "
                                 "other)")

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(f"max_num_batched_tokens must be >= block_size, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_offloading_size < 0 or (self.kv_offloading_size and self.tp_size > 1):
            raise ValueError("--kv-offloading-size must be >= 0 GiB, and is not built for --tp-size > 1 yet (each "
                             f"rank would need the same copies), got {self.kv_offloading_size} with tp {self.tp_size}")
        if self.async_scheduling is True and self.tp_size > 1 and self.speculative_method is not None:
            raise ValueError("--async-scheduling with --tp-size > 1 and speculative decoding: the other ranks would "
                             "need the verified guesses of a step not yet back; leave --async-scheduling unset")
        if self.kv_checksum not in ("auto", "on", "off"):
            raise ValueError(f"--kv-checksum must be auto, on or off, got {self.kv_checksum!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.05 <= self.gpu_memory_utilization <= 0.99:
            raise ValueError(f"gpu_memory_utilization must be in [0.05, 0.99], got {self.gpu_memory_utilization}")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        self._validate_context_parallel()
        if not 0 <= self.tp_port < 65536:
            raise ValueError(f"tp_port must be in [0, 65535], got {self.tp_port}")
        if self.speculative_method is not None:
            if self.speculative_method not in SPECULATIVE_METHODS:
                raise ValueError(f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)} (or unset), "
                                 f"got {self.speculative_method!r}")
            if self.num_speculative_tokens is not None and not 1 <= self.num_speculative_tokens <= 16:
                raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
            if self.speculative_max_batch < 1:
                raise ValueError(f"speculative_max_batch must be >= 1, got {self.speculative_max_batch}")
        self._validate_draft_head()
        self._validate_expert_parallel()
        self._validate_all_reduce()
        if self.deterministic and self.tp_size > DETERMINISTIC_MAX_TP:
            raise ValueError(f"--deterministic takes at most {DETERMINISTIC_MAX_TP} tensor-parallel ranks (an "
                             f"all-reduce of more sums in an order NCCL picks by message size), got "
                             f"--tensor-parallel-size {self.tp_size}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        if self.quantization is not None:
            if self.quantization not in QUANTIZATION_METHODS:
                raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or unset), "
                                 f"got {self.quantization!r}")
            if self.deterministic:
                raise ValueError("--deterministic does not cover quantized matmuls (their per-token scales are "
                                 "batch-independent, but the scaled GEMM's tiling is not fixed): serve without one "
                                 "of --deterministic, --quantization")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.fp8_rounding not in FP8_ROUNDINGS:
            raise ValueError(f"fp8_rounding must be one of {', '.join(FP8_ROUNDINGS)}, got {self.fp8_rounding!r}")
        if self.fp8_rounding != "nearest" and self.quantization != "fp8":
            raise ValueError(f"--fp8-rounding {self.fp8_rounding} rounds the weights --quantization fp8 quantizes at "
                             f"load: add --quantization fp8 (got --quantization {self.quantization})")
        if self.fp8_accumulation not in FP8_ACCUMULATIONS:
            raise ValueError(f"fp8_accumulation must be one of {', '.join(FP8_ACCUMULATIONS)}, "
                             f"got {self.fp8_accumulation!r}")
        if self.kv_cache_scales not in KV_CACHE_SCALES:
            raise ValueError(f"kv_cache_scales must be one of {', '.join(KV_CACHE_SCALES)}, got {self.kv_cache_scales!r}")
        if self.npu_graph_mode not in NPU_GRAPH_MODES:
            raise ValueError(f"npu_graph_mode must be one of {', '.join(NPU_GRAPH_MODES)}, got {self.npu_graph_mode!r}")

    def platform_options(self) -> PlatformOptions:
        return PlatformOptions(fused_ops=self.fused_ops, npu_graph_mode=self.npu_graph_mode,
                               graph_cache_dir=str(cache_root(self.cache_dir) / "torchair"),
                               npu_emulation=self.npu_emulation)
