"""How fast llguidance fills one step's masks for a batch, by matcher layout and thread count.

    python -m baton.benchmarks.grammar_masks --batch 64 --threads 1,4,12

64 matchers of benchmarks/structured.py's JSON schema over SmolLM2's tokenizer (BATON_TOKENIZER, or
the embedded model's) with qwen3's vocabulary width, each fed a random token its own mask allows,
step after step; prints the median fill time per step after 20 warm-up steps. `--shared`: the
matchers are copies of one (they share its lexer), as Baton made them before issue 29's fix; by
default each is compiled on its own, as Baton makes them now (engine/requests/structured_output.py).
"""
from __future__ import annotations

import argparse
import random
import time

import numpy as np


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", default="1,4,12", help="llguidance executor threads to try, comma-separated")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--shared", action="store_true", help="copies of one matcher (the old layout)")
    args = p.parse_args(argv)
    import llguidance
    import llguidance.numpy
    from transformers import AutoTokenizer

    from baton.benchmarks import environment as bench_env
    from baton.benchmarks.structured import schema
    from baton.engine.requests.structured_output import StructuredOutput, StructuredOutputs, compiled
    from baton.models.source import resolve_model
    tokenizer = AutoTokenizer.from_pretrained(bench_env.tokenizer() or resolve_model(None).tokenizer_path)
    grammars = StructuredOutputs(tokenizer, 151936, [151645])
    grammar = compiled(StructuredOutput.json(schema(8)))
    for threads in (int(t) for t in args.threads.split(",")):
        if args.shared:
            one = llguidance.LLMatcher(grammars.tokenizer, grammar, log_level=0)
            matchers = [one.deep_copy() for _ in range(args.batch)]
        else:
            matchers = [llguidance.LLMatcher(grammars.tokenizer, grammar, log_level=0) for _ in range(args.batch)]
        executor = llguidance.LLExecutor(num_threads=threads)
        mask = np.full((args.batch, grammars.words), -1, np.int32)
        rng = random.Random(0)
        seconds = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            llguidance.numpy.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], mask)
            seconds.append(time.perf_counter() - t0)
            for i, m in enumerate(matchers):
                allowed = np.flatnonzero(np.unpackbits(mask[i].view(np.uint8), bitorder="little")[:len(tokenizer)])
                m.consume_tokens([int(rng.choice(allowed))])
        print(f"[grammar_masks] {'shared' if args.shared else 'own'} matchers, {threads} threads: "
              f"{np.median(seconds[20:]) * 1e3:.2f} ms a step for {args.batch}", flush=True)


if __name__ == "__main__":
    main()
