"""Where a tensor-parallel decode step's device time goes, against one device's: CUDA graphs on, as served.

    python -m baton.benchmarks.tp_profile --model qwen3-8b --tp-size 2 --batches 64,128,256 --context 512

For each batch: the median step (wall, device synchronized around the timed steps) and a profile of
rank 0's kernels over graph replays (CUPTI sees each node), one JSON line a batch. Run it once per
--tp-size (each in its own process, so each gets every device's memory); rank 0's collective kernels
include their wait for the other ranks, so a collective's time here is what it costs the step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from baton.benchmarks.decode_graphs import step_times
from baton.benchmarks.profile_steps import kernel_times
from baton.engine import LLMEngine
from baton.engine.config import ALL_REDUCES, EngineConfig
from baton.serving.options import flag


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _profiled(engine: LLMEngine, batch: int, context: int, steps: int, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step_times(engine, batch, context, steps)
    _sync()
    # (the profile spans the prompts' prefill too: its GEMMs are listed apart by shape-free name, so the
    # decode kernels' rows are the small ones; `prefill_steps` says how many steps were prefill)
    total_ms, rows = kernel_times(prof, steps, top)
    return {"kernel_ms_per_step": round(total_ms, 3), "top": rows}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-8b")
    flag(p, "--tokenizer", help="tokenizer directory (unset: the model's; presets: the embedded model's)")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--tp-size", type=int, default=2)
    p.add_argument("--all-reduce", default="auto", choices=ALL_REDUCES)
    p.add_argument("--batches", default="64,128,256")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--no-profile", action="store_true", help="step times only")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    cfg = EngineConfig(model=args.model, tokenizer=args.tokenizer, device=args.device, tp_size=args.tp_size,
                       all_reduce=args.all_reduce, max_num_seqs=max(batches),
                       max_model_len=args.context + 2 * args.steps + 64, max_num_batched_tokens=8192,
                       gpu_memory_utilization=0.85)
    engine = LLMEngine(cfg)
    try:
        for b in batches:
            step_times(engine, b, args.context, 3)                    # warm-up
            _sync()
            t0 = time.perf_counter()
            t = step_times(engine, b, args.context, args.steps)
            _sync()
            row = {"model": args.model, "tp_size": args.tp_size, "all_reduce": args.all_reduce, "batch": b,
                   "context": args.context, "steps": args.steps,
                   "median_step_ms": round(1000 * statistics.median(t), 3),
                   "p90_step_ms": round(1000 * sorted(t)[int(0.9 * len(t))], 3),
                   "wall_with_prefill_s": round(time.perf_counter() - t0, 3)}
            if not args.no_profile:
                row.update(_profiled(engine, b, args.context, args.steps, args.top))
            print(json.dumps(row), flush=True)
    finally:
        engine.runner.close()             # the other ranks' processes


if __name__ == "__main__":
    main()
