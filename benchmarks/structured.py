"""Structured output's cost: a batch decoding under a JSON schema against the same batch unconstrained.

    python -m baton.benchmarks.structured --model qwen3-0.6b --device cuda:0 --batch 64 --output structured.json

One engine; the same prompts, seeds and token budget decode with and without a JSON schema (an array
of at least `--min-items` records: no output completes it within the budget, so every measured token
is sampled under a live grammar), in alternating rounds. Decode tok/s counts the tokens after each
request's first, over the steps after every request has its first token. Also reported: the host
time per step spent filling the masks (engine/requests/structured_output.py, on their own thread), and where a
constrained step's engine-thread time goes (HostTimes); `--profile` adds a torch profiler trace of
each batch's device busy and idle time per step. docs/benchmarks.md "Structured output" has the figures.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from baton.engine import LLM, SamplingParams, StructuredOutput
from baton.serving.options import flag


def schema(min_items: int, name_length: int = 24) -> dict:
    """An array of at least `min_items` user records; `name_length`: the names' maxLength (0: none)."""
    name = {"type": "string", "maxLength": name_length} if name_length else {"type": "string"}
    record = {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "name": name,
        "role": {"enum": ["admin", "editor", "viewer"]},
        "score": {"type": "number"},
        "active": {"type": "boolean"}},
        "required": ["id", "name", "role", "score", "active"], "additionalProperties": False}
    return {"type": "object", "properties": {"users": {"type": "array", "items": record, "minItems": min_items}},
            "required": ["users"], "additionalProperties": False}


