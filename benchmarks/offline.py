"""B1 — offline throughput (`baton bench offline`): the nano-vllm workload through Baton's
engine (or, with --engine transformers, through Hugging Face transformers), with a
roofline of every executed step against the device ceilings measured in the same run."""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

from baton.benchmarks import ceilings, flags, record
from baton.benchmarks.model_shape import DTYPE_BYTES, shape_of
from baton.benchmarks.roofline import Ceilings, CostModel, StepShape, roofline_report
from baton.benchmarks.stats import summarize
from baton.benchmarks.workload import OfflineWorkload, nano_vllm_workload, warmup_workload
from baton.engine.config import (
    ALL_REDUCES,
    DEFAULT_MODEL,
    EP_DISPATCHES,
    FP8_ACCUMULATIONS,
    KV_CACHE_DTYPES,
    QUANTIZATION_METHODS,
    EngineConfig,
)

FULL = dict(model="qwen3-0.6b", num_seqs=256, min_input_len=100, max_input_len=1024, min_output_len=100,
            max_output_len=1024, device=None)
SMOKE = dict(model=DEFAULT_MODEL, num_seqs=8, min_input_len=16, max_input_len=64, min_output_len=4,
             max_output_len=8, device="cpu")
ENGINE_KNOBS = ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_kv_blocks",
                "kv_cache_memory", "gpu_memory_utilization", "enforce_eager", "prefill_graphs", "tp_size",
                "tp_devices", "all_reduce", "tokenizer", "async_scheduling", "deterministic", "speculative_method", "num_speculative_tokens",
                "speculative_max_batch", "quantization", "kv_cache_dtype", "fp8_accumulation",
                "enable_expert_parallel", "expert_parallel_dispatch", "ep_redundant_experts", "ep_expert_load")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=("baton", "transformers"), default="baton", help="which engine runs it")
    p.add_argument("--model", default=None, help="preset, HF directory or .gguf (default qwen3-0.6b; "
                   f"smoke: {DEFAULT_MODEL})")
    p.add_argument("--num-seqs", type=int, default=None, help="default 256 (smoke: 8)")
    p.add_argument("--min-input-len", type=int, default=None, help="default 100 (smoke: 16)")
    p.add_argument("--max-input-len", type=int, default=None, help="default 1024 (smoke: 64)")
    p.add_argument("--min-output-len", type=int, default=None, help="default 100 (smoke: 4)")
    p.add_argument("--max-output-len", type=int, default=None, help="default 1024 (smoke: 8)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (nano-vllm: 0)")
    p.add_argument("--temperature", type=float, default=0.6, help="nano-vllm samples at 0.6")
    p.add_argument("--requests", default=None, help="a JSON file {prompts: [[ids]], output_lens: [n]} to run "
                   "instead of nano-vllm's workload (what `bench serve --offline-baseline` writes: its own requests)")
    p.add_argument("--device", default=None, help="cpu, cuda:N, npu:N (default: cuda:0 if present, else cpu)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="default: the platform's (float32 on cpu, bfloat16 on accelerators)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    e = p.add_argument_group("baton engine knobs (EngineConfig)")
    d = EngineConfig()
    flags.tokenizer(e)
    e.add_argument("--block-size", type=int, default=d.block_size, help="KV block size in tokens")
    e.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="sequences per step")
    e.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens, help="tokens per step")
    e.add_argument("--max-model-len", type=int, default=None, help="default: the model's, capped by the KV cache")
    e.add_argument("--num-kv-blocks", type=int, default=None, help="exact KV cache size (default: memory budget)")
    e.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache")
    e.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="share of device memory the engine may use")
    e.add_argument("--enforce-eager", action="store_true", help="no graph capture")
    e.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=d.prefill_graphs,
                   help="prefill and mixed steps replayed piecewise from graphs (CUDA)")
    e.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule step N+1 while step N runs (default: on accelerators)")
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument("--speculative-method", choices=("ngram",), default=None, help="speculative decoding")
    e.add_argument("--num-speculative-tokens", type=int, default=d.num_speculative_tokens)
    e.add_argument("--speculative-max-batch", type=int, default=d.speculative_max_batch)
    e.add_argument("--quantization", choices=QUANTIZATION_METHODS, default=None,
                   help="fp8: FP8 weights; w8a8: int8 weights and tokens (unset: the checkpoint's)")
    e.add_argument("--fp8-accumulation", choices=FP8_ACCUMULATIONS, default=d.fp8_accumulation,
                   help="FP8 GEMMs' sums on CUDA: fp32 or fast (the engine flag's)")
    e.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d.kv_cache_dtype,
                   help="fp8: the KV cache in float8 e4m3")
    e.add_argument("--deterministic", action="store_true",
                   help="batch-invariant kernels (engine/runner/batch_invariant.py): what the mode costs")
    e.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks, one device each")
    e.add_argument("--tp-devices", default=None, help="devices of the ranks, e.g. cuda:0,cuda:1 "
                   "(default: counted up from --device)")
    e.add_argument("--all-reduce", choices=ALL_REDUCES, default=d.all_reduce,
                   help="the tensor-parallel all-reduce: symm, nccl or auto (the engine flag's)")
    e.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE: whole experts split over the --tp-size ranks (the engine flag's)")
    e.add_argument("--expert-parallel-dispatch", choices=EP_DISPATCHES, default=d.expert_parallel_dispatch,
                   help="allreduce or alltoall (the engine flag's)")
    e.add_argument("--ep-redundant-experts", type=int, default=d.ep_redundant_experts,
                   help="copies of the hottest experts of --ep-expert-load (the engine flag's)")
    e.add_argument("--ep-expert-load", default=None, help="JSON load profile (the engine flag's)")
    h = p.add_argument_group("transformers peer")
    h.add_argument("--hf-mode", choices=("auto", "continuous", "static"), default="auto",
                   help="continuous: transformers' continuous batching (paged attention, the engine behind "
                        "generate_batch); static: padded generate() in chunks; auto: continuous when available")
    h.add_argument("--hf-batch-size", type=int, default=32, help="chunk size of the static mode")


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill what the user left unset from the full or the smoke defaults."""
    defaults = SMOKE if args.smoke else FULL
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.device is None:
        args.device = "cuda:0" if torch.cuda.is_available() else "cpu"
    if args.dtype is None:
        args.dtype = "float32" if args.device == "cpu" else "bfloat16"
    if args.smoke and args.threads is None:
        args.threads = 1          # seconds-long and steady on shared CI cores
    return args


def run(args: argparse.Namespace, rec: dict) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = shape_of(args.model)
    workload = requests_workload(args.requests, args.temperature) if args.requests else nano_vllm_workload(
        args.num_seqs, args.min_input_len, args.max_input_len, args.min_output_len, args.max_output_len, args.seed,
        shape.vocab, args.temperature)
    rec["model"] = shape.to_json()
    rec["dtype"] = args.dtype
    from baton.engine.runner.tensor_parallel import rank_devices
    rec["device"] = record.device_info(rank_devices(args.device, args.tp_size, args.tp_devices)
                                       if args.engine == "baton" else [args.device])
    # one-byte projection weights: FP8, or w8a8's int8 (its GEMM rate is measured on CUDA only, where w8a8 is refused)
    fp8 = args.engine == "baton" and (args.quantization in ("fp8", "w8a8") or shape_is_fp8(args.model))
    rec["ceilings"] = ceilings.measure(args.device, getattr(torch, args.dtype), quick=args.smoke, fp8=fp8,
                                       fp8_fast_accum=args.fp8_accumulation == "fast")
    # tensor parallel: the ranks' devices together, at best tp_size times one device's rates
    ranks = args.tp_size if args.engine == "baton" else 1
    fp8_rate = rec["ceilings"].get("matmul_fp8", {}).get("flops_per_s")
    ceil = Ceilings(ranks * rec["ceilings"]["copy"]["bytes_per_s"], ranks * rec["ceilings"]["matmul"]["flops_per_s"],
                    ranks * fp8_rate if fp8_rate else None)
    rec["ceilings"]["devices_in_roofline"] = ranks
    fp8_experts = args.engine == "baton" and (args.quantization == "fp8" or (args.quantization is None and fp8))
    cost = CostModel(shape, DTYPE_BYTES[args.dtype], fp8_weights=fp8, fp8_experts=fp8_experts,
                     kv_bytes=1 if args.engine == "baton" and args.kv_cache_dtype == "fp8" else None)
    if args.engine == "baton":
        results, steps, step_seconds = run_baton(args, workload)
        results["roofline"] = {"schedule": "measured (every executed step)",
                               **roofline_report(cost, ceil, steps, results["wall_seconds"], step_seconds)}
    else:
        from baton.benchmarks.offline_transformers import run_transformers
        from baton.benchmarks.schedule_sim import simulate_steps
        results = run_transformers(args, workload, shape.kv_bytes_per_token(DTYPE_BYTES[args.dtype]))
        steps = simulate_steps(workload.prompts, workload.output_lens, args.block_size, args.max_num_seqs,
                               args.max_num_batched_tokens)
        results["roofline"] = {"schedule": "simulated: Baton's scheduler with the same limits (transformers' "
                                           "own steps are not observable)",
                               **roofline_report(cost, ceil, steps, results["wall_seconds"])}
    rec["results"] = {"workload": workload.describe(), **results}
    _print_summary(rec["results"])


def shape_is_fp8(model: str) -> bool:
    """Whether the model's checkpoint is quantized (FP8 weights without --quantization)."""
    from baton.models.layers.quantization import checkpoint_method
    from baton.models.source import resolve_model
    try:
        return checkpoint_method(resolve_model(model).hf_config) is not None
    except ValueError:
        return False


def requests_workload(path: str, temperature: float) -> OfflineWorkload:
    try:
        data = json.loads(Path(path).read_text())
        workload = OfflineWorkload([list(map(int, p)) for p in data["prompts"]], [int(n) for n in data["output_lens"]],
                                   temperature)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--requests {path}: not a workload file ({exc}); it holds "
                         '{"prompts": [[token ids], ...], "output_lens": [n, ...]}') from None
    if not workload.prompts or len(workload.prompts) != len(workload.output_lens):
        raise ValueError(f"--requests {path}: needs as many output_lens as prompts, and at least one")
    return workload


