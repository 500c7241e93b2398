"""The statistics every benchmark reports: percentiles, per-request latency figures, SLO
attainment and goodput, and quantiles read back from Prometheus histograms.

Plain Python, no torch: the numbers here are what the docs quote, so they are unit-tested
on hand-computed cases.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

GOODPUT_ATTAINMENT = 0.90          # DistServe: >= 90 % of requests meet both SLOs


def percentile(values: Sequence[float], p: float) -> float | None:
    """The p-th percentile (0..100) with linear interpolation between order statistics
    (numpy's default); None for no values."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    xs = sorted(values)
    if not xs:
        return None
    rank = (len(xs) - 1) * p / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def summarize(values: Iterable[float]) -> dict:
    """count, mean, min, p50, p90, p99, max of a sample (None where it is empty)."""
    xs = list(values)
    if not xs:
        return {"count": 0, "mean": None, "min": None, "p50": None, "p90": None, "p99": None, "max": None}
    return {"count": len(xs), "mean": sum(xs) / len(xs), "min": min(xs), "p50": percentile(xs, 50),
            "p90": percentile(xs, 90), "p99": percentile(xs, 99), "max": max(xs)}


def tpot(e2e: float, ttft: float, output_tokens: int) -> float | None:
    """Time per output token after the first: (E2E - TTFT) / (output tokens - 1).

    Undefined (None) for fewer than two output tokens: there is no inter-token time.
    """
    if output_tokens < 2:
        return None
    return (e2e - ttft) / (output_tokens - 1)


def meets_slo(ok: bool, ttft: float | None, tpot_s: float | None, slo_ttft: float | None,
              slo_tpot: float | None) -> bool:
    """A request meets the SLOs when it succeeded and its TTFT and TPOT are within them.

    A missing SLO is not checked; a request with a single output token has no TPOT and
    cannot miss the TPOT SLO. Failed requests always miss.
    """
    if not ok or ttft is None:
        return False
    if slo_ttft is not None and ttft > slo_ttft:
        return False
    return slo_tpot is None or tpot_s is None or tpot_s <= slo_tpot


def attainment(met: Sequence[bool]) -> float | None:
    """Fraction of requests meeting the SLOs; None for no requests."""
    return sum(met) / len(met) if met else None


def goodput_rate(points: Iterable[tuple[float, float | None]],
                 target: float = GOODPUT_ATTAINMENT) -> float | None:
    """DistServe's goodput: the highest request rate whose SLO attainment is >= target.

    `points` are (rate, attainment); rate may be math.inf (everything at once). None when
    no rate reaches the target.
    """
    passing = [rate for rate, att in points if att is not None and att >= target]
    return max(passing) if passing else None


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """A quantile from cumulative histogram buckets [(upper bound, count <= bound), ...],
    interpolated linearly inside the bucket, as Prometheus' histogram_quantile does.

    The last bucket must be +Inf; a quantile landing there returns the highest finite bound.
    """
    if not 0 <= q <= 1:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    buckets = sorted(buckets)
    if not buckets or not math.isinf(buckets[-1][0]):
        raise ValueError("histogram buckets must end with the +Inf bucket")
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound
