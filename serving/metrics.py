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
        self.requests = Counter("baton_requests", "requests finished, by status", ["status"], registry=r)
        self.ttft = Histogram("baton_ttft_seconds", "time to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("baton_itl_seconds", "inter-token latency", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("baton_e2e_seconds", "request latency", buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("baton_running", "sequences running", registry=r)
        self.waiting = Gauge("baton_waiting", "sequences waiting (incl. KV not yet arrived)", registry=r)
        self.kv_blocks_total = Gauge("baton_kv_blocks_total", "KV cache blocks", registry=r)
        self.kv_blocks_free = Gauge("baton_kv_blocks_free", "KV cache blocks free", registry=r)
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
