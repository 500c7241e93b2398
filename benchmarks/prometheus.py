"""Server-side figures for B2, read from the workers' Prometheus endpoints: the handover
histograms (prefill's last forward -> decode's first step; and -> the KV landed on the decode
worker, its transfer part), summed over workers and differenced across a sweep point so
each rate gets its own quantiles."""
from __future__ import annotations

import math
import time
import urllib.request
from collections.abc import Callable
from typing import TypeVar

from prometheus_client.parser import text_string_to_metric_families

from baton.benchmarks.stats import histogram_quantile

HANDOVER = "baton_handover_seconds"
KV_LANDED = "baton_kv_landed_seconds"


def metrics_url(spec: str) -> str:
    """"host:port" or a full URL -> the /metrics URL."""
    url = spec if "://" in spec else f"http://{spec}"
    return url if url.rstrip("/").endswith("/metrics") else url.rstrip("/") + "/metrics"


def parse_histogram(text: str, name: str) -> dict[float, float]:
    """Cumulative bucket counts {upper bound: count} of histogram `name`, summed over label sets."""
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for s in family.samples:
            if s.name == f"{name}_bucket":
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
    return buckets


def scrape(urls: list[str], name: str = HANDOVER, timeout: float = 5.0) -> tuple[dict[float, float], list[str]]:
    """The histogram summed over every reachable URL, and the errors of the others."""
    total: dict[float, float] = {}
    errors = []
    for url in urls:
        try:
            text = _text(url, timeout)
        except OSError as exc:
            errors.append(f"{url}: {exc}")
            continue
        for le, count in parse_histogram(text, name).items():
            total[le] = total.get(le, 0.0) + count
    return total, errors