class HostTimes:
    """Where a constrained step's host time goes on the engine thread, per step (ms): the masks'
    start (`masks_async`: waiting for the previous step's tokens, the matchers reading them, the
    fill handed to its thread), of which the wait; then, before the next launch, waiting
    for the fill and queueing the sampling (`complete`), of which the sampling's upload and launch,
    of which the masks' copy (`upload`)."""

    def __init__(self, engine):
        from baton.engine.runner.step import LaunchedStep

        self.totals = {"masks_start": 0.0, "wait_tokens": 0.0, "complete": 0.0, "sample_launch": 0.0, "upload": 0.0}
        self.steps = 0
        totals = self.totals

        def timed(key, fn):
            def wrapper(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    totals[key] += time.perf_counter() - t0
            return wrapper
        structured = engine.structured
        structured.masks_async = timed("masks_start", structured.masks_async)
        inner_tokens = LaunchedStep.row_tokens

        def row_tokens(step):               # (the masks' wait: the engine's own read finds them back)
            t0 = time.perf_counter()
            try:
                return inner_tokens(step)
            finally:
                if step.finish is None and self.in_masks:
                    totals["wait_tokens"] += time.perf_counter() - t0
        LaunchedStep.row_tokens = row_tokens
        self.in_masks = False
        inner_start = structured.masks_async

        def masks_async(*a):
            self.in_masks = True
            try:
                return inner_start(*a)
            finally:
                self.in_masks = False
        structured.masks_async = masks_async
        inner_complete = LaunchedStep.complete

        def complete(step):
            if step.finish is None:
                return
            t0 = time.perf_counter()
            inner_complete(step)
            totals["complete"] += time.perf_counter() - t0
        LaunchedStep.complete = complete
        engine.runner.masks.upload = timed("upload", engine.runner.masks.upload)
        inner_sample = engine.runner.sample

        def sample(*a):
            self.steps += 1
            return inner_sample(*a)
        engine.runner.sample = timed("sample_launch", sample)

    def snapshot(self) -> tuple[dict, int]:
        return dict(self.totals), self.steps

    def per_step(self, since: tuple[dict, int]) -> dict:
        before, steps = since
        n = max(1, self.steps - steps)
        return {k: round(1e3 * (v - before[k]) / n, 3) for k, v in self.totals.items()}


def gpu_idle(llm: LLM, prompts, params, skip: int = 40, steps: int = 40) -> dict:
    """A torch profiler trace (device activity only) of `steps` engine steps after `skip`: the
    device's busy and idle time per step (kernels and copies, overlaps counted once)."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    for ids, p in zip(prompts, params, strict=True):
        engine.add_request(ids, p)
    for _ in range(skip):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    while engine.has_work:
        engine.step()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end, gaps = 0.0, None, []
    for a, b in spans:
        if end is None or a > end:
            if end is not None:
                gaps.append(a - end)
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    span = spans[-1][1] - spans[0][0] if spans else 0.0
    gaps.sort(reverse=True)
    return {"steps": steps, "wall_ms_per_step": round(1e3 * wall / steps, 3),
            "device_busy_ms_per_step": round(busy / 1e3 / steps, 3),
            "device_idle_ms_per_step": round((span - busy) / 1e3 / steps, 3),
            "largest_gaps_ms": [round(g / 1e3, 3) for g in gaps[:steps:max(1, steps // 8)]]}


class MaskTimer:
    """Wall time of the engine's mask fills (host, on their own thread: the engine thread schedules
    and builds the next step meanwhile), per step."""

    def __init__(self, engine):
        self.seconds: list[float] = []
        inner = engine.structured.fill

        def timed(mask, work):
            t0 = time.perf_counter()
            inner(mask, work)
            self.seconds.append(time.perf_counter() - t0)
        engine.structured.fill = timed


def decode(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, int, list[list[int]]]:
    """(decode tok/s, tokens counted, each output's tokens): from the step after every request has a
    token to the end."""
    engine = llm.engine
    for ids, p in zip(prompts, params, strict=True):
        engine.add_request(ids, p)
    counts: dict[str, int] = {}
    texts: dict[str, list[int]] = {}
    t0 = first = None
    while engine.has_unfinished:
        for out in engine.step():
            texts.setdefault(out.request_id, []).extend(out.new_token_ids)
            counts[out.request_id] = len(texts[out.request_id])
        if t0 is None and len(counts) == len(prompts):
            t0, first = time.perf_counter(), sum(counts.values())
    seconds = time.perf_counter() - t0
    while engine.has_work:             # the row still in flight after the last request ended
        engine.step()
    tokens = sum(counts.values()) - first
    return tokens / seconds, tokens, list(texts.values())


def obeyed(llm: LLM, spec: StructuredOutput, outputs: list[list[int]]) -> bool:
    """Whether every output token was one the grammar allowed (a fresh matcher reads them all)."""
    return all(llm.engine.structured.state(spec, 0).matcher.consume_tokens(ids) for ids in outputs)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--device", default="cuda:0")
    flag(p, "--tokenizer", help="tokenizer directory (unset: the model's; presets: the embedded model's)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--min-items", type=int, default=64, help="the schema's minimum array length (keeps it open)")
    p.add_argument("--name-length", type=int, default=24,
                   help="the names' maxLength (0: unbounded). Near the end of a bounded string llguidance's "
                        "masks walk most of the token trie (docs/benchmarks.md): the costly case")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output", default=None)
    p.add_argument("--switch-interval", type=float, default=None,
                   help="sys.setswitchinterval (s) for the run: how soon a thread waiting for the GIL gets it")
    p.add_argument("--profile", action="store_true", help="also trace the device (torch profiler): idle per step")
    p.add_argument("--fill-threads", type=int, default=None, help="llguidance's threads (default: its own, 80%% of the cores)")
    args = p.parse_args(argv)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    llm = LLM(args.model, device=args.device, tokenizer=args.tokenizer, max_num_seqs=args.batch)
    if args.fill_threads:
        llm.engine.structured.use_threads(args.fill_threads)
    spec = StructuredOutput.json(schema(args.min_items, args.name_length))
    prompts = [llm.tokenizer.encode(f"Request {i}: list the users of team {i} as JSON.") for i in range(args.batch)]

    def params(structured):
        return [SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, ignore_eos=True,
                               structured=structured) for i in range(args.batch)]
    decode(llm, prompts[:4], [SamplingParams(temperature=1.0, max_tokens=8, structured=spec)] * 4)  # warm: vocabulary
    timer = MaskTimer(llm.engine)
    host = HostTimes(llm.engine)
    plain, constrained, texts, hosts = [], [], [], []
    for r in range(args.rounds):
        plain.append(decode(llm, prompts, params(None))[0])
        n_masks, since = len(timer.seconds), host.snapshot()
        tok_s, tokens, texts = decode(llm, prompts, params(spec))
        constrained.append(tok_s)
        hosts.append(host.per_step(since))
        print(f"[structured] round {r}: plain {plain[-1]:.0f} tok/s, json_schema {tok_s:.0f} tok/s "
              f"({tokens} tokens), masks {1e3 * statistics.mean(timer.seconds[n_masks:]):.2f} ms a step, "
              f"host ms a step {hosts[-1]}", file=sys.stderr, flush=True)
    profiled = {}
    if args.profile and torch.cuda.is_available():
        try:
            profiled = {"plain": gpu_idle(llm, prompts, params(None)),
                        "json_schema": gpu_idle(llm, prompts, params(spec))}
        except Exception as exc:          # (the figures above stand without it)
            profiled = {"error": repr(exc)}
        print(f"[structured] device trace: {profiled}", file=sys.stderr, flush=True)
    ok = obeyed(llm, spec, texts)
    row = {"model": args.model, "device": args.device,
           "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "batch": args.batch, "max_tokens": args.max_tokens, "rounds": args.rounds, "name_length": args.name_length,
           "plain_tok_s": round(statistics.median(plain), 1), "json_schema_tok_s": round(statistics.median(constrained), 1),
           "ratio": round(statistics.median(constrained) / statistics.median(plain), 3),
           "mask_ms_per_step": round(1e3 * statistics.median(timer.seconds), 3),
           "host_ms_per_constrained_step": hosts[-1], "switch_interval_s": sys.getswitchinterval(),
           "fill_threads": args.fill_threads,
           **({"device_trace": profiled} if profiled else {}),
           "outputs_follow_the_schema": ok, "sample_output": llm.tokenizer.decode(texts[0])[:160]}
    print(json.dumps(row), flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
