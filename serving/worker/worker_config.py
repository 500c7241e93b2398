"""One config object for a worker process (prefill, decode or colocated): server + engine.

Built once from flags (each with its BATON_* twin, serving/options.py), validated once; a
flag's default is its config field's (serving/options.defaults). Torch-free, so
`baton prefill --help` answers at once.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from baton import environment
from baton.engine.config import (
    ALL_REDUCES,
    EP_DISPATCHES,
    FP8_ACCUMULATIONS,
    FP8_ROUNDINGS,
    KV_CACHE_DTYPES,
    KV_CACHE_SCALES,
    NPU_GRAPH_MODES,
    QUANTIZATION_METHODS,
    SCHEDULING_POLICIES,
    SPECULATIVE_METHODS,
    EngineConfig,
)
from baton.kvtransfer import registry
from baton.kvtransfer.peer_auth import load_secret
from baton.serving.options import defaults, flag, parser, port_clash
from baton.serving.processes import WILDCARD_HOSTS
from baton.serving.server_config import DEFAULT_PORTS, ROLES, ServerConfig, add_common_args, server_settings

KV_BACKENDS = (*registry.NAMES, registry.AUTO)


@dataclass(slots=True)
class WorkerConfig(ServerConfig):
    role: str
    port: int = 0
    kv_backend: str = registry.DEFAULT
    max_waiting: int = 1024             # queued requests beyond this are refused: RESOURCE_EXHAUSTED
    kv_advertise: str | None = None     # KV address prefill workers are told to push to (default: ours)
    advertise_host: str | None = None   # the host peers reach us at (default: serving/processes.reachable_host)
    kv_secret: bytes | None = None      # KV peers must prove it in the handshake (kvtransfer/peer_auth.py)
    kv_options: dict = field(default_factory=dict)   # the KV backends' own flags, by dest (kvtransfer/registry.py)
    gil_switch_ms: float | None = None  # sys.setswitchinterval for the engine thread and event loop
    engine_process: bool | None = None  # the engine core in its own process (None: unless the KV backend is in-process)
    engine_hang_timeout: float = 30.0   # a core silent, or this long past its step's budget, is hung: the worker ends
    kv_port: int = 0                    # decode: where the core's KV services listen (0: a free port)
    decode_prefix_reuse: bool = True    # decode: a prompt's prefix cached here is not sent again by the prefill
    engine_core: str = ""               # "module:Class" of the engine core (unset: the role's own)
    fault_hooks: bool = False           # tests: SIGUSR1 holds the core's next step until SIGUSR2 (a hang inside a step)
    engine: EngineConfig = field(default_factory=EngineConfig)

    def validate(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")
        if self.kv_backend not in KV_BACKENDS:
            raise ValueError(f"--kv-backend must be one of {', '.join(KV_BACKENDS)}, got {self.kv_backend!r}")
        registry.check_options(self.kv_options)
        if self.gil_switch_ms is not None and self.gil_switch_ms <= 0:
            raise ValueError(f"--gil-switch-ms must be > 0, got {self.gil_switch_ms:g}")
        clash = port_clash([(self.port, "--port (gRPC)"), (self.metrics_port or 0, "--metrics-port"),
                            (self.kv_port, "--kv-port")])
        if clash:
            raise ValueError(clash)
        kv = registry.SPECS.get(self.kv_backend)
        if kv is not None and not kv.available():
            raise ValueError(f"--kv-backend {self.kv_backend} needs the {kv.requires!r} package, which is not "
                             f"installed here: pip install 'baton[{kv.name}]' (or pick another --kv-backend)")
        if self.engine_hang_timeout < 0 or not 0 <= self.kv_port < 65536:
            raise ValueError("--engine-hang-timeout must be >= 0 (0: never) and --kv-port in [0, 65535]")
        in_process = kv is not None and kv.in_process
        if self.engine_process is None:
            self.engine_process = not in_process
        if self.engine_process and in_process:
            raise ValueError(f"--kv-backend {self.kv_backend} hands KV over inside one process: run it with "
                             "--no-engine-process")
        if self.engine.tp_size > 1 and self.role != "colocated":
            raise ValueError(f"--tp-size {self.engine.tp_size} on a {self.role} worker: KV transfer moves one "
                             "rank's cache, so disaggregated roles run with tp_size 1 for now (use --role colocated, "
                             "or one worker per device)")
        if self.engine.context_parallel_size > 1 and self.role == "decode":
            raise ValueError(f"--context-parallel-size {self.engine.context_parallel_size} on a decode worker: "
                             "landed KV reaches rank 0's cache only, and context parallelism speeds up prefill; "
                             "use it on prefill or colocated workers")
        if self.advertise_host is not None and self.advertise_host in WILDCARD_HOSTS:
            raise ValueError(f"--advertise-host {self.advertise_host!r} is a wildcard, which no peer can dial; give "
                             "this worker's name or IP as its peers see it (or leave it unset: the container's IP)")
        if self.kv_advertise is not None and self.kv_advertise.rpartition(":")[0] in WILDCARD_HOSTS:
            raise ValueError(f"--kv-advertise {self.kv_advertise!r} must be HOST:PORT with a host prefill workers "
                             "can dial, not a wildcard")
        self.tls.validate()
        self.engine.validate()


def add_engine_args(p: argparse.ArgumentParser) -> None:
    e = defaults(EngineConfig)
    g = p.add_argument_group("engine")
    flag(g, "--dtype", type=_dtype, choices=(*DTYPE_ALIASES, "float32", "bfloat16", "float16"),
         help="weights and KV dtype: float32, bfloat16, float16 (vLLM's auto, half, float and bf16 too; unset or "
              "auto: the platform's)")
    flag(g, "--block-size", type=int, default=e.block_size, help="tokens per KV block")
    flag(g, "--max-num-seqs", type=int, default=e.max_num_seqs, help="sequences in one batch")
    flag(g, "--max-num-batched-tokens", type=int, default=e.max_num_batched_tokens, help="tokens in one step")
    flag(g, "--max-model-len", type=int, help="context length (unset: the model's, capped by the KV cache); a rope_scaling "
         "(yarn, dynamic, linear) in config.json lets it reach past max_position_embeddings, "
         "e.g. to 131072 for Qwen3 with YaRN factor 4")
    flag(g, "--num-kv-blocks", type=int, help="exact KV cache size in blocks (unset: from the memory budget)")
    flag(g, "--gpu-memory-utilization", type=float, default=e.gpu_memory_utilization,
         help="share of accelerator memory for weights, activations and the KV cache")
    flag(g, "--prefix-caching", "--enable-prefix-caching", type=bool, default=e.enable_prefix_caching,
         help="reuse the KV of prompt prefixes seen before")
    flag(g, "--kv-checksum", choices=("auto", "on", "off"), default=e.kv_checksum,
         help="check a checksum of every byte of KV that lands here before decoding from it (its epoch and size "
              "are always checked): auto = on a CPU engine only, where it costs a fiftieth of a gRPC transfer's time; "
              "on an accelerator it reads the KV again (a fourteenth of a device-direct transfer's) and may join a "
              "request a step later")
    flag(g, "--kv-offloading-size", type=float, default=e.kv_offloading_size,
         help="GiB of host memory that keep the prefix cache's blocks the device evicts, brought back when a "
              "prompt needs them again (a returning conversation pays a copy, not its prefill); 0: off")
    flag(g, "--enforce-eager", type=bool, default=e.enforce_eager, help="no graph capture (decode, and prefill's pieces)")
    flag(g, "--prefill-graphs", type=bool, default=e.prefill_graphs,
         help="replay prefill and mixed steps from graphs of everything but attention (CUDA; "
              "engine/prefill_graphs.py)")
    flag(g, "--async-scheduling", type=bool, default=e.async_scheduling,
         help="schedule and upload step N+1 while step N runs (unset: on accelerators, off on the CPU)")
    flag(g, "--fused-ops", type=bool, default=e.fused_ops, help="fused layer kernels (Triton on CUDA, torch_npu on Ascend)")
    flag(g, "--npu-graph-mode", default=e.npu_graph_mode, choices=NPU_GRAPH_MODES, help="Ascend decode graphs")
    flag(g, "--npu-emulation", type=bool, default=e.npu_emulation, hidden=True,
         help="TEST ONLY: npu:N is the host CPU running the documented torch_npu op semantics")
    flag(g, "--tp-size", "--tensor-parallel-size", "-tp", type=int, default=e.tp_size,
         help="tensor-parallel ranks, one device each (colocated role only, for now)")
    flag(g, "--context-parallel-size", "--cp-size", type=int, default=e.context_parallel_size,
         help="context-parallel ranks, one device each with the full weights and KV cache, that split each "
              "prefill step's tokens; decode steps run on every rank alike (prefill and colocated roles)")
    flag(g, "--tp-devices", help="devices of the ranks, e.g. cuda:0,cuda:1 (unset: counted up from --device)")
    flag(g, "--tp-port", type=int, default=e.tp_port, help="rendezvous port of the ranks on 127.0.0.1 (0: a free one)")
    flag(g, "--all-reduce", choices=ALL_REDUCES, default=e.all_reduce,
         help="the tensor-parallel all-reduce: symm = one kernel per rank reads every rank's partial sums over "
              "NVLink from symmetric memory (torch's one-shot all-reduce), for tensors up to 8 MiB at 2 ranks (4 at "
              "4, 2 at 8), NCCL above (CUDA, 2, 4 or 8 ranks that are peers); in dense decoder layers an all-reduce "
              "followed by an RMSNorm is instead one kernel of Baton's that also adds the residual and normalizes; "
              "symm-unfused = symm without that fusion (torch's one-shot, then add-RMSNorm); nccl = torch.distributed's for all "
              "(NCCL, HCCL on Ascend, gloo on the CPU); auto = symm where it runs (not with --deterministic), else "
              "nccl, the reason logged")
    flag(g, "--enable-expert-parallel", type=bool, default=e.enable_expert_parallel,
         help="MoE models: each tensor-parallel rank holds its share of whole experts instead of a slice of every "
              "expert; attention stays tensor-parallel (needs --tp-size 2 or more; docs/parallelism.md)")
    flag(g, "--expert-parallel-dispatch", choices=EP_DISPATCHES, default=e.expert_parallel_dispatch,
         help="how tokens reach the experts' ranks: allreduce = every rank runs its experts on the replicated "
              "tokens, one all-reduce (decode graphs kept); alltoall = pairs sent to their experts' ranks and back "
              "(eager steps)")
    flag(g, "--ep-redundant-experts", type=int, default=e.ep_redundant_experts,
         help="expert parallelism's load balance: a second copy of the K hottest experts of --ep-expert-load, on "
              "other ranks, their tokens split between the copies (K a multiple of --tp-size; 0: none)")
    flag(g, "--ep-expert-load", help="a load profile, JSON {\"tokens_per_expert\": [...]}, naming the hottest "
         "experts for --ep-redundant-experts (docs/parallelism.md)")
    flag(g, "--seed", type=int, default=e.seed, help="random weights of presets, and unseeded sampling")
    flag(g, "--deterministic", type=bool, default=e.deterministic,
         help="a request's tokens do not depend on its batch, chunking, prefix-cache hits or which worker "
              "computes them (batch-invariant matmuls and attention; migration is bitwise); set it on every "
              "worker of a deployment. Costs speed (docs/benchmarks.md)")
    flag(g, "--speculative-method", choices=SPECULATIVE_METHODS,
         help="speculative decoding: ngram guesses the next tokens from earlier spans of the sequence, eagle3 "
              "drafts them with an EAGLE-3 head (--speculative-model); one step verifies them: greedy tokens are "
              "the ones plain decoding gives, sampled ones keep the model's distribution (unset: off)")
    flag(g, "--speculative-model", metavar="DIR",
         help="eagle3: the draft head's directory (config.json + *.safetensors, as EAGLE-3 checkpoints lay it "
              "out). Give it to the prefill workers too: they run it over the prompt, and its KV and last "
              "hidden state travel with the prompt's")
    flag(g, "--num-speculative-tokens", type=int, default=e.num_speculative_tokens,
         help="most guesses per sequence and step (unset: 16 for ngram, 4 for eagle3, whose every guess is a pass "
              "of its head); a step guesses at most 128 tokens in all, so past 128 / this many running "
              "sequences each guesses fewer (at least one)")
    flag(g, "--speculative-max-batch", type=int, default=e.speculative_max_batch,
         help="speculate only while at most this many sequences run (a full batch has no compute to spare)")
    flag(g, "--scheduling-policy", default=e.scheduling_policy, choices=SCHEDULING_POLICIES,
         help="which waiting request runs next: fcfs (arrival order), or priority (each request's priority, "
              "lower first, as vLLM's; a waiting request may preempt running ones of lower priority). Set it on "
              "every worker; fcfs refuses requests whose priority is not 0")
    flag(g, "--quantization", "-q", choices=QUANTIZATION_METHODS,
         help="fp8: the linear layers' weights quantized to float8 e4m3 at load, one scale per output channel, "
              "activations per token, scaled FP8 GEMMs; a MoE's routed experts too, one scale per expert and "
              "output channel, in the fused expert kernel: FP8 x FP8 (activations per token) at every size "
              "(CUDA compute capability 8.9+; the CPU runs the same numbers; not on Ascend). Unset: what the checkpoint's quantization_config says (fp8 and "
              "compressed-tensors FP8 checkpoints; AWQ and GPTQ INT4 ones, kept packed, which take no flag), else none. w8a8: int8 weights per output channel and int8 "
              "tokens (per-token dynamic scales), int32 accumulation: torch_npu's npu_dynamic_quant + "
              "npu_quant_matmul on Ascend, torch._int_mm on the CPU (not CUDA)")
    flag(g, "--fp8-rounding", default=e.fp8_rounding, choices=FP8_ROUNDINGS,
         help="how --quantization fp8 rounds bf16 weights at load: nearest (each weight to the nearest e4m3 value "
              "of its row's scale), or gptq (the same grid, scales and kernels, each layer's columns rounded in "
              "turn with the error fed forward (GPTQ), calibrated on fixed texts from the Python install (its help "
              "topics and two stdlib modules): each layer's output stays closer; costs a forward per layer at "
              "load, ~160 s for an 8B model on an H100). Workers of one model should agree")
    flag(g, "--fp8-accumulation", default=e.fp8_accumulation, choices=FP8_ACCUMULATIONS,
         help="how FP8 GEMMs sum on CUDA: fp32 (the tensor cores' partial sums added in float32 every 128 "
              "products), or fast (the tensor cores' own sums, as vLLM's FP8 GEMMs on Hopper run: faster, less "
              "precise over a long K)")
    flag(g, "--kv-cache-dtype", default=e.kv_cache_dtype, choices=KV_CACHE_DTYPES,
         help="auto: the KV cache in the model dtype; fp8: float8 e4m3 (K and V scaled per layer and kv head, "
              "saturating), half of bf16's bytes per token in memory and on the wire (CUDA 8.9+ and the CPU; not "
              "on Ascend). Prefill and decode workers must agree: the KV handshake refuses a mismatch")
    flag(g, "--kv-cache-scales", default=e.kv_cache_scales, choices=KV_CACHE_SCALES,
         help="an fp8 KV cache's scales, one for K and one for V per layer and kv head: calibrate (the "
              "checkpoint's k_scale/v_scale where it carries them, else calibrated at load from one forward over "
              "a fixed token sequence: each head's largest |K| and |V| to a quarter of e4m3's range, in powers of "
              "two; the same on every worker of the same model), or one (no scaling). Prefill and decode workers "
              "must agree: the KV handshake compares the scales")


DTYPE_ALIASES = {"auto": None, "half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                 "fp32": "float32"}


def _dtype(value: str) -> str:
    """vLLM's spellings kept as given (the choices check them); engine_dtype maps them."""
    return value.strip().lower()