def _text(url: str, timeout: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def counter_sum(url: str, name: str, timeout: float = 5.0, **labels: str) -> float:
    """Samples `name` (a counter's `_total`) at `url` whose labels include `labels`, summed."""
    total = 0.0
    for family in text_string_to_metric_families(_text(url, timeout)):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


T = TypeVar("T")


def settled(read: Callable[[], T], quiet_s: float = 0.8, limit_s: float = 20.0) -> T:
    """`read()` once two reads `quiet_s` apart agree: a worker's engine core hands its counts to the
    front with its next message, at the latest its next beat (every 0.5 s: BEAT_INTERVAL_S), so the
    last request's may land a moment after its stream ended. After `limit_s`, the last read."""
    deadline, last = time.monotonic() + limit_s, read()
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        if (now := read()) == last:
            return now
        last = now
    return last


def quantiles_between(before: dict[float, float], after: dict[float, float]) -> dict:
    """Count, p50 and p99 of what the histogram observed between two scrapes."""
    delta = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    if not delta or not math.isinf(delta[-1][0]) or delta[-1][1] <= 0:
        return {"count": 0, "p50": None, "p99": None}
    return {"count": int(delta[-1][1]), "p50": histogram_quantile(0.5, delta), "p99": histogram_quantile(0.99, delta)}


# -- the router's side: where each finished request's time went (router/request_clock.py) ---------
STAGES = "baton_stage_seconds"


def router_metrics_url(http_url: str) -> str:
    """The router's /metrics from its OpenAI API's URL (http://host:port/v1)."""
    return http_url.rstrip("/").removesuffix("/v1") + "/metrics"


def stage_totals(urls: list[str], timeout: float = 5.0) -> dict[str, tuple[float, float]]:
    """{stage: (seconds summed, requests)} of the routers' stage histograms now (summed over models
    and routers); {} when there is no URL or one does not answer (a partial sum would mislead)."""
    totals: dict[str, list[float]] = {}
    for url in urls:
        try:
            text = _text(url, timeout)
        except OSError:
            return {}
        for family in text_string_to_metric_families(text):
            if family.name != STAGES:
                continue
            for s in family.samples:
                if s.name in (f"{STAGES}_sum", f"{STAGES}_count"):
                    t = totals.setdefault(s.labels["stage"], [0.0, 0.0])
                    t[s.name.endswith("_count")] += s.value
    return {stage: (t[0], t[1]) for stage, t in totals.items()}


def stages_between(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict:
    """{stage: {"count", "mean_s"}} of the requests that finished between two scrapes (their stages
    add up to their mean E2E)."""
    out = {}
    for stage, (total, count) in after.items():
        t0, c0 = before.get(stage, (0.0, 0.0))
        if count - c0 > 0:
            out[stage] = {"count": int(count - c0), "mean_s": (total - t0) / (count - c0)}
    return out


# -- several routers seen as one (baton elastic, baton top, bench flip) ----------------------------
# Routers can share a deployment's ports (`baton serve --routers N`, replicas behind one Service),
# each with a /metrics of its own. A request goes through exactly one router, so the routers'
# counters and histograms add up, and so do the gauges of what each router holds itself (SUMMED);
# the busy share and the degraded flag are each router's own verdict: the worst is kept (MAXED).
# Every other gauge, and every series labelled `worker` (a worker's, which a router's merged view
# carries: router/worker_metrics.py), describes the deployment's workers: each router sees the same
# series, so it is taken once, from the first router that has it (baton_running, baton_waiting,
# baton_kv_cache_usage_ratio and the router's own view of it, baton_model_info, `_created` stamps).
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
SUMMED = frozenset({"baton_router_running", "baton_router_waiting", "baton_router_stream_message_rate",
                    "vllm:num_requests_running", "vllm:num_requests_waiting"})
MAXED = frozenset({"baton_router_busy_ratio", "baton_degraded"})
ADDED_TYPES = frozenset({"counter", "histogram", "summary", "gaugehistogram"})


def metrics_urls(spec: str) -> list[str]:
    """--metrics-url's value: one URL, or several apart by commas (one per router), each once."""
    urls = list(dict.fromkeys(u.strip() for u in spec.split(",") if u.strip()))
    if not urls:
        raise ValueError("--metrics-url is empty: give each router's /metrics, apart by commas")
    return urls


def read_routers(urls: list[str], timeout: float = 5.0) -> tuple[list[list], dict[str, str]]:
    """(each answering router's metric families, in the order of `urls`; {URL: why} of each that did
    not answer, or not with Prometheus text)."""
    families, down = [], {}
    for url in urls:
        try:
            families.append(list(text_string_to_metric_families(_text(url, timeout))))
        except OSError as exc:
            down[url] = str(getattr(exc, "reason", None) or exc)
        except ValueError as exc:
            down[url] = f"not Prometheus text: {exc}"
    return families, down


def said(down: dict[str, str]) -> str:
    """The routers that did not answer, in one line."""
    return ", ".join(f"{url} ({why})" for url, why in down.items())


def merge_routers(routers: list[list], apart: bool = False) -> Samples:
    """One deployment's samples {(name, sorted labels): value} from its routers' families, by the
    rules above. `apart` (with more than one router): the summed and maxed series keep a `router`
    label (the router's index) instead of being combined, so that a reader differencing two scrapes
    (baton top) sees a restarted router's counters begin again on their own; summing over that
    label gives the total."""
    out: Samples = {}
    apart = apart and len(routers) > 1
    for i, families in enumerate(routers):
        for fam in families:
            added, maxed = fam.type in ADDED_TYPES or fam.name in SUMMED, fam.name in MAXED
            for s in fam.samples:
                labels = tuple(sorted(s.labels.items()))
                per_router = (added or maxed) and "worker" not in s.labels
                if per_router and apart:
                    out[(s.name, tuple(sorted({**s.labels, "router": str(i)}.items())))] = s.value
                elif not per_router or (s.name, labels) not in out:
                    out.setdefault((s.name, labels), s.value)
                elif added:
                    out[(s.name, labels)] += s.value
                else:
                    out[(s.name, labels)] = max(out[(s.name, labels)], s.value)
    return out
