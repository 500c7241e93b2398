"""Speculative decoding (n-gram, or an EAGLE-3 head) against plain decoding on an input-grounded workload.

    python -m baton.benchmarks.speculative --device cuda:0 --batches 1,16,256 \
        --workloads ignore-eos,stop-at-eos --output spec.json
    # an EAGLE-3 head: a trained one's directory, or `random` (one in the model's shapes: what a head
    # costs per step, never a speed-up); --model: another target (a preset's random weights price it too)
    python -m baton.benchmarks.speculative --device cuda:0 --speculative-method eagle3 --speculative-model random \
        --model qwen3-0.6b

The embedded SmolLM2-135M-Instruct (real weights: speed-ups need a model that copies), asked to
repeat a given passage with one word changed -- the answer copies spans of the prompt, as edits,
summaries and extraction do. For each batch size b, the same b x 8 greedy requests run, b at a time
(by default a finished request's slot goes to the next at once; --driver waves: b at a time, each wave
waiting for its longest answer), through an engine without speculation and one with
`--speculative-method ngram`, both loaded at once and run in turns (--rounds, alternating which goes
first: the medians compared, so a drift of the machine's speed hits both; --interleave-ms T: within each
round the two take turns every ~T ms of wall time, so a drift slower than that hits both alike, and the
ratios of the slice pairs are reported too); output tok/s of each, their ratio,
the mean tokens a verifying step gained per sequence (accepted guesses + 1), the histogram of kept
guesses and the number of verifying steps (those queued before the step before them was back, and
the sequence-steps of those voided by a rollback). Greedy tokens are compared too (bf16 on a GPU may flip
near-ties: docs/benchmarks.md). Workloads: stop-at-eos (each answer ends where the model ends it: the
edit, and nothing past it) and ignore-eos (160 tokens each; past its EOS the model writes text of its own,
where guesses mostly fail: a stress case, half its tokens not grounded in the input).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from baton.benchmarks import environment as bench_env
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


def ask(i: int) -> str:
    """The i-th request's text: a passage to repeat with one word changed."""
    text = PASSAGES[i % len(PASSAGES)]
    old, new = EDITS[i % len(EDITS)]
    return f"Here is a passage:\n\n{text}\n\nRepeat the passage exactly, word for word, but write \"{new}\" " \
           f"instead of \"{old}\"."