def engine_dtype(value: str | None) -> str | None:
    return DTYPE_ALIASES.get(value, value) if value else None


def add_worker_args(p: argparse.ArgumentParser, default_port: int) -> None:
    add_common_args(p, default_port)
    flag(p, "--device", default=defaults(EngineConfig).device, help="cpu, cuda:N or npu:N")
    add_engine_args(p)
    w = defaults(WorkerConfig)
    g = p.add_argument_group("serving and KV transfer")
    flag(g, "--kv-backend", default=w.kv_backend, choices=KV_BACKENDS,
         help="KV transport: " + "; ".join(f"{s.name} ({s.summary})" for s in registry.SPECS.values())
              + f"; {registry.AUTO} (every installed backend that needs no setup: "
              + ", ".join(s.name for s in registry.SPECS.values() if s.auto) + "). A decode worker also takes "
              "grpc pushes; the router picks the best backend both workers speak")
    flag(g, "--advertise-host", help="the host name or IP other machines and containers reach this worker at "
                                     "(unset: --host, or for a wildcard --host this machine's own address, the "
                                     "container's or pod's IP)")
    flag(g, "--kv-advertise", help="decode: the HOST:PORT prefill workers push KV to, when not this server's "
                                   "own address (NAT, a separate KV network, a proxy)")
    flag(g, "--kv-secret-file", help="file whose first line is the shared KV secret (>= 16 bytes): prefill and "
                                     "decode workers then accept each other only after a mutual HMAC handshake "
                                     f"({environment.KV_SECRET.name} passes the secret itself)")
    flag(g, "--max-waiting", type=int, default=w.max_waiting, help="requests queued beyond this are refused "
                                                                   "with RESOURCE_EXHAUSTED")
    flag(g, "--gil-switch-ms", type=float, help="Python's thread switch interval (unset: Python's 5 ms)")
    flag(g, "--engine-process", type=bool, help="run the engine core (step loop, device, KV cache and KV transfers) "
         "in a process of its own, apart from the RPCs and token streams (unset: yes, except with --kv-backend "
         f"{' or '.join(registry.IN_PROCESS_BACKENDS)}, which needs one process)")
    flag(g, "--engine-hang-timeout", type=float, default=w.engine_hang_timeout,
         help="seconds the engine core may stay silent (a stopped process), or stay in one step past that step's "
              "budget (its expected cost from the worker's own recent steps x 10, at least 5 s), before the worker "
              "counts it hung and exits, so its streams move elsewhere (0: never)")
    flag(g, "--kv-port", type=int, default=w.kv_port, help="decode: the port the engine core takes KV pushes on "
                                                           "(0: a free one, told to prefill workers at admission)")
    flag(g, "--decode-prefix-reuse", "--disaggregation-decode-enable-radix-cache", type=bool,
         default=w.decode_prefix_reuse,
         help="decode: a prompt's leading blocks this worker's prefix cache holds (an earlier turn of the "
              "conversation, its answer included) are reused, so the prefill worker pushes only the KV after "
              "them; needs --prefix-caching (SGLang's spelling is the second name)")
    flag(g, "--engine-core", default=w.engine_core, hidden=True,
         help="TEST ONLY: the engine core to run, module:Class (unset: the role's own; `baton bench relay` runs a "
              "synthetic token source here)")
    flag(g, "--fault-hooks", type=bool, default=w.fault_hooks, hidden=True,
         help="TEST ONLY: SIGUSR1 to the engine core holds its next model step (inside the step) until SIGUSR2")
    for backend_flag in registry.all_flags():
        flag(g, backend_flag.name, **backend_flag.kwargs)


