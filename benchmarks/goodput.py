"""Goodput as DistServe defines it: the highest sustained Poisson request rate at which >= 90 % of
requests meet both the TTFT and the TPOT target. Found by an adaptive search over probes (bracket
by growing steps, then bisect on the rate to a tolerance), each probe judged afterwards against
every SLO pair, so one probe per rate serves them all.

Plain Python, no I/O: a probe is whatever `ProbeRunner` returns (a real deployment, a simulation).
"""
from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from baton.benchmarks.stats import GOODPUT_ATTAINMENT, meets_slo

DEFAULT_TOLERANCE = 0.05           # the knee is known to within 5 %: hi / lo <= 1.05
# A probe whose backlog grows faster than this (TTFT's slope against arrival time, seconds per
# second) is not sustained: arrivals outrun service by that fraction. Without the test, a finite
# probe above capacity can pass because its queue has not yet grown to the TTFT target.
DEFAULT_GROWTH_LIMIT = DEFAULT_TOLERANCE
MAX_STEP = 16.0


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_s: float
    tpot_s: float

    @property
    def key(self) -> str:
        return f"{self.ttft_s * 1e3:g}/{self.tpot_s * 1e3:g}"

    def to_json(self) -> dict:
        return {"ttft_ms": self.ttft_s * 1e3, "tpot_ms": self.tpot_s * 1e3}


def slo_pairs(ttfts_ms: list[float], tpots_ms: list[float]) -> list[SLO]:
    """Every (TTFT, TPOT) combination, loosest first (the order the searches run in)."""
    pairs = [SLO(t / 1e3, p / 1e3) for t in ttfts_ms for p in tpots_ms]
    return sorted(dict.fromkeys(pairs), key=lambda s: (-s.tpot_s, -s.ttft_s))


@dataclass(frozen=True, slots=True)
class Outcome:
    """One judged request: what the SLOs are checked on."""
    ok: bool
    ttft: float | None
    tpot: float | None
    sent_at: float                     # seconds after the probe's first arrival


@dataclass(slots=True)
class Probe:
    rate: float
    outcomes: list[Outcome]            # the measured requests only (no warm-up, no cool-down)
    info: dict = field(default_factory=dict)    # sizes, durations, summary: recorded as is
    _judged: dict = field(default_factory=dict, repr=False)     # attainment per SLO pair, computed once

    def attainment(self, slo: SLO) -> float:
        if slo not in self._judged:
            met = sum(meets_slo(o.ok, o.ttft, o.tpot, slo.ttft_s, slo.tpot_s) for o in self.outcomes)
            self._judged[slo] = met / len(self.outcomes) if self.outcomes else 0.0
        return self._judged[slo]

    @property
    def backlog_growth(self) -> float:
        """Least-squares slope of TTFT against arrival time over the measured requests that got a
        first token: about (arrival rate / service rate - 1) for a queue that does not keep up,
        about 0 for one that does."""
        if "growth" not in self._judged:
            self._judged["growth"] = _slope([(o.sent_at, o.ttft) for o in self.outcomes if o.ttft is not None])
        return self._judged["growth"]

    def passes(self, slo: SLO, target: float = GOODPUT_ATTAINMENT,
               growth_limit: float = DEFAULT_GROWTH_LIMIT) -> bool:
        return self.attainment(slo) >= target and self.backlog_growth <= growth_limit


def _slope(pts: list[tuple[float, float]]) -> float:
    if len(pts) < 3:
        return 0.0
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return 0.0 if sxx <= 0 else sum((x - mx) * (y - my) for x, y in pts) / sxx


