"""`baton top`: a live view of a running deployment in the terminal, from the metrics any
dashboard reads: the router's /metrics on its HTTP port, which under `baton serve` carries every
worker's series too (router/worker_metrics.py), and its /health.

Every refresh scrapes twice the interval apart in effect (this scrape against the last one):
rates are counter deltas over the time between them, latency quantiles come from the histogram
buckets that filled in between (Prometheus's interpolation), gauges are read as they are.

    baton top                                   # http://127.0.0.1:8000/metrics, every 2 s
    baton top --url http://HOST:PORT/metrics --interval 5
    baton top --once                            # one frame (two scrapes) to stdout, then exit
    baton top --metrics-url URL,URL             # several routers (`baton serve --routers N` prints them)

Several routers sharing a deployment's ports each count their own requests: the view adds their
counters and histograms up and takes the workers' series once (each router's metrics port carries them with
--worker-metrics, as under `baton serve`: router/worker_metrics.py's PortView) (benchmarks/prometheus.py:
merge_routers says which family is which). While one of them does not answer, the frame names it
and shows no request figures: a sum without it would read low, as if the traffic had dropped.
"""
from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from collections import defaultdict
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from baton.benchmarks import stats
from baton.benchmarks.prometheus import merge_routers, metrics_urls, read_routers, said
from baton.serving.options import parser

STAGE_ORDER = ("queue", "admit", "prefill", "handover", "decode")
FETCH_TIMEOUT_S = 5.0
HEALTH_ORDER = ("ok", "degraded", "unavailable")     # several routers' /health: the worst is shown


@dataclass(frozen=True)
class Scrape:
    at: float
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]
    health: dict
    routers: int = 1
    down: tuple[str, ...] = ()             # "URL (why)" of each router that did not answer


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return merge_routers([list(text_string_to_metric_families(text))])


def fetch(urls: str | list[str]) -> Scrape:
    """One scrape of every router's /metrics, with the worst /health beside them (empty when none
    answers). OSError when no router answers."""
    urls = [urls] if isinstance(urls, str) else urls
    routers, down = read_routers(urls, FETCH_TIMEOUT_S)
    if not routers:
        raise OSError(down[urls[0]] if len(urls) == 1 else f"none answers: {said(down)}")
    healths = [h for h in (_health(u) for u in urls if u not in down) if h]
    health = max(healths, key=lambda h: _rank(h.get("status")), default={})
    samples = merge_routers(routers, apart=True)
    if not health:
        health = _health_of_metrics(samples)
    return Scrape(time.monotonic(), samples, health, len(urls), tuple(f"{url} ({why})" for url, why in down.items()))


def _health_of_metrics(samples) -> dict:
    """Where no /health answers (routers' own metrics ports: /health is on the HTTP port), what their
    `baton_degraded` gauge says; empty when they do not export it."""
    degraded = [v for (name, _), v in samples.items() if name == "baton_degraded"]
    if not degraded:
        return {}
    if max(degraded) > 0:
        return {"status": "degraded", "reason": "baton_degraded; /health on the HTTP port says why"}
    return {"status": "ok"}


def _health(url: str) -> dict:
    try:
        with urllib.request.urlopen(url.removesuffix("/metrics") + "/health", timeout=FETCH_TIMEOUT_S) as r:
            return json.load(r)
    except urllib.error.HTTPError as exc:          # 503 still says why
        try:
            return json.loads(exc.read() or b"{}")
        except ValueError:
            return {}
    except (OSError, ValueError):                 # (a metrics port answers /health with metrics: no health)
        return {}


def _rank(status) -> int:
    return HEALTH_ORDER.index(status) if status in HEALTH_ORDER else -1