def build_parser(role: str) -> argparse.ArgumentParser:
    what = {"prefill": "prefill worker", "decode": "decode worker (--colocated: prefill and decode in one)",
            "colocated": "colocated worker"}[role]
    p = parser(f"baton {role}", f"Baton {what}", usage=f"baton {role} [MODEL] [flags]")
    add_worker_args(p, DEFAULT_PORTS[role])
    if role != "prefill":
        flag(p, "--colocated", type=bool, default=False, help="also run prefill here (role colocated)")
        flag(p, "--role", choices=ROLES, default=role,
             help="the role it starts in; a decode worker may switch role in place later (`baton role`), so "
                  "prefill capacity that may become decode capacity starts here as --role prefill")
    return p


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, revision=args.revision, device=args.device, dtype=engine_dtype(args.dtype), block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=args.prefix_caching,
        kv_offloading_size=args.kv_offloading_size, kv_checksum=args.kv_checksum,
        enforce_eager=args.enforce_eager, prefill_graphs=args.prefill_graphs, seed=args.seed, tp_size=args.tp_size,
        tp_devices=args.tp_devices, context_parallel_size=args.context_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        expert_parallel_dispatch=args.expert_parallel_dispatch, ep_redundant_experts=args.ep_redundant_experts,
        ep_expert_load=args.ep_expert_load,
        tp_port=args.tp_port, all_reduce=args.all_reduce, tokenizer=args.tokenizer, cache_dir=args.cache_dir, fused_ops=args.fused_ops,
        npu_graph_mode=args.npu_graph_mode, npu_emulation=args.npu_emulation,
        async_scheduling=args.async_scheduling, deterministic=args.deterministic,
        speculative_method=args.speculative_method, speculative_model=args.speculative_model,
        num_speculative_tokens=args.num_speculative_tokens,
        speculative_max_batch=args.speculative_max_batch, scheduling_policy=args.scheduling_policy,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, kv_cache_scales=args.kv_cache_scales,
        fp8_rounding=args.fp8_rounding, fp8_accumulation=args.fp8_accumulation)