def prompts(llm: LLM, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        ask_i = ask(i)
        if getattr(llm.tokenizer, "chat_template", None) is None:      # (a bare tokenizer: the request as text)
            out.append(llm.tokenizer(ask_i)["input_ids"])
        else:
            out.append(llm.apply_chat_template([{"role": "user", "content": ask_i}]))
    return out


def run(llm: LLM, batch: int, reqs: list[list[int]], params: SamplingParams,
        driver: str = "refill") -> tuple[float, list[list[int]]]:
    """Output tok/s with `batch` requests in flight. refill: the first `batch` start together, and
    each one that finishes hands its slot to the next request at once (a steady concurrency, as a
    server at that load sees); waves: `batch` at a time, each wave waiting for its longest answer."""
    llm.generate(reqs[:1], SamplingParams(temperature=0, max_tokens=8))          # warm
    if driver == "waves":
        t0, outs = time.perf_counter(), []
        for start in range(0, len(reqs), batch):
            outs += [o.token_ids for o in llm.generate(reqs[start:start + batch], params)]
        return sum(map(len, outs)) / (time.perf_counter() - t0), outs
    outs = [[] for _ in reqs]
    t0 = time.perf_counter()
    for _ in _refill(llm, batch, reqs, params, outs):
        pass
    return sum(map(len, outs)) / (time.perf_counter() - t0), outs


def _refill(llm: LLM, batch: int, reqs: list[list[int]], params: SamplingParams, outs: list[list[int]]):
    """run()'s refill driver one step at a time: a generator that yields after each engine step."""
    engine, index, queue = llm.engine, {}, list(range(len(reqs)))[::-1]

    def submit() -> None:
        i = queue.pop()
        index[engine.add_request(reqs[i], params)] = i

    for _ in range(min(batch, len(reqs))):
        submit()
    while engine.has_unfinished:
        for out in engine.step():
            outs[index[out.request_id]] += out.new_token_ids
            if out.finished and queue:
                submit()
        yield


def run_interleaved(llms: dict[bool, LLM], batch: int, reqs: list[list[int]], params: SamplingParams,
                    slice_ms: float, first: bool) -> tuple[dict[bool, float], dict[bool, list[list[int]]], list[float]]:
    """Both engines through the same requests (refill), taking turns in slices of about `slice_ms` of
    wall time, the device drained at the end of each slice and the slice counted to its engine: a
    drift of the machine's speed slower than a slice hits both alike. Output tok/s of each, their
    outputs, and the ratio of each pair of slices where both ran (tokens per second, guessing over
    plain)."""
    for llm in llms.values():
        llm.generate(reqs[:1], SamplingParams(temperature=0, max_tokens=8))      # warm
    outs = {spec: [[] for _ in reqs] for spec in llms}
    drives = {spec: _refill(llm, batch, reqs, params, outs[spec]) for spec, llm in llms.items()}
    seconds, pair = {spec: 0.0 for spec in llms}, {}
    ratios = []
    order = (first, not first)
    while drives:
        for spec in order:
            if spec not in drives:
                continue
            tokens = sum(map(len, outs[spec]))
            t0 = time.perf_counter()
            while True:         # at least one step a slice
                if next(drives[spec], StopIteration) is StopIteration:
                    del drives[spec]
                    break
                if time.perf_counter() - t0 >= slice_ms / 1000:
                    break
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            took = time.perf_counter() - t0
            seconds[spec] += took
            pair[spec] = (sum(map(len, outs[spec])) - tokens) / took
        if len(pair) == 2 and all(pair.values()):
            ratios.append(pair[True] / pair[False])
        pair = {}
    return {spec: sum(map(len, outs[spec])) / seconds[spec] for spec in llms}, outs, ratios


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
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory (default: the model's own, with its chat template; for --model presets "
                        "$BATON_TOKENIZER, else the embedded model's)")
    p.add_argument("--batches", default="1,16,256")
    p.add_argument("--requests-per-slot", "--waves", dest="per_slot", type=int, default=8,
                   help="batch x this many requests per batch size, at most `batch` in flight (a slot is refilled "
                        "as its request finishes)")
    p.add_argument("--driver", default="refill", choices=("refill", "waves"),
                   help="refill: a finished request's slot goes to the next at once; waves: batch at a time")
    p.add_argument("--rounds", type=int, default=3,
                   help="runs of each engine per batch size, alternating which goes first; the medians compared")
    p.add_argument("--interleave-ms", type=float, default=0,
                   help="each round runs both engines at once, taking turns in slices of this much wall time (the "
                        "device drained between slices; refill driver): a slow drift of the machine's speed hits "
                        "both; 0: each round runs one engine, then the other")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--speculative-method", default="ngram", choices=("ngram", "eagle3"))
    p.add_argument("--speculative-model", default=None,
                   help="eagle3: the head's directory, or `random` (a random head in the model's shapes)")
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="unset: the engine's default")
    p.add_argument("--speculative-max-batch", type=int, default=32)
    p.add_argument("--num-kv-blocks", type=int, default=8192, help="each engine's KV cache (two engines share the GPU)")
    p.add_argument("--workloads", default="stop-at-eos,ignore-eos",
                   help="comma-separated: ignore-eos (max-tokens each; past its EOS the model writes text of its "
                        "own, where guesses mostly fail), stop-at-eos (each answer ends at its EOS)")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    workloads = args.workloads.split(",")
    if not set(workloads) <= {"ignore-eos", "stop-at-eos"}:
        p.error(f"--workloads: ignore-eos and/or stop-at-eos, not {args.workloads!r}")
    max_seqs = max(batches)
    rows = []
    method = args.speculative_method
    head = _head(args.speculative_model, args.model) if method == "eagle3" else None
    spec_extra = dict(speculative_method=method, speculative_model=head, num_speculative_tokens=args.num_speculative_tokens,
                      speculative_max_batch=args.speculative_max_batch)
    # both engines at once (the model is small), their runs interleaved round by round: this machine's
    # speed drifts by more than the differences measured here, and a drift hits both alike
    # the embedded model's requests go through its chat template ($BATON_TOKENIZER, a bare copy of its
    # tokenizer files for random-weight presets, has none: the request would go in as plain text)
    tokenizer = args.tokenizer or (bench_env.tokenizer() if args.model else None)
    engines = {spec: LLM(args.model or DEFAULT_MODEL, tokenizer=tokenizer, device=args.device, max_num_seqs=max_seqs,
                         num_kv_blocks=args.num_kv_blocks, **(spec_extra if spec else {})) for spec in (False, True)}
    st = engines[True].engine.speculator.stats
    for workload in workloads:
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=workload == "ignore-eos")
        for b in batches:
            reqs = prompts(engines[False], b * args.per_slot)
            before = (st.accepted_lengths[:], st.steps, st.ahead, st.rolled_back)
            tok_s, outs, slices = {False: [], True: []}, {}, []
            for r in range(args.rounds):
                if args.interleave_ms:
                    t, o, ratios = run_interleaved(engines, b, reqs, params, args.interleave_ms, first=r % 2 == 1)
                    slices += ratios
                    for spec in (False, True):
                        tok_s[spec].append(t[spec])
                        outs.setdefault(spec, o[spec])
                    continue
                for spec in ((False, True) if r % 2 == 0 else (True, False)):
                    t, o = run(engines[spec], b, reqs, params, args.driver)
                    tok_s[spec].append(t)
                    outs.setdefault(spec, o)
            lengths = [a - (before[0][i] if i < len(before[0]) else 0) for i, a in enumerate(st.accepted_lengths)]
            n = sum(lengths)
            mean = sum((i + 1) * c for i, c in enumerate(lengths)) / n if n else None
            plain, guessed = statistics.median(tok_s[False]), statistics.median(tok_s[True])
            rows.append({"workload": workload, "batch": b, "plain_tok_s": round(plain, 1),
                         f"{method}_tok_s": round(guessed, 1), "speedup": round(guessed / plain, 3),
                         "speedup_per_round": [round(g / p, 3) for p, g in zip(tok_s[False], tok_s[True], strict=True)],
                         "plain_tok_s_per_round": [round(x) for x in tok_s[False]],
                         f"{method}_tok_s_per_round": [round(x) for x in tok_s[True]],
                         "mean_tokens_per_verified_step": mean, "kept_guesses_histogram": lengths,
                         "verifying_steps": st.steps - before[1], "verifying_steps_ahead": st.ahead - before[2],
                         "rolled_back": st.rolled_back - before[3], "output_tokens": sum(map(len, outs[True])),
                         "same_tokens": outs[False] == outs[True]})
            if slices:         # --interleave-ms: the spread of the slice pairs' ratios
                q = statistics.quantiles(slices, n=4) if len(slices) > 1 else slices * 3
                rows[-1]["slice_pairs"] = {"count": len(slices), "median_ratio": round(statistics.median(slices), 3),
                                           "quartiles": [round(q[0], 3), round(q[2], 3)]}
            print(f"[spec] {workload} batch {b}: plain {plain:.0f} tok/s, {method} {guessed:.0f} tok/s "
                  f"({guessed / plain:.2f}x; rounds {rows[-1]['speedup_per_round']}), mean tokens per verified step "
                  f"{mean or 0:.2f}, kept-guess histogram {lengths}", file=sys.stderr, flush=True)
            print(json.dumps(rows[-1]), flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"model": args.model or "smollm2-135m-instruct (real weights)", "device": args.device,
                       "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                       "max_tokens": args.max_tokens, "driver": args.driver, "requests_per_slot": args.per_slot,
                       "rounds": args.rounds, "interleave_ms": args.interleave_ms or None,
                       "num_speculative_tokens": engines[True].engine.config.speculative_tokens,
                       "method": method, "speculative_model": args.speculative_model,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