@dataclass(frozen=True, slots=True)
class ProbePlan:
    """How big a probe at a rate is. `tail_s` is the longest a request meeting the loosest SLO
    pair can take (TTFT target + (longest output - 1) x TPOT target): a request not done by then
    misses every pair, so each is cut at `deadline_s`. Warm-up lasts one such lifetime (the
    in-flight population settles in about one); the measured window several, and at least
    `min_window_s` and `min_requests`; arrivals go on for one more lifetime after the last
    measured one (the cool-down), so every measured request is served under the full load."""
    tail_s: float
    warmup_s: float
    window_s: float
    min_requests: int
    deadline_s: float

    def sizes(self, rate: float) -> tuple[int, int, int]:
        """(warm-up, measured, cool-down) request counts at `rate`."""
        return (max(1, math.ceil(rate * self.warmup_s)), max(self.min_requests, math.ceil(rate * self.window_s)),
                max(1, math.ceil(rate * self.tail_s)))

    def duration_s(self, rate: float) -> float:
        """About how long a probe at `rate` runs: its arrivals, then the last measured deadline."""
        warm, measured, _ = self.sizes(rate)
        return (warm + measured) / rate + self.deadline_s

    def timeouts(self, arrivals: list[float], rate: float) -> list[float]:
        """Per request: the deadline; the cool-down's end with the last measured request's."""
        warm, measured, _ = self.sizes(rate)
        end = arrivals[warm + measured - 1] + self.deadline_s
        return [self.deadline_s if i < warm + measured else max(0.1, end - t) for i, t in enumerate(arrivals)]

    def to_json(self) -> dict:
        return {"tail_s": self.tail_s, "warmup_s": self.warmup_s, "window_s": self.window_s,
                "min_requests": self.min_requests, "deadline_s": self.deadline_s}


def probe_plan(slos: list[SLO], max_output_tokens: int, lifetimes: float = 3.0, min_window_s: float = 10.0,
               min_requests: int = 50, min_warmup_s: float = 1.0, request_timeout_s: float | None = None) -> ProbePlan:
    if lifetimes < 1:
        raise ValueError(f"--probe-lifetimes must be >= 1 (the window outlasts the longest request), got {lifetimes}")
    if min_window_s <= 0 or min_requests < 1 or min_warmup_s < 0:
        raise ValueError("--probe-seconds must be > 0, --probe-min-requests >= 1 and --probe-warmup-s >= 0")
    tail = max(s.ttft_s + max(0, max_output_tokens - 1) * s.tpot_s for s in slos)
    deadline = tail * 1.1 + 0.5          # slack: the client's clock and the stream's last hop
    if request_timeout_s is not None:
        tail, deadline = min(tail, request_timeout_s), min(deadline, request_timeout_s)
    return ProbePlan(tail, max(min_warmup_s, tail), max(min_window_s, lifetimes * tail), min_requests, deadline)


ProbeRunner = Callable[[float], Awaitable[Probe]]


@dataclass(slots=True)
class SearchResult:
    slo: SLO
    goodput: float | None              # the highest passing rate of the final bracket (None: none passed)
    bracket: tuple[float | None, float | None]
    converged: bool
    reason: str                        # converged | budget | below_min_rate | above_max_rate | resolution
    probed: list[float]                # rates probed for this pair, in order
    reused: list[float]                # bracket ends probed for an earlier pair
    non_monotone: list[float]          # passing rates above the lowest failing one (noise near the knee)

    def to_json(self, devices: int | None = None) -> dict:
        lo, hi = self.bracket
        return {"slo": self.slo.to_json(), "goodput_req_s": self.goodput,
                "goodput_per_device": None if self.goodput is None or not devices else self.goodput / devices,
                "bracket": [lo, hi], "converged": self.converged, "reason": self.reason,
                "rates_probed": self.probed, "rates_reused": self.reused, "non_monotone": self.non_monotone}