class Interval:
    """What happened between two scrapes of the same target."""

    def __init__(self, before: Scrape, after: Scrape):
        self.a, self.b = before.samples, after.samples
        self.seconds = max(after.at - before.at, 1e-9)
        self.health = after.health
        self.routers = after.routers
        self.down = tuple(dict.fromkeys(before.down + after.down))   # a router missing from either: no rates

    def value(self, name: str, **labels) -> float:
        """The sum of `name`'s series matching `labels`, now."""
        return sum(v for (n, ls), v in self.b.items() if n == name and _match(ls, labels))

    def rate(self, name: str, **labels) -> float:
        """Per second, the growth of `name`'s matching series (a series that restarted counts from 0)."""
        total = 0.0
        for key, v in self.b.items():
            if key[0] == name and _match(key[1], labels):
                before = self.a.get(key, 0.0)
                total += v - before if v >= before else v
        return total / self.seconds

    def quantile(self, q: float, name: str, **labels) -> float | None:
        """The q-quantile of the observations `name` (a histogram) got in the interval, as
        Prometheus's histogram_quantile interpolates it; None when none came."""
        buckets: dict[float, float] = defaultdict(float)
        for (n, ls), v in self.b.items():
            if n == f"{name}_bucket" and _match(ls, labels):
                le = dict(ls)["le"]
                buckets[float(le)] += v - self.a.get((n, ls), 0.0)
        return histogram_quantile(q, buckets)

    def mean(self, name: str, **labels) -> float | None:
        count = self.rate(f"{name}_count", **labels) * self.seconds
        return self.rate(f"{name}_sum", **labels) * self.seconds / count if count > 0 else None

    def workers(self) -> list[tuple[str, str]]:
        """(address, role) of every worker whose series the target serves."""
        found = {(dict(ls)["worker"], dict(ls).get("role", "?")) for (_, ls) in self.b if "worker" in dict(ls)}
        return sorted(found, key=lambda w: (("prefill", "decode", "colocated").index(w[1])
                                            if w[1] in ("prefill", "decode", "colocated") else 3, w[0]))


def _match(labels: tuple[tuple[str, str], ...], want: dict[str, str]) -> bool:
    have = dict(labels)
    return all(have.get(k) == v for k, v in want.items())


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus's interpolation (benchmarks/stats.py's) over cumulative buckets {upper bound: count}."""
    return stats.histogram_quantile(q, list(buckets.items())) if buckets else None


def _tokens_sent(iv: Interval) -> float:
    """Output tokens a second as they reach clients (a first token, then one interval per token),
    not when their request ends: a long stream counts while it runs."""
    return iv.rate("baton_ttft_seconds_count") + iv.rate("baton_itl_seconds_count")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}" if seconds >= 0.1 else f"{seconds * 1e3:.1f}"


def _rate(x: float) -> str:
    return f"{x:,.1f}" if x < 100 else f"{x:,.0f}"


def render(iv: Interval, url: str):
    """One frame: a rich renderable."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    status = iv.health.get("status", "unknown")
    style = {"ok": "green", "degraded": "yellow", "unavailable": "red"}.get(status, "dim")
    head = Text.assemble(("baton top ", "bold"), (url, "dim"), "  status ", (status, f"bold {style}"))
    if iv.health.get("reason"):
        head.append(f" ({iv.health['reason']})", style=style)
    if iv.routers > 1:
        head.append(f"  {iv.routers - len(iv.down)} of {iv.routers} routers", style="dim" if not iv.down else "bold red")
    head.append(f"  over the last {iv.seconds:.1f}s", style="dim")
    down = [Text(f"router down: {d}", style="bold red") for d in iv.down]

    done = iv.rate("baton_requests_total")
    ok = iv.rate("baton_requests_total", status="stop") + iv.rate("baton_requests_total", status="length")
    req = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    for col in ("running", "waiting", "done/s", "err/s", "in tok/s", "out tok/s", "TTFT p50/99", "ITL p50/99",
                "E2E p50"):
        req.add_column(col, justify="right", no_wrap=True)
    req.add_row(f"{iv.value('baton_router_running'):.0f}", f"{iv.value('baton_router_waiting'):.0f}", _rate(done),
                _rate(max(done - ok - iv.rate("baton_requests_total", status="abort"), 0.0)),
                _rate(iv.rate("baton_prompt_tokens_total")), _rate(_tokens_sent(iv)),
                f"{_ms(iv.quantile(0.5, 'baton_ttft_seconds'))} / {_ms(iv.quantile(0.99, 'baton_ttft_seconds'))}",
                f"{_ms(iv.quantile(0.5, 'baton_itl_seconds'))} / {_ms(iv.quantile(0.99, 'baton_itl_seconds'))}",
                _ms(iv.quantile(0.5, "baton_e2e_seconds")))

    stages = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    stages.add_column("stage")
    stages.add_column("mean", justify="right")
    stages.add_column("p99", justify="right")
    for stage in STAGE_ORDER:
        mean = iv.mean("baton_stage_seconds", stage=stage)
        if mean is not None:
            stages.add_row(stage, _ms(mean), _ms(iv.quantile(0.99, "baton_stage_seconds", stage=stage)))

    workers = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    for col in ("worker", "role", "running", "waiting", "KV used", "step p50/99", "KV in MB/s", "out MB/s"):
        workers.add_column(col, justify="left" if col in ("worker", "role") else "right", no_wrap=True)
    for address, role in iv.workers():
        w = {"worker": address}
        workers.add_row(address, role, f"{iv.value('baton_running', **w):.0f}", f"{iv.value('baton_waiting', **w):.0f}",
                        f"{100 * iv.value('baton_kv_cache_usage_ratio', **w):.0f}%",
                        f"{_ms(iv.quantile(0.5, 'baton_step_seconds', **w))} / "
                        f"{_ms(iv.quantile(0.99, 'baton_step_seconds', **w))}",
                        f"{iv.rate('baton_kv_transfer_bytes_total', direction='in', **w) / 1e6:.1f}",
                        f"{iv.rate('baton_kv_transfer_bytes_total', direction='out', **w) / 1e6:.1f}")
    partial = Text("not shown while a router does not answer: a sum without its requests would read low",
                   style="yellow")
    parts = [head, *down, Text("requests (routers; latencies in ms)" if iv.routers > 1 else
                               "requests (router; latencies in ms)", style="bold"), partial if iv.down else req,
             Text("time by stage of the requests that finished (router; ms)", style="bold"),
             partial if iv.down else stages if stages.row_count else
             Text("no request finished in this interval", style="dim"),
             Text("workers (latencies in ms)", style="bold"),
             workers if workers.row_count else Text(NO_WORKERS if iv.routers == 1 else NO_WORKERS_ROUTERS, style="yellow")]
    return Group(*parts)


