"""Where a speculative step's time goes on a device (host functions, and the wait for the GPU).

    python -m baton.benchmarks.profile_speculative --device cuda:0 --batch 16

The embedded model on benchmarks/speculative.py's workload, one engine with n-gram speculation,
the second of two identical runs under cProfile; prints the functions by total time.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys

from baton.benchmarks.speculative import prompts
from baton.engine import LLM, SamplingParams


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--plain", action="store_true", help="no speculation (the baseline's profile)")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args(argv)
    extra = {} if args.plain else dict(speculative_method="ngram")
    llm = LLM(device=args.device, num_kv_blocks=8192, **extra)
    reqs = prompts(llm, args.batch)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(reqs, params)
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(reqs, params)
    prof.disable()
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(args.top)
    if not args.plain:
        print(llm.engine.speculator.stats)


if __name__ == "__main__":
    main()
