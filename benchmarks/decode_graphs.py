"""Decode step time with CUDA graphs vs eager, at fixed batch sizes and context length.

    python -m baton.benchmarks.decode_graphs --model qwen3-0.6b --device cuda:0 --batches 1,64,256

Each batch: requests with a random prompt of --context tokens are prefilled, then the median
of --steps pure decode steps (engine.last_step_seconds: schedule + inputs + forward + sample)
is reported for the eager and the graph-captured runner, in one JSON line per setting.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from baton.benchmarks import flags
from baton.engine import LLMEngine, SamplingParams
from baton.engine.config import EngineConfig


def step_times(engine: LLMEngine, batch: int, context: int, steps: int, seed: int = 0) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    vocab = engine.vocab_size
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    ids = [engine.add_request(torch.randint(0, vocab, (context,), generator=g).tolist(), params)
           for _ in range(batch)]
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    times = []
    for _ in range(steps):
        engine.step()
        times.append(engine.last_step_seconds)
    for rid in ids:
        engine.abort(rid)
    return times


class PhaseTimer:
    """Wall time per engine phase, with the device synchronized at each boundary, so the
    split between host work (schedule, inputs, sampling bookkeeping) and device work shows."""

    def __init__(self, engine: LLMEngine):
        self.totals: dict[str, float] = {}
        r = engine.runner
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine.scheduler, "resolve", "resolve tokens")
        self._wrap(r, "step_inputs", "host inputs")
        self._wrap(r.executor, "upload_inputs", "upload")
        if r.graphs is not None:
            self._wrap(r.graphs, "run", "forward (graph replay)")
        self._wrap(r.model, "forward", "forward (eager)")
        self._wrap(r.model, "compute_logits", "logits")
        self._wrap(r.executor, "sampler", "sample", call=True)

    def _wrap(self, obj, name: str, label: str, call: bool = False) -> None:
        fn = getattr(obj, name)

        def timed(*a, **kw):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            torch.cuda.synchronize()
            self.totals[label] = self.totals.get(label, 0.0) + time.perf_counter() - t0
            return out
        setattr(obj, name, timed)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    flags.tokenizer(p)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--breakdown", action="store_true", help="also time each phase of a graph step")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    for eager in (True, False):
        cfg = EngineConfig(model=args.model, tokenizer=args.tokenizer, device=args.device, enforce_eager=eager, max_num_seqs=max(batches),
                           max_model_len=args.context + args.steps + 64, max_num_batched_tokens=16384)
        engine = LLMEngine(cfg)
        for b in batches:
            step_times(engine, b, args.context, 5)               # warm-up
            t = step_times(engine, b, args.context, args.steps)
            print(json.dumps({"model": args.model, "mode": "eager" if eager else "graphs", "batch": b,
                              "context": args.context, "median_step_ms": 1000 * statistics.median(t),
                              "p90_step_ms": 1000 * sorted(t)[int(0.9 * len(t))]}), flush=True)
        if args.breakdown and not eager:
            for b in batches:
                timer = PhaseTimer(engine)
                t = step_times(engine, b, args.context, args.steps)
                timer.totals = {}
                t = step_times(engine, b, args.context, args.steps)
                n = args.steps
                print(json.dumps({"model": args.model, "mode": "graphs-breakdown", "batch": b,
                                  "context": args.context, "step_ms": 1000 * statistics.median(t),
                                  "phases_ms": {k: round(1000 * v / n, 3) for k, v in timer.totals.items()}}),
                      flush=True)
                engine.runner.__dict__.pop("step_inputs", None)
        del engine
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    print("done", file=sys.stderr)


if __name__ == "__main__":
    main()
