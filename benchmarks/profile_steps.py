"""Where a step's device time goes: torch.profiler over eager prefill and decode steps.

    python -m baton.benchmarks.profile_steps --model qwen3-0.6b --device cuda:0 --batch 256 --context 512

Runs the engine eagerly (so every kernel is a separate, attributable launch), profiles one
prefill step of --prefill-tokens tokens and --steps decode steps at --batch sequences of
--context tokens, and prints one JSON line per phase: wall ms per step, summed kernel ms per
step and the top kernels by device time. Wall minus kernel time is launch and host overhead
(which decode graphs remove).
"""
from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from baton.benchmarks.decode_graphs import PhaseTimer
from baton.engine import LLMEngine, SamplingParams
from baton.engine.config import EngineConfig
from baton.serving.options import flag


def kernel_times(prof, steps: int, top: int) -> tuple[float, list[dict]]:
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if t > 0 and e.device_type == torch.autograd.DeviceType.CUDA:
            rows.append((t, e.key, e.count))
    rows.sort(reverse=True)
    total_ms = sum(t for t, _, _ in rows) / 1000 / steps
    return total_ms, [{"kernel": k[:90], "ms_per_step": round(t / 1000 / steps, 3), "calls_per_step": c // steps}
                      for t, k, c in rows[:top]]


def _profiled(engine: LLMEngine, steps: int):
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    return prof, wall


def _host_profile(engine: LLMEngine, top: int) -> list[dict]:
    import cProfile
    import pstats
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    engine.step()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = sorted(((tt, ct, nc, f"{fn[0].rsplit('/', 2)[-1]}:{fn[1]}:{fn[2]}") for fn, (_cc, nc, tt, ct, _)
                   in stats.items()), reverse=True)[:top]
    return [{"fn": name[:90], "own_ms": round(1000 * tt, 2), "cum_ms": round(1000 * ct, 2), "calls": nc}
            for tt, ct, nc, name in rows]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    flag(p, "--tokenizer", help="tokenizer directory (unset: the model's; presets: the embedded model's)")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--prefill-tokens", type=int, default=4096)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--quantization", default=None, help="fp8 | w8a8 (unset: the checkpoint's)")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8")
    p.add_argument("--skip-prefill", action="store_true", help="decode only (and the mixed step)")
    p.add_argument("--host-top", type=int, default=0,
                   help="also one more mixed step under cProfile: the host's top functions by own time")
    args = p.parse_args(argv)
    cfg = EngineConfig(model=args.model, tokenizer=args.tokenizer, device=args.device, enforce_eager=True, max_num_seqs=args.batch,
                       max_model_len=max(args.context, args.prefill_tokens) + 4 * args.steps + 64,
                       max_num_batched_tokens=max(args.prefill_tokens, args.context),
                       quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    engine = LLMEngine(cfg)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.6, max_tokens=4 * args.steps + 16, ignore_eos=True)

    def add(n: int) -> list[str]:
        return [engine.add_request(torch.randint(0, engine.vocab_size, (args.context,), generator=g).tolist(),
                                   params) for _ in range(n)]

    # warm-up: compile every kernel on both paths
    ids = add(max(1, args.prefill_tokens // args.context))
    for _ in range(3):
        engine.step()
    for rid in ids:
        engine.abort(rid)
    tag = {"model": args.model, "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype}
    if not args.skip_prefill:    # one full-budget prefill step
        ids = add(max(1, args.prefill_tokens // args.context))
        prof, wall = _profiled(engine, 1)
        kernel_ms, top = kernel_times(prof, 1, args.top)
        print(json.dumps({"phase": "prefill", **tag, "tokens": args.prefill_tokens, "wall_ms": round(1000 * wall, 2),
                          "kernel_ms": round(kernel_ms, 2), "top": top}), flush=True)
        for rid in ids:
            engine.abort(rid)
    # decode at the batch
    ids = add(args.batch)
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                          for s in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    prof, wall = _profiled(engine, args.steps)
    kernel_ms, top = kernel_times(prof, args.steps, args.top)
    print(json.dumps({"phase": "decode", **tag, "batch": args.batch, "context": args.context,
                      "running": len(engine.scheduler.running), "kv_blocks": engine.runner.num_blocks,
                      "wall_ms": round(1000 * wall, 2), "kernel_ms": round(kernel_ms, 2), "top": top}), flush=True)
    # a mixed step: the running batch decodes while one long prompt fills the rest of the token budget
    # (B1's "prefill" steps are mostly these); the first is timed by phase, the second profiled by kernel
    timer = PhaseTimer(engine)
    for i in range(2):
        engine.add_request(torch.randint(0, engine.vocab_size, (args.prefill_tokens - args.batch,),
                                         generator=g).tolist(), params)
        if i == 0:
            timer.totals = {}
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.step()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            phases = {k: round(1000 * v, 2) for k, v in timer.totals.items()}
        else:
            prof, _ = _profiled(engine, 1)
            kernel_ms, top = kernel_times(prof, 1, args.top)
    print(json.dumps({"phase": "mixed", **tag, "decode_rows": args.batch, "tokens": args.prefill_tokens,
                      "wall_ms": round(1000 * wall, 2), "phases_ms": phases,
                      "kernel_ms": round(kernel_ms, 2), "top": top}), flush=True)
    if args.host_top:     # eager prefill is bound by the host: where its Python time goes
        engine.add_request(torch.randint(0, engine.vocab_size, (args.prefill_tokens - args.batch,),
                                         generator=g).tolist(), params)
        print(json.dumps({"phase": "mixed host", **tag, "top": _host_profile(engine, args.host_top)}), flush=True)
    for rid in ids:
        engine.abort(rid)


if __name__ == "__main__":
    main()