NO_WORKERS = ("no worker series here: point --url at a router started by `baton serve`, or run the router with "
              "--worker-metrics")
NO_WORKERS_ROUTERS = ("no worker series here: these routers run without --worker-metrics (`baton serve` turns it "
                      "on: each router's metrics port then carries the workers' series too)")


def build_parser():
    p = parser("baton top", "a live view of a running Baton deployment, from its router's metrics",
               usage="baton top [--url URL[,URL...]] [--interval SECONDS] [--once]")
    p.add_argument("--url", "--metrics-url", dest="url", default="http://127.0.0.1:8000/metrics",
                   help="the router's metrics on its HTTP port; with several routers, each one's own, apart by "
                        "commas (`baton serve --routers N` prints them): summed (default: %(default)s)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default: %(default)s)")
    p.add_argument("--once", action="store_true", help="print one frame (two scrapes --interval apart) and exit "
                   "(without it, output to a pipe or a file gets a frame every --interval)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.interval <= 0:
        sys.exit("baton top: --interval must be > 0 seconds")
    try:
        urls = metrics_urls(args.url)
    except ValueError as exc:
        sys.exit(f"baton top: {exc}")
    from rich.console import Console
    from rich.live import Live
    try:
        last = fetch(urls)
        console = Console()
        if args.once:
            time.sleep(args.interval)
            console.print(render(Interval(last, fetch(urls)), args.url))
            return
    except OSError as exc:
        sys.exit(f"baton top: cannot read {args.url} ({getattr(exc, 'reason', exc)}): is the router up, with its "
                 "HTTP API on (--http-port)? Give its address with --url http://HOST:PORT/metrics")

    def frames(show) -> None:
        nonlocal last
        while True:
            time.sleep(args.interval)
            try:
                now = fetch(urls)
            except OSError as exc:
                show(f"baton top: {args.url} does not answer ({getattr(exc, 'reason', exc)}); retrying")
                continue
            show(render(Interval(last, now), args.url))
            if not now.down:              # rates come from two scrapes of every router
                last = now

    try:
        if console.is_terminal:
            with Live(console=console, auto_refresh=False, screen=False) as live:
                frames(lambda frame: live.update(frame, refresh=True))
        else:                             # a pipe or a file: one frame after another, as `top -b` writes them
            frames(lambda frame: (console.print(frame), console.file.flush()))
    except KeyboardInterrupt:
        pass
