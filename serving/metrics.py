"""Prometheus metrics for every Baton process, in one registry per process.

Served over HTTP on --metrics-port. Names are stable: dashboards and the benchmark
harness (handover latency) read them.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from baton.serving.grpc_server import PortInUse

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# the handover is compared with one decode step (a few ms): finer where it lives
HANDOVER_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.006, 0.008, 0.01, 0.0125, 0.015, 0.02,
                    0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)


class Metrics:
    def __init__(self, role: str):
        self.registry = CollectorRegistry()
        r = self.registry
        self.role = role
        self.model = ""                 # set by `serving_model` once the model is known
        self.info = Gauge("baton_model_info", "1, labelled with the model this process serves and its role",
                          ["model", "role"], registry=r)
        # the router's view of each request, per model (what vLLM users chart)
        m = ["model"]
        self.requests = Counter("baton_requests", "requests finished, by how: stop / length / abort, or the "
                                "error status (unavailable, cancelled, ...)", [*m, "status"], registry=r)
        self.ttft = Histogram("baton_ttft_seconds", "request arrival -> its first token sent to the client",
                              m, buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("baton_itl_seconds", "time between two tokens sent to the client (a chunk of n "
                             "tokens counts n intervals)", m, buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("baton_e2e_seconds", "request arrival -> its last token", m, buckets=LATENCY_BUCKETS,
                             registry=r)
        self.queue_seconds = Histogram("baton_queue_seconds", "time waiting for the router's admission slot",
                                       m, buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("baton_prompt_tokens", "prompt tokens of finished requests", m, registry=r)
        self.generation_tokens = Counter("baton_generation_tokens", "tokens sent to clients", m, registry=r)
        self.router_running = Gauge("baton_router_running", "requests routed to workers now", m, registry=r)
        self.router_waiting = Gauge("baton_router_waiting", "requests queued for an admission slot now", m,
                                    registry=r)
        self.running = Gauge("baton_running", "sequences running", registry=r)
        self.waiting = Gauge("baton_waiting", "sequences waiting (incl. KV not yet arrived)", registry=r)
        self.kv_blocks_total = Gauge("baton_kv_blocks_total", "KV cache blocks", registry=r)
        self.kv_blocks_free = Gauge("baton_kv_blocks_free", "KV cache blocks free", registry=r)
        self.kv_usage = Gauge("baton_kv_cache_usage_ratio", "share of KV cache blocks in use (0..1)", registry=r)
        self.kv_transfer_bytes = Counter("baton_kv_transfer_bytes", "KV bytes moved", ["direction"], registry=r)
        self.kv_transfer_seconds = Histogram("baton_kv_transfer_seconds", "KV transfer latency",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.kv_transfer_failures = Counter("baton_kv_transfer_failures", "failed KV transfers", ["reason"],
                                            registry=r)
        self.handover = Histogram("baton_handover_seconds", "prefill's last forward -> decode's first step",
                                  buckets=HANDOVER_BUCKETS, registry=r)
        self.kv_landed = Histogram("baton_kv_landed_seconds", "prefill's last forward -> its KV landed on the "
                                   "decode worker (the handover's transfer part)", buckets=HANDOVER_BUCKETS, registry=r)
        self.migrations = Counter("baton_migrations", "running streams whose worker died: moved to a survivor "
                                  "(migrated) or ended (refused: no survivor or --max-migrations reached)",
                                  ["outcome"], registry=r)
        self.step_seconds = Histogram("baton_step_seconds", "engine step time", ["kind"],
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.worker_losses = Counter("baton_worker_losses", "workers the router left while serving through them, "
                                     "by how: hung (no answer, or an engine core without progress) or dead "
                                     "(unreachable)", ["role", "how"], registry=r)
        self.stream_stalls = Counter("baton_stream_stalls", "running streams moved off a worker that answered "
                                     "health checks but sent them no token for their stall limit", ["role"],
                                     registry=r)

    def serving_model(self, name: str) -> None:
        self.model = name
        self.info.labels(name, self.role).set(1)

    def serve(self, port: int | None, host: str = "127.0.0.1") -> None:
        if port is None:
            return
        try:
            start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise PortInUse(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}; stop the other process "
                            "or pick another with --metrics-port") from None

    def observe_engine(self, running: int, waiting: int, total: int, free: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_blocks_total.set(total)
        self.kv_blocks_free.set(free)
        self.kv_usage.set((total - free) / total if total else 0.0)


def observe_many(histogram, value: float, count: int) -> None:
    """`count` observations of `value` at once: what `count` calls of histogram.observe(value) add
    (prometheus_client has no weighted observe). The router's inter-token latency is one value per
    token, and a paced message carries tens of tokens: one bucket update instead of tens (this uses
    the child's _sum / _upper_bounds / _buckets, as observe() does; tests/test_services.py checks the
    two agree)."""
    if count <= 0:
        return
    histogram._sum.inc(value * count)
    for i, bound in enumerate(histogram._upper_bounds):
        if value <= bound:
            histogram._buckets[i].inc(count)
            break


RECORDED_BY = {
    "baton_model_info": "every process", "baton_requests": "router; decode, colocated (their own requests)",
    "baton_ttft_seconds": "router", "baton_itl_seconds": "router", "baton_e2e_seconds": "router",
    "baton_queue_seconds": "router", "baton_prompt_tokens": "router", "baton_generation_tokens": "router",
    "baton_router_running": "router", "baton_router_waiting": "router", "baton_migrations": "router",
    "baton_running": "workers", "baton_waiting": "workers", "baton_kv_blocks_total": "workers",
    "baton_kv_blocks_free": "workers", "baton_kv_cache_usage_ratio": "workers",
    "baton_kv_transfer_bytes": "prefill (out), decode (in)", "baton_kv_transfer_seconds": "prefill",
    "baton_kv_transfer_failures": "prefill (send), decode (receive)", "baton_handover_seconds": "decode",
    "baton_kv_landed_seconds": "decode", "baton_step_seconds": "workers", "baton_worker_losses": "router",
    "baton_stream_stalls": "router",
}


def table() -> str:
    """docs/metrics.md: every metric a Baton process exports, from the definitions above."""
    lines = ["# Metrics", "",
             "Every Baton process serves Prometheus metrics on `--metrics-port` (`/metrics`). The router's",
             "request metrics are labelled by `model`; `baton_model_info{model, role}` names what each process",
             "serves. Counters are exported with the `_total` suffix, histograms as `_bucket` / `_sum` / `_count`.",
             "Generated by `python -m baton.serving.metrics > docs/metrics.md` (a test keeps it in step).", "",
             "| name | type | labels | recorded by | meaning |", "| --- | --- | --- | --- | --- |"]
    for fam in sorted(Metrics("any").registry.collect(), key=lambda f: f.name):
        kind = {"counter": "counter", "gauge": "gauge", "histogram": "histogram"}[fam.type]
        name = fam.name + ("_total" if kind == "counter" else "")
        labels = ", ".join(_labels(fam.name)) or "-"
        lines.append(f"| `{name}` | {kind} | {labels} | {RECORDED_BY[fam.name]} | {fam.documentation} |")
    return "\n".join(lines) + "\n"


def _labels(name: str) -> tuple[str, ...]:
    m = Metrics("any")
    for value in vars(m).values():
        if getattr(value, "_name", None) == name:
            return tuple(value._labelnames)
    return ()


if __name__ == "__main__":
    print(table(), end="")
