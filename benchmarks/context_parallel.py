"""One long prompt's prefill on one device, or split across context-parallel ranks (issue 53).

    python -m baton.benchmarks.context_parallel --model qwen3-8b-yarn --device cuda:0 --cp-size 1 >> cp.jsonl
    python -m baton.benchmarks.context_parallel --model qwen3-8b-yarn --device cuda:0 --cp-size 2 >> cp.jsonl
    python -m baton.benchmarks.context_parallel --compare cp.jsonl

Each run builds the offline engine (prefix caching off, --context-parallel-size N: ranks on the
devices counted up from --device), prefills one warm-up prompt, then --repeats random prompts of
--prompt-len tokens with one output token each, and prints one JSON line: the wall time of each
prompt (prefill and its first token). --compare reads such lines and prints each size's median and
its speedup over size 1 (the issue's bar: >= 1.6x at 128k tokens on two GPUs).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from baton.benchmarks import flags
from baton.engine import LLM, SamplingParams


def run(args: argparse.Namespace) -> dict:
    options = dict(device=args.device, context_parallel_size=args.cp_size, enable_prefix_caching=False,
                   max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks, tokenizer=args.tokenizer)
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(args.model, **options)
    try:
        vocab = llm.engine.vocab_size
        g = torch.Generator().manual_seed(0)
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        llm.generate([torch.randint(3, vocab, (args.warmup_len,), generator=g).tolist()], one)
        seconds = []
        for _ in range(args.repeats):
            prompt = torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist()
            start = time.perf_counter()
            llm.generate([prompt], one)
            seconds.append(time.perf_counter() - start)
            print(f"[cp {args.cp_size}] {args.prompt_len} tokens: {seconds[-1]:.3f} s", file=sys.stderr)
    finally:
        llm.engine.runner.close()
    return dict(model=args.model, device=args.device, cp_size=args.cp_size, prompt_len=args.prompt_len,
                max_num_batched_tokens=llm.engine.config.max_num_batched_tokens, seconds=seconds,
                median_s=statistics.median(seconds))


def compare(path: str) -> list[str]:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    base = {r["prompt_len"]: r["median_s"] for r in rows if r["cp_size"] == 1}
    out = []
    for r in rows:
        ref = base.get(r["prompt_len"])
        speedup = f"{ref / r['median_s']:.2f}x" if ref else "(no cp 1 run)"
        out.append(f"cp {r['cp_size']}: {r['prompt_len']} tokens, median {r['median_s']:.3f} s, speedup {speedup}")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-8b-yarn")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--cp-size", type=int, default=1, help="context-parallel ranks (1: one device)")
    p.add_argument("--prompt-len", type=int, default=131064)
    p.add_argument("--warmup-len", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-model-len", type=int, default=131072)
    p.add_argument("--num-kv-blocks", type=int, default=8400, help="KV blocks per rank (16 tokens each)")
    p.add_argument("--max-num-batched-tokens", type=int, help="the prefill chunk (unset: the engine's)")
    p.add_argument("--compare", metavar="JSONL", help="print the speedups of earlier runs' lines and exit")
    flags.tokenizer(p)
    args = p.parse_args(argv)
    if args.compare:
        print("\n".join(compare(args.compare)))
        return
    print(json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main()
