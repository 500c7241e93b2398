"""One goodput probe against a running baton.v1.Router: Poisson load at one rate (each phase's
count fixed: loadgen.segment_arrivals), sized by a ProbePlan (warm-up, measured window,
cool-down), every request cut at the plan's deadline, the cool-down cut as soon as every measured
request has ended (it exists only to keep their load up).
Only the measured requests are judged; the probe's sizes and timings are kept for the JSON.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from baton.benchmarks import datasets, loadgen
from baton.benchmarks.goodput import Outcome, Probe, ProbePlan
from baton.benchmarks.stats import summarize


@dataclass(slots=True)
class Load:
    """What every probe of one (deployment, workload) sends."""
    address: str
    dataset: str
    common: dict                       # build_requests' lengths and model limits
    sampling: dict
    seed: int = 0
    http_url: str | None = None
    processes: int | None = None       # client processes (None: loadgen's default for the count)


async def run_probe(load: Load, plan: ProbePlan, rate: float, index: int) -> Probe:
    """Probe number `index` of this load at `rate` (its prompts and arrivals seeded by both)."""
    warm, measured, cool = plan.sizes(rate)
    n = warm + measured + cool
    seed = load.seed + 7919 * (index + 1)             # no two probes share prompts (prefix cache)
    reqs = datasets.build_requests(load.dataset, n, seed, **load.common)
    arrivals = loadgen.segment_arrivals([warm, measured, cool], rate, seed)
    processes = load.processes or loadgen.default_processes(n)
    results, wall = await loadgen.run_rate(load.address, reqs, rate, seed, None, load.sampling,
                                           plan.timeouts(arrivals, rate), load.http_url, processes, arrivals,
                                           until_done=range(warm + measured))
    judged = results[warm:warm + measured]
    outcomes = [Outcome(r.ok, r.ttft, r.tpot, r.sent_at) for r in judged]
    info = {"sizes": sizes(warm, measured, cool, arrivals, judged, wall), "summary": summary(judged),
            "requests": [compact(r) for r in judged]}
    return Probe(rate, outcomes, info)


def sizes(warm: int, measured: int, cool: int, arrivals: list[float], judged: list, wall: float) -> dict:
    """The probe's counts and durations, and how many times its measured window outlasts its
    longest measured request (the steady-state check the JSON reports)."""
    window = arrivals[warm + measured - 1] - arrivals[warm] if measured > 1 else 0.0
    longest = max((r.e2e for r in judged if r.e2e is not None), default=None)
    return {"warmup": warm, "measured": measured, "cooldown": cool, "wall_s": wall,
            "warmup_s": arrivals[warm] - arrivals[0], "window_s": window, "longest_e2e_s": longest,
            "window_over_longest": window / longest if longest else None}


def summary(judged: list) -> dict:
    """Throughput and latency of the measured requests: completions over the span from the first
    measured send to the last measured finish."""
    ok = [r for r in judged if r.ok]
    span = (max(r.sent_at + r.e2e for r in judged) - min(r.sent_at for r in judged)) if judged else 0.0
    out = sum(r.output_tokens for r in ok)
    return {"completed": len(ok), "num_requests": len(judged), "span_s": span,
            "request_throughput": len(ok) / span if span > 0 else None,
            "output_throughput": out / span if span > 0 else None,
            "ttft_s": summarize(r.ttft for r in ok if r.ttft is not None),
            "tpot_s": summarize(t for t in (r.tpot for r in ok) if t is not None),
            "itl_s": summarize(x for r in ok for x in r.itls), "e2e_s": summarize(r.e2e for r in ok),
            "errors": dict(Counter(r.status for r in judged if not r.ok))}


def compact(r: loadgen.RequestResult) -> dict:
    """A measured request without its inter-token gaps (thousands of requests a probe)."""
    return {"sent_at": _round(r.sent_at), "status": r.status, "ttft": _round(r.ttft), "tpot": _round(r.tpot),
            "e2e": _round(r.e2e), "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens}


def _round(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, 6)
