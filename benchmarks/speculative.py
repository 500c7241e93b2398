"""Speculative decoding (n-gram, or an EAGLE-3 head) against plain decoding on an input-grounded workload.

    python -m baton.benchmarks.speculative --device cuda:0 --batches 1,16,256 \
        --workloads ignore-eos,stop-at-eos --output spec.json
    # an EAGLE-3 head: a trained one's directory, or `random` (one in the model's shapes: what a head
    # costs per step, never a speed-up); --model: another target (a preset's random weights price it too)
    python -m baton.benchmarks.speculative --device cuda:0 --speculative-method eagle3 --speculative-model random \
        --model qwen3-0.6b

The embedded SmolLM2-135M-Instruct (real weights: speed-ups need a model that copies), asked to
repeat a given passage with one word changed -- the answer copies spans of the prompt, as edits,
summaries and extraction do. For each batch size, the same greedy requests run through an engine
without speculation and one with `--speculative-method ngram`; output tok/s of each, their ratio,
the mean tokens a verifying step gained per sequence (accepted guesses + 1), the histogram of kept
guesses and the number of verifying steps (those queued before the step before them was back, and
the sequence-steps of those voided by a rollback). Greedy tokens are compared too (bf16 on a GPU may flip
near-ties: docs/benchmarks.md). Workloads: ignore-eos (160 tokens each; past its EOS the model writes
text of its own, where guesses mostly fail) and stop-at-eos (each answer ends where the model ends it).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

from baton.engine import DEFAULT_MODEL, LLM, SamplingParams

PASSAGES = [
    "The old lighthouse stood at the edge of the cliff for more than two hundred years. Every night its keeper "
    "climbed the narrow stairs, trimmed the wick, and watched the beam sweep across the dark water. Ships that "
    "passed the point knew the rhythm of its light, three long flashes and one short, and steered wide of the rocks.",
    "To bake the bread, mix the flour, water, salt and yeast in a large bowl until no dry flour remains. Cover the "
    "bowl and let the dough rest for twelve hours at room temperature. Then shape it into a round loaf, let it rise "
    "for another hour, and bake it in a hot oven for forty minutes until the crust is deep brown.",
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion, the members "
    "agreed to increase the funding for the library, to repair the roof of the community hall, and to postpone the "
    "new playground until the spring. The final vote was seven in favour and two against.",
    "Rivers shape the land they cross. Over thousands of years, the water carves valleys, carries sand and stones "
    "downstream, and builds wide plains where it slows near the sea. Farmers have always settled along rivers, "
    "because the soil there is rich and the water is close at hand for their fields and their animals.",
]
EDITS = [("two hundred", "three hundred"), ("twelve", "ten"), ("Tuesday", "Monday"), ("thousands", "millions")]


def prompts(llm: LLM, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = PASSAGES[i % len(PASSAGES)]
        old, new = EDITS[i % len(EDITS)]
        ask = f"Here is a passage:\n\n{text}\n\nRepeat the passage exactly, word for word, but write \"{new}\" " \
              f"instead of \"{old}\"."
        if getattr(llm.tokenizer, "chat_template", None) is None:      # (a bare tokenizer: the request as text)
            out.append(llm.tokenizer(ask)["input_ids"])
        else:
            out.append(llm.apply_chat_template([{"role": "user", "content": ask}]))
    return out


def run(llm: LLM, batch: int, reqs: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    """Output tok/s with at most `batch` requests at once (each wave waits for the last)."""
    llm.generate(reqs[:1], SamplingParams(temperature=0, max_tokens=8))          # warm
    tokens, outs = 0, []
    t0 = time.perf_counter()
    for start in range(0, len(reqs), batch):
        wave = llm.generate(reqs[start:start + batch], params)
        outs += [o.token_ids for o in wave]
        tokens += sum(len(o.token_ids) for o in wave)
    return tokens / (time.perf_counter() - t0), outs


def _head(model: str | None, target: str | None) -> str:
    """eagle3's head directory: as given, or a random head for the target written to a temp dir."""
    if model is None:
        raise SystemExit("--speculative-method eagle3 needs --speculative-model DIR (or random)")
    if model != "random":
        return model
    import tempfile

    from baton.models.eagle3 import random_head, save_head
    from baton.models.source import resolve_model
    return str(save_head(tempfile.mkdtemp(prefix="baton-eagle3-"), *random_head(resolve_model(target).hf_config)))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--model", default=None, help="the target: a preset, a directory (default: the embedded SmolLM2)")
    p.add_argument("--tokenizer", default=os.environ.get("BATON_TOKENIZER"),
                   help="tokenizer directory (default: $BATON_TOKENIZER, else the model's; presets: the embedded model's)")
    p.add_argument("--batches", default="1,16,256")
    p.add_argument("--waves", type=int, default=4,
                   help="this many waves of `batch` requests, one after another (a batch of 16 is ~0.2 s a wave)")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--speculative-method", default="ngram", choices=("ngram", "eagle3"))
    p.add_argument("--speculative-model", default=None,
                   help="eagle3: the head's directory, or `random` (a random head in the model's shapes)")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--speculative-max-batch", type=int, default=32)
    p.add_argument("--num-kv-blocks", type=int, default=8192, help="each engine's KV cache (two engines share the GPU)")
    p.add_argument("--workloads", default="ignore-eos",
                   help="comma-separated: ignore-eos (max-tokens each; past its EOS the model writes text of its "
                        "own, where guesses mostly fail), stop-at-eos (each answer ends at its EOS)")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    workloads = args.workloads.split(",")
    if not set(workloads) <= {"ignore-eos", "stop-at-eos"}:
        p.error(f"--workloads: ignore-eos and/or stop-at-eos, not {args.workloads!r}")
    max_seqs = max(batches)
    rows, results = [], {}
    method = args.speculative_method
    head = _head(args.speculative_model, args.model) if method == "eagle3" else None
    for spec in (False, True):
        extra = dict(speculative_method=method, speculative_model=head, num_speculative_tokens=args.num_speculative_tokens,
                     speculative_max_batch=args.speculative_max_batch) if spec else {}
        llm = LLM(args.model or DEFAULT_MODEL, tokenizer=args.tokenizer, device=args.device, max_num_seqs=max_seqs, num_kv_blocks=args.num_kv_blocks, **extra)
        for workload in workloads:
            params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=workload == "ignore-eos")
            for b in batches:
                reqs = prompts(llm, b * args.waves)
                st = llm.engine.speculator.stats if spec else None
                before = (st.accepted_lengths[:], st.steps, st.ahead, st.rolled_back) if spec else None
                tok_s, outs = run(llm, b, reqs, params)
                mean = lengths = steps = ahead = None
                if spec:
                    lengths = [a - (before[0][i] if i < len(before[0]) else 0) for i, a in enumerate(st.accepted_lengths)]
                    n = sum(lengths)
                    mean = sum((i + 1) * c for i, c in enumerate(lengths)) / n if n else None
                    steps = st.steps - before[1]
                    ahead = {"ahead": st.ahead - before[2], "rolled_back": st.rolled_back - before[3]}
                results[(spec, workload, b)] = (tok_s, outs, mean, lengths, steps, ahead)
                print(f"[spec] {method if spec else 'plain'} {workload} batch {b}: {tok_s:.0f} tok/s"
                      + (f", mean tokens per verified step {mean:.2f}, kept-guess histogram {lengths}, verifying "
                         f"steps {steps} ({ahead['ahead']} queued ahead, {ahead['rolled_back']} sequence-steps "
                         f"rolled back)" if mean else ""), file=sys.stderr, flush=True)
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for workload in workloads:
        for b in batches:
            plain, spec = results[(False, workload, b)], results[(True, workload, b)]
            rows.append({"workload": workload, "batch": b, "plain_tok_s": round(plain[0], 1),
                         f"{method}_tok_s": round(spec[0], 1), "speedup": round(spec[0] / plain[0], 3),
                         "mean_tokens_per_verified_step": spec[2], "kept_guesses_histogram": spec[3],
                         "verifying_steps": spec[4], "verifying_steps_ahead": (spec[5] or {}).get("ahead"),
                         "rolled_back": (spec[5] or {}).get("rolled_back"), "output_tokens": sum(map(len, spec[1])),
                         "same_tokens": plain[1] == spec[1]})
            print(json.dumps(rows[-1]), flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"model": args.model or "smollm2-135m-instruct (real weights)", "device": args.device,
                       "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                       "max_tokens": args.max_tokens, "num_speculative_tokens": args.num_speculative_tokens,
                       "method": method, "speculative_model": args.speculative_model,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