# -- Baton -------------------------------------------------------------------------------------
class GcPauses:
    """Python's garbage collections during the timed run: how many, how long (a full collection
    of a large heap stalls the engine thread, and the step it lands in, for that long)."""

    def __enter__(self):
        self.pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._t0 = 0.0
        gc.callbacks.append(self._note)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._note)

    def _note(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses[info["generation"]].append(time.perf_counter() - self._t0)

    def report(self) -> dict:
        return {f"gen{g}": {"count": len(p), "total_s": sum(p), "max_s": max(p, default=0.0)}
                for g, p in self.pauses.items()}


class StepRecorder:
    """Wraps the engine's scheduler to note each step's shape as it is scheduled (before
    the step advances the sequences), and its runner to time each launched step on the device
    (events around it on the engine's stream: with asynchronous scheduling the wall time of a
    step call is not its device time). Benchmark-only; the engine is not modified."""

    def __init__(self, scheduler, runner=None):
        self._schedule = scheduler.schedule
        scheduler.schedule = self._record
        self.last: StepShape | None = None
        self.device_events: list[tuple[bool, object, object]] = []     # (is_decode, start, end)
        self._platform = runner.platform if runner is not None else None
        if self._platform is not None and self._platform.runtime is not None:
            self._launch = runner.launch
            runner.launch = self._timed_launch

    def _timed_launch(self, out, prev=None):
        start = self._platform.record_event(timing=True)
        launched = self._launch(out, prev)
        self.device_events.append((out.is_decode, start, self._platform.record_event(timing=True)))
        return launched

    def device_seconds(self) -> dict:
        """Device time of every launched step, by kind (timing events must be complete)."""
        self._platform.synchronize()
        by_kind: dict[str, list[float]] = {"decode": [], "prefill": []}
        for is_decode, start, end in self.device_events:
            by_kind["decode" if is_decode else "prefill"].append(start.elapsed_time(end) / 1e3)
        return {k: summarize(v) | {"total": sum(v)} for k, v in by_kind.items()}

    def _record(self, *args, **kw):
        out = self._schedule(*args, **kw)
        if out is not None:             # (None: scheduling ahead would have preempted; scheduled again)
            self.last = StepShape([(s.seq.num_computed_tokens, s.num_new_tokens) for s in out.scheduled],
                                  sum(s.samples for s in out.scheduled)) if out.scheduled else None
        return out


def engine_config(args: argparse.Namespace) -> dict:
    cfg = {k: getattr(args, k) for k in ENGINE_KNOBS}
    return dict(cfg, device=args.device, dtype=args.dtype, seed=args.seed,
                enable_prefix_caching=not args.no_prefix_caching)


def run_baton(args: argparse.Namespace, workload: OfflineWorkload) -> tuple[dict, list[StepShape], list[float]]:
    from baton.engine import LLM
    t0 = time.perf_counter()
    llm = LLM(args.model, **engine_config(args))
    engine = llm.engine
    load_seconds = time.perf_counter() - t0
    recorder = StepRecorder(engine.scheduler, engine.runner)
    _drive(engine, warmup_workload(workload, args.seed), recorder, progress=False)
    recorder.device_events.clear()
    retries = _alloc_retries(engine.runner.device)
    with GcPauses() as gc_pauses:
        wall, out_tokens, steps, step_seconds, tpots = _drive(engine, workload, recorder, progress=True)
    retries = None if retries is None else _alloc_retries(engine.runner.device) - retries
    decode_s = [t for s, t in zip(steps, step_seconds, strict=True) if s.is_decode]
    prefill_s = [t for s, t in zip(steps, step_seconds, strict=True) if not s.is_decode]
    results = {
        "engine": "baton", "mode": "baton continuous batching", "load_seconds": load_seconds,
        "wall_seconds": wall, "prompt_tokens": workload.prompt_tokens, "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall, "total_tokens_per_s": (workload.prompt_tokens + out_tokens) / wall,
        "tpot_s": summarize(tpots),
        "steps": {"count": len(steps), "scheduled_tokens": sum(s.tokens for s in steps),
                  "sampled_rows": sum(s.sampled for s in steps), "decode_seconds": summarize(decode_s),
                  "prefill_seconds": summarize(prefill_s),
                  "decode_batch_size": summarize([len(s.contexts) for s in steps if s.is_decode]),
                  "slowest": _slowest(steps, step_seconds),
                  "device_seconds": recorder.device_seconds() if recorder.device_events else None,
                  "gc_pauses": gc_pauses.report(),
                  # CUDA's caching allocator out of cached blocks: it frees them all and retries, a device sync
                  "allocator_retries": retries},
        "engine_config": dict(engine_config(args), num_kv_blocks=engine.runner.num_blocks,
                              max_model_len=engine.max_model_len),
    }
    return results, steps, step_seconds


def _alloc_retries(device) -> int | None:
    if device.type != "cuda":
        return None
    import torch
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def _slowest(steps: list[StepShape], seconds: list[float], n: int = 5) -> list[dict]:
    """The n slowest steps with their shape: where outliers (compiles, allocations) hide."""
    order = sorted(range(len(steps)), key=lambda i: -seconds[i])[:n]
    return [{"index": i, "seconds": seconds[i], "kind": "decode" if steps[i].is_decode else "prefill",
             "seqs": len(steps[i].contexts), "tokens": steps[i].tokens,
             "with_context": sum(c > 0 for c, _ in steps[i].contexts),
             "max_new": max(n for _, n in steps[i].contexts)} for i in order]


def _drive(engine, workload: OfflineWorkload, recorder: StepRecorder, progress: bool):
    """Add every request, step until all finish; (wall, output tokens, step shapes, step seconds,
    per-request TPOT: (finish - first token) / (tokens - 1), as `bench serve` computes it from a client)."""
    from baton.engine import SamplingParams
    steps: list[StepShape] = []
    step_seconds: list[float] = []
    out_tokens = finished = idle = 0
    first: dict[str, float] = {}
    tpots: list[float] = []
    t0 = last = time.perf_counter()
    for ids, n in zip(workload.prompts, workload.output_lens, strict=True):
        engine.add_request(ids, SamplingParams(temperature=workload.temperature, max_tokens=n, ignore_eos=True))
    while engine.has_unfinished:
        ts = time.perf_counter()
        outs = engine.step()
        te = time.perf_counter()
        out_tokens += sum(len(o.new_token_ids) for o in outs)     # (a step ahead: the last call only resolves)
        finished += sum(o.finished for o in outs)
        for o in outs:
            first.setdefault(o.request_id, te)
            if o.finished and o.completion_tokens > 1:
                tpots.append((te - first[o.request_id]) / (o.completion_tokens - 1))
        if recorder.last is None:
            idle = idle + 1 if not outs else 0
            if idle > 1000:
                raise RuntimeError("the engine scheduled nothing for 1000 steps with requests unfinished")
            continue
        idle = 0
        steps.append(recorder.last)
        step_seconds.append(te - ts)
        recorder.last = None
        if progress and te - last > 5:
            last = te
            print(f"[bench] {finished}/{len(workload.prompts)} done, {out_tokens} tokens, "
                  f"{out_tokens / (te - t0):.1f} tok/s", file=sys.stderr, flush=True)
    return time.perf_counter() - t0, out_tokens, steps, step_seconds, tpots


def _print_summary(r: dict) -> None:
    roof = r["roofline"]
    dec = r.get("steps", {}).get("decode_seconds", {})
    line = (f"[bench] {r['engine']}: {r['output_tokens']} output tokens in {r['wall_seconds']:.2f}s = "
            f"{r['output_tokens_per_s']:.1f} tok/s; roofline fraction {roof['roofline_fraction']:.3f}")
    if dec.get("p50") is not None:
        line += f"; decode step p50 {dec['p50'] * 1e3:.1f} ms p99 {dec['p99'] * 1e3:.1f} ms"
    print(line, file=sys.stderr, flush=True)