def worker_config_from_args(args: argparse.Namespace, role: str) -> WorkerConfig:
    cfg = WorkerConfig(role=role, **server_settings(args), port=args.port, kv_backend=args.kv_backend,
                       max_waiting=args.max_waiting, kv_advertise=args.kv_advertise, advertise_host=args.advertise_host,
                       kv_secret=load_secret(environment.KV_SECRET.get(), args.kv_secret_file),
                       kv_options={f.dest: getattr(args, f.dest) for f in registry.all_flags()},
                       gil_switch_ms=args.gil_switch_ms,
                       engine_process=args.engine_process, engine_hang_timeout=args.engine_hang_timeout,
                       kv_port=args.kv_port, decode_prefix_reuse=args.decode_prefix_reuse,
                       engine_core=args.engine_core, fault_hooks=args.fault_hooks,
                       engine=engine_config_from_args(args))
    cfg.validate()
    return cfg


def parse_worker_args(role: str, argv: list[str] | None = None) -> WorkerConfig:
    """The config of `baton <role> ...` (the decode parser's --colocated makes it a colocated worker);
    a bad value ends the program with the parser's usage and the reason."""
    p = build_parser(role)
    args = p.parse_args(argv)
    role = "colocated" if getattr(args, "colocated", False) else getattr(args, "role", role)
    try:
        return worker_config_from_args(args, role)
    except ValueError as exc:
        p.error(str(exc))