@dataclass(slots=True)
class Search:
    """One (deployment, workload)'s searches: probes are cached by rate and shared by every SLO pair."""
    run_probe: ProbeRunner
    tolerance: float = DEFAULT_TOLERANCE
    step: float = 2.0                  # first bracketing factor; squared after each step the same way
    min_rate: float = 0.01
    max_rate: float = 1e6
    target: float = GOODPUT_ATTAINMENT
    growth_limit: float = DEFAULT_GROWTH_LIMIT
    duration_s: Callable[[float], float] | None = None    # a probe's expected length, for the budget
    deadline: float | None = None      # time.monotonic() after which no probe starts
    clock: Callable[[], float] = time.monotonic
    probes: dict[float, Probe] = field(default_factory=dict)
    order: list[float] = field(default_factory=list)      # rates in the order they were probed

    def __post_init__(self) -> None:
        if not 0.001 <= self.tolerance < 1:
            raise ValueError(f"--search-tolerance must be in [0.001, 1), got {self.tolerance}")
        if not self.step > 1:                       # (NaN too)
            raise ValueError(f"--search-step must be > 1, got {self.step}")
        if not 0 < self.min_rate < self.max_rate < math.inf:
            raise ValueError(f"need 0 < --search-min-rate < --search-max-rate, both finite; got {self.min_rate}, {self.max_rate}")

    def bracket(self, slo: SLO) -> tuple[float | None, float | None, list[float]]:
        """(highest passing rate below the lowest failing one, lowest failing rate, passing rates
        above that) over every probe run so far."""
        fails = [r for r, p in self.probes.items() if not p.passes(slo, self.target, self.growth_limit)]
        hi = min(fails) if fails else None
        passing = [r for r, p in self.probes.items() if p.passes(slo, self.target, self.growth_limit)]
        lo = max((r for r in passing if hi is None or r < hi), default=None)
        return lo, hi, sorted(r for r in passing if hi is not None and r > hi)

    async def find(self, slo: SLO, start: float | None = None) -> SearchResult:
        """The knee for one SLO pair, starting at `start` (a prediction) unless the probes already
        run bracket it."""
        probed: list[float] = []
        reused: set[float] = set()          # bracket ends an earlier search probed
        factor, direction = self.step, 0
        while True:
            lo, hi, odd = self.bracket(slo)
            reused |= {r for r in (lo, hi) if r is not None and r not in probed}
            done = self._done(lo, hi)
            if done is None:
                rate, direction, factor = self._next(lo, hi, None if probed else start, factor, direction)
                done = self._stop_before(rate)
            if done is not None:
                return SearchResult(slo, lo, (lo, hi), done == "converged", done, probed, sorted(reused), odd)
            self.probes[rate] = await self.run_probe(rate)
            self.order.append(rate)
            probed.append(rate)

    async def find_all(self, slos: list[SLO], starts: dict[str, float] | None = None) -> list[SearchResult]:
        """Every pair's knee, in order; each search starts from the probes the earlier ones left."""
        return [await self.find(slo, (starts or {}).get(slo.key)) for slo in slos]

    def _done(self, lo: float | None, hi: float | None) -> str | None:
        return "converged" if lo is not None and hi is not None and hi <= lo * (1 + self.tolerance) else None

    def _stop_before(self, rate: float) -> str | None:
        """Why `rate` is not probed, if it is not."""
        if rate < self.min_rate:
            return "below_min_rate"
        if rate > self.max_rate:
            return "above_max_rate"
        if rate in self.probes:               # bisection ran out of rounding: no finer rate to try
            return "resolution"
        return None if self._time_for(rate) else "budget"

    def _next(self, lo: float | None, hi: float | None, start: float | None, factor: float,
              direction: int) -> tuple[float, int, float]:
        """The next rate to probe, the direction it moves the bracket (+1 up, -1 down, 0 bisect)
        and the bracketing factor after it (squared on a repeated step the same way)."""
        if lo is not None and hi is not None:
            return _round(math.sqrt(lo * hi)), 0, factor
        if lo is None and hi is None:
            return _round(start or 1.0), 0, factor
        up = hi is None
        factor = min(MAX_STEP, factor * factor) if direction == (1 if up else -1) else factor
        if start is not None and (start > lo if up else start < hi):
            return _round(start), 0, factor          # the prediction lies on the open side: try it first
        return _round(lo * factor if up else hi / factor), 1 if up else -1, factor

    def _time_for(self, rate: float) -> bool:
        if self.deadline is None:
            return True
        need = self.duration_s(rate) if self.duration_s is not None else 0.0
        return self.clock() + need <= self.deadline

def _round(rate: float) -> float:
    """Rates to 4 significant digits: readable in the JSON, and equal rates hit the cache."""
    return float(f"{rate:.4g}")
