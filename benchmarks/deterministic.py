"""Deterministic mode on a device: together == alone, chunked == unchunked, against the default.

    python -m baton.benchmarks.deterministic --model qwen3-0.6b --device cuda:0 --num-seqs 256 \\
        --output deterministic.json

For each mode (--deterministic, then the default kernels) one engine decodes --num-seqs random
prompts together (a third greedy, a third seeded temperature sampling, a third seeded with
top-k/top-p), then each prompt alone, and a second engine with a small token budget decodes
them together again (chunked prefill, other batches). Reports how many sequences differ from
the together run in each case: 0 is what deterministic mode promises; the default's count shows
what it buys. Random weights in the model's real shapes, the platform's dtype (bf16 on CUDA).
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import torch

from baton.benchmarks import flags
from baton.engine import LLM, SamplingParams


def workload(args) -> tuple[list[list[int]], list[SamplingParams]]:
    g = torch.Generator().manual_seed(args.seed)
    lens = torch.randint(args.min_input_len, args.max_input_len + 1, (args.num_seqs,), generator=g)
    prompts = [torch.randint(3, 30000, (int(n),), generator=g).tolist() for n in lens]
    params = []
    for i in range(args.num_seqs):
        kind = dict(max_tokens=args.output_len, ignore_eos=True)
        if i % 3 == 1:
            kind.update(temperature=1.0, seed=i)
        elif i % 3 == 2:
            kind.update(temperature=0.8, top_k=40, top_p=0.9, seed=i)
        else:
            kind.update(temperature=0)
        params.append(SamplingParams(**kind))
    return prompts, params


def differ(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x != y for x, y in zip(a, b, strict=True))


def run_mode(args, deterministic: bool, prompts, params) -> dict:
    common = dict(device=args.device, tokenizer=args.tokenizer, deterministic=deterministic, num_kv_blocks=args.num_kv_blocks,
                  enable_prefix_caching=False, max_num_seqs=args.num_seqs)
    llm = LLM(args.model, **common)
    t0 = time.perf_counter()
    together = [o.token_ids for o in llm.generate(prompts, params)]
    t_together = time.perf_counter() - t0
    t0 = time.perf_counter()
    alone = [llm.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    t_alone = time.perf_counter() - t0
    del llm
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    chunked_llm = LLM(args.model, max_num_batched_tokens=args.chunk_tokens, **common)
    chunked = [o.token_ids for o in chunked_llm.generate(prompts, params)]
    del chunked_llm
    gc.collect()
    row = {"deterministic": deterministic, "sequences": len(prompts),
           "alone_differs": differ(together, alone), "chunked_differs": differ(together, chunked),
           "greedy_alone_differs": differ(together[0::3], alone[0::3]),
           "together_seconds": round(t_together, 2), "alone_seconds": round(t_alone, 2)}
    print(json.dumps(row), flush=True)
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--device", default="cuda:0")
    flags.tokenizer(p, presets=False)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-input-len", type=int, default=16)
    p.add_argument("--max-input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--chunk-tokens", type=int, default=256, help="the chunked engine's token budget per step")
    p.add_argument("--num-kv-blocks", type=int, default=10000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="deterministic,default")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    prompts, params = workload(args)
    rows = [run_mode(args, mode == "deterministic", prompts, params) for mode in args.modes.split(",")]
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"model": args.model, "device": args.device, "rows": rows,
                       "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}, f,
                      indent=1)
    ok = all(r["alone_differs"] == r["chunked_differs"] == 0 for r in rows if r["deterministic"])
    print(f"[deterministic] {'holds' if ok else 'BROKEN'}: " + "; ".join(
        f"{'deterministic' if r['deterministic'] else 'default'}: {r['alone_differs']}/{r['sequences']} differ alone, "
        f"{r['chunked_differs']} chunked" for r in rows), file=sys.stderr)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
