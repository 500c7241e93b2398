"""Prometheus metrics for every Baton process, in one registry per process.

Served over HTTP on --metrics-port, and by the router also on its OpenAI port's `/metrics`. Names
are stable: dashboards and the benchmark harness (handover latency) read them. The router also
exports its request metrics under the names and labels of vLLM (`vllm:*`, `model_name`), which the
dashboards users already run query (vLLM's Grafana JSON, llm-d's, the Gateway API Inference
Extension's endpoint picker): `VLLM_NAMES` maps each to the Baton metric it is made from, at scrape
time, so the two can never disagree.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics_core import Metric

from baton.serving.grpc_server import PortInUse

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
# the handover is compared with one decode step (a few ms): finer where it lives
HANDOVER_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.006, 0.008, 0.01, 0.0125, 0.015, 0.02,
                    0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
SPEC_LENGTH_BUCKETS = tuple(range(1, 18))   # tokens per verified step: 1 .. --num-speculative-tokens (<= 16) + 1


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
        self.stage_seconds = Histogram("baton_stage_seconds", "a finished request's time by stage, on the router's clock: "
                                       "queue, admit, prefill, handover, decode (they add up to its E2E; "
                                       "router/request_clock.py: STAGES)", [*m, "stage"], buckets=LATENCY_BUCKETS,
                                       registry=r)
        self.queue_seconds = Histogram("baton_queue_seconds", "time waiting for the router's admission slot",
                                       m, buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("baton_prompt_tokens", "prompt tokens of finished requests", m, registry=r)
        self.generation_tokens = Counter("baton_generation_tokens", "tokens sent to clients", m, registry=r)
        self.request_prompt_tokens = Histogram("baton_request_prompt_tokens", "prompt length of finished requests",
                                               m, buckets=TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram("baton_request_generation_tokens", "tokens each finished "
                                                   "request generated", m, buckets=TOKEN_BUCKETS, registry=r)
        self.prefill_tokens = Counter("baton_prefill_tokens", "prompt tokens this worker's engine computed (a prefix "
                                      "cache hit, or KV that came by transfer, is none): a stream moved with its KV "
                                      "adds none, one migrated by recompute its whole prompt", registry=r)
        self.kv_offload_blocks = Counter("baton_kv_offload_blocks", "KV blocks the prefix cache's host tier "
                                         "(--kv-offloading-size) took from the device (out) and brought back to it "
                                         "(in: each a block of prompt not computed again)", ["direction"], registry=r)
        self.prefix_cache_queries = Counter("baton_prefix_cache_queries", "prompt tokens of finished requests "
                                            "looked up in the workers' prefix caches", m, registry=r)
        self.prefix_cache_hits = Counter("baton_prefix_cache_hits", "of those, tokens whose KV was found there "
                                         "(cached_prompt_tokens)", m, registry=r)
        self.degraded = Gauge("baton_degraded", "1 while the router serves, but not as the deployment was built to: "
                              "a disaggregated pool has no healthy worker and colocated workers carry the load "
                              "(/health says which)", registry=r)
        self.router_kv_usage = Gauge("baton_router_kv_cache_usage_ratio", "share of KV cache blocks in use (0..1) "
                                     "over the healthy decode and colocated workers, as the router last heard",
                                     m, registry=r)
        self.router_running = Gauge("baton_router_running", "requests routed to workers now", m, registry=r)
        self.router_busy = Gauge("baton_router_busy_ratio", "share of the router's event-loop thread's time spent "
                                 "working over its last reading (~0.5 s); near 1 the router, not the workers, is "
                                 "what holds requests up: run another (--reuse-port, or a replica)", registry=r)
        self.router_message_rate = Gauge("baton_router_stream_message_rate", "messages a second the router's "
                                         "client streams may take together now: --stream-message-rate, lowered "
                                         "while the router is busy (router/pacing.py)", registry=r)
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
        self.kv_transfer_failures = Counter("baton_kv_transfer_failures", "failed KV transfers, by reason: send "
                                            "or receive (the transfer broke), or the landed KV refused before a "
                                            "token came of it (engine/kv_proof.py): stale (sent for another "
                                            "reservation), partial (wrong size), corrupt (checksum mismatch), "
                                            "unproven (no epoch and checksum came)", ["reason"], registry=r)
        self.pd_reused_tokens = Counter("baton_pd_reused_tokens", "prompt tokens whose KV a decode worker's own "
                                        "prefix cache held at admission (an earlier turn of the conversation, its "
                                        "answer included), so the prefill worker did not send it "
                                        "(--decode-prefix-reuse)", registry=r)
        self.kv_handshakes = Counter("baton_kv_handshakes", "KV senders opened (channel + layout handshake) to a "
                                     "decode worker, by what needed one first: a warm-up (the router's ConnectKV, "
                                     "before traffic) or a request (its transfer waited for it)", ["backend", "by"],
                                     registry=r)
        self.kv_warmup_seconds = Histogram("baton_kv_warmup_seconds", "ConnectKV: warming the KV sender to one "
                                           "decode worker (channel, handshake, a device pair's communicator)",
                                           ["backend"], buckets=LATENCY_BUCKETS, registry=r)
        self.handover = Histogram("baton_handover_seconds", "prefill's last forward -> decode's first step",
                                  buckets=HANDOVER_BUCKETS, registry=r)
        self.kv_landed = Histogram("baton_kv_landed_seconds", "prefill's last forward -> its KV landed on the "
                                   "decode worker (the handover's transfer part)", buckets=HANDOVER_BUCKETS, registry=r)
        self.migrations = Counter("baton_migrations", "running streams whose worker died: moved to a survivor "
                                  "(migrated) or ended (refused: no survivor or --max-migrations reached); or "
                                  "whose worker switched role: moved to a peer with their KV (moved)",
                                  ["outcome"], registry=r)
        self.role_switches = Histogram("baton_role_switch_seconds", "workers' role switches asked of this router "
                                       "(Admin.SwitchRole), by outcome (switched, rolled_back, refused): seconds "
                                       "from the call to the new role", ["outcome"], buckets=LATENCY_BUCKETS,
                                       registry=r)
        self.step_seconds = Histogram("baton_step_seconds", "engine step time", ["kind"],
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.worker_losses = Counter("baton_worker_losses", "workers the router left while serving through them, "
                                     "by how: hung (no answer, or an engine core without progress) or dead "
                                     "(unreachable)", ["role", "how"], registry=r)
        self.stream_stalls = Counter("baton_stream_stalls", "running streams moved off a worker that answered "
                                     "health checks but sent them no token for their stall limit", ["role"],
                                     registry=r)

        self.spec_draft_tokens = Counter("baton_spec_draft_tokens", "speculative decoding: guessed tokens "
                                         "verified", registry=r)
        self.spec_accepted_tokens = Counter("baton_spec_accepted_tokens", "speculative decoding: guessed tokens "
                                            "kept (the model sampled the same)", registry=r)
        self.spec_verified = Counter("baton_spec_verified_sequences", "speculative decoding: sequence-steps that "
                                     "verified guesses (tokens per such step: accepted / verified + 1)", registry=r)
        self.spec_acceptance_length = Histogram(
            "baton_spec_acceptance_length", "speculative decoding: tokens a sequence-step that verified guesses "
            "gained (guesses kept + the one sampled after them)", buckets=SPEC_LENGTH_BUCKETS, registry=r)
        self._spec_seen = (0, 0, 0)
        self._spec_lengths_seen: tuple[int, ...] = ()

        if role == "router":
            r.register(VllmNames(self))

    def serving_model(self, name: str) -> None:
        self.model = name
        self.info.labels(name, self.role).set(1)
        for metric in vars(self).values():      # the router's: 0, not "no data", before the first request
            if self.role == "router" and getattr(metric, "_labelnames", None) == ("model",):
                metric.labels(name)

    def watch_degraded(self, degraded: Callable[[], bool]) -> None:
        """The router's degraded gauge, read from `degraded()` at each scrape."""
        self.degraded.set_function(lambda: float(degraded()))

    def watch_pacing(self, busy: Callable[[], float], message_rate: Callable[[], float]) -> None:
        """The router's busy share and its streams' message budget, read at each scrape."""
        self.router_busy.set_function(busy)
        self.router_message_rate.set_function(message_rate)

    def watch_kv_usage(self, usage: Callable[[], float]) -> None:
        """The router's KV usage gauge, read from `usage()` at each scrape."""
        self.router_kv_usage.labels(self.model).set_function(usage)

    def finished(self, prompt_tokens: int, generated: int, cached_tokens: int) -> None:
        """A request's token counts, once, when it ends."""
        model = self.model
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        self.generation_tokens.labels(model).inc(generated)
        self.request_prompt_tokens.labels(model).observe(prompt_tokens)
        self.request_generation_tokens.labels(model).observe(generated)
        self.prefix_cache_queries.labels(model).inc(prompt_tokens)
        self.prefix_cache_hits.labels(model).inc(cached_tokens)

    def serve(self, port: int | None, host: str = "127.0.0.1", registry=None) -> None:
        """The metrics on their own port: this process's registry, or `registry` (the router's with its workers')."""
        if port is None:
            return
        try:
            start_http_server(port, addr=host, registry=registry or self.registry)
        except OSError as exc:
            raise PortInUse(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}; stop the other process "
                            "or pick another with --metrics-port") from None

    def observe_engine(self, running: int, waiting: int, total: int, free: int,
                       spec: tuple[int, int, int] = (0, 0, 0), spec_lengths: tuple[int, ...] = ()) -> None:
        """The engine core's gauges, and its speculation totals `spec` (draft, accepted, verified)
        and `spec_lengths` (verified sequence-steps by guesses kept): counters and histogram move by
        what they grew since the last call."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_blocks_total.set(total)
        self.kv_blocks_free.set(free)
        self.kv_usage.set((total - free) / total if total else 0.0)
        for counter, now, seen in zip((self.spec_draft_tokens, self.spec_accepted_tokens, self.spec_verified),
                                      spec, self._spec_seen, strict=True):
            if now > seen:
                counter.inc(now - seen)
        self._spec_seen = tuple(max(a, b) for a, b in zip(spec, self._spec_seen, strict=True))
        seen = self._spec_lengths_seen
        for kept, count in enumerate(spec_lengths):
            observe_many(self.spec_acceptance_length, kept + 1, count - (seen[kept] if kept < len(seen) else 0))
        self._spec_lengths_seen = tuple(max(a, b) for a, b in itertools.zip_longest(spec_lengths, seen, fillvalue=0))


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


# vLLM's name -> (the Baton metric it is made from, which of its `status` values it keeps, as finished_reason)
VLLM_NAMES: dict[str, tuple[str, tuple[str, ...]]] = {
    "vllm:num_requests_running": ("baton_router_running", ()),
    "vllm:num_requests_waiting": ("baton_router_waiting", ()),
    "vllm:kv_cache_usage_perc": ("baton_router_kv_cache_usage_ratio", ()),
    "vllm:gpu_cache_usage_perc": ("baton_router_kv_cache_usage_ratio", ()),      # its older name in vLLM
    "vllm:prompt_tokens": ("baton_prompt_tokens", ()),
    "vllm:generation_tokens": ("baton_generation_tokens", ()),
    "vllm:request_success": ("baton_requests", ("stop", "length", "abort")),
    "vllm:time_to_first_token_seconds": ("baton_ttft_seconds", ()),
    "vllm:inter_token_latency_seconds": ("baton_itl_seconds", ()),
    "vllm:time_per_output_token_seconds": ("baton_itl_seconds", ()),             # its older name in vLLM
    "vllm:e2e_request_latency_seconds": ("baton_e2e_seconds", ()),
    "vllm:request_queue_time_seconds": ("baton_queue_seconds", ()),
    "vllm:request_prompt_tokens": ("baton_request_prompt_tokens", ()),
    "vllm:request_generation_tokens": ("baton_request_generation_tokens", ()),
    "vllm:prefix_cache_queries": ("baton_prefix_cache_queries", ()),
    "vllm:prefix_cache_hits": ("baton_prefix_cache_hits", ()),
}


class VllmNames:
    """A collector that re-exports the router's request metrics under vLLM's names, with `model`
    renamed `model_name` (and a request's `status` as `finished_reason`), read at each scrape."""

    def __init__(self, metrics: Metrics):
        self.sources = {v._name: v for v in vars(metrics).values() if hasattr(v, "_name") and hasattr(v, "collect")}

    def describe(self):
        return []                       # nothing to check up front: the sources are registered already

    def collect(self):
        families: dict[str, list[Metric]] = {}
        for name, (source, keep) in VLLM_NAMES.items():
            if source not in families:
                families[source] = self.sources[source].collect()
            for fam in families[source]:
                yield _renamed(fam, name, keep)


def _renamed(fam: Metric, name: str, keep: tuple[str, ...]) -> Metric:
    out = Metric(name, f"{fam.documentation} (Baton's {fam.name})", fam.type)
    for s in fam.samples:
        if s.name.endswith("_created"):
            continue                    # when the series began: no dashboard reads it
        labels = dict(s.labels)
        if keep:
            if labels.get("status") not in keep:
                continue
            labels["finished_reason"] = labels.pop("status")
        if "model" in labels:
            labels["model_name"] = labels.pop("model")
        out.add_sample(name + s.name[len(fam.name):], labels, s.value, s.timestamp, s.exemplar)
    return out


RECORDED_BY = {
    "baton_model_info": "every process", "baton_requests": "router; decode, colocated (their own requests)",
    "baton_ttft_seconds": "router", "baton_itl_seconds": "router", "baton_e2e_seconds": "router",
    "baton_queue_seconds": "router", "baton_prompt_tokens": "router", "baton_generation_tokens": "router",
    "baton_router_running": "router", "baton_router_waiting": "router", "baton_migrations": "router",
    "baton_role_switch_seconds": "router",    "baton_prefill_tokens": "prefill, decode, colocated",
    "baton_kv_offload_blocks": "prefill, colocated (with --kv-offloading-size)",
    "baton_running": "workers", "baton_waiting": "workers", "baton_kv_blocks_total": "workers",
    "baton_kv_blocks_free": "workers", "baton_kv_cache_usage_ratio": "workers",
    "baton_kv_transfer_bytes": "prefill (out), decode (in)", "baton_kv_transfer_seconds": "prefill",
    "baton_kv_transfer_failures": "prefill (send), decode (the rest)", "baton_kv_handshakes": "prefill",
    "baton_kv_warmup_seconds": "prefill", "baton_handover_seconds": "decode", "baton_pd_reused_tokens": "decode",
    "baton_kv_landed_seconds": "decode", "baton_step_seconds": "workers", "baton_worker_losses": "router",
    "baton_stream_stalls": "router", "baton_request_prompt_tokens": "router",
    "baton_request_generation_tokens": "router", "baton_prefix_cache_queries": "router",
    "baton_prefix_cache_hits": "router", "baton_router_kv_cache_usage_ratio": "router", "baton_degraded": "router", "baton_stage_seconds": "router",
    "baton_router_busy_ratio": "router", "baton_router_stream_message_rate": "router",
    "baton_spec_draft_tokens": "decode, colocated (with --speculative-method)",
    "baton_spec_accepted_tokens": "decode, colocated (with --speculative-method)",
    "baton_spec_verified_sequences": "decode, colocated (with --speculative-method)",
    "baton_spec_acceptance_length": "decode, colocated (with --speculative-method)",
}


def table() -> str:
    """docs/metrics.md: every metric a Baton process exports, from the definitions above."""
    lines = ["# Metrics", "",
             "Every Baton process serves Prometheus metrics on `--metrics-port` (`/metrics`); the router also on",
             "its OpenAI port (`--http-port`, default 8000: `http://HOST:8000/metrics`, no token needed, as vLLM's).",
             "The router's request metrics are labelled by `model`; `baton_model_info{model, role}` names what",
             "each process serves. Counters are exported with the `_total` suffix, histograms as `_bucket` /",
             "`_sum` / `_count`. Generated by `python -m baton.serving.metrics > docs/metrics.md` (a test keeps",
             "it in step).", "",
             "| name | type | labels | recorded by | meaning |", "| --- | --- | --- | --- | --- |"]
    kinds = {"counter": "counter", "gauge": "gauge", "histogram": "histogram"}
    for fam in sorted(Metrics("any").registry.collect(), key=lambda f: f.name):
        name = fam.name + ("_total" if fam.type == "counter" else "")
        labels = ", ".join(_labels(fam.name)) or "-"
        lines.append(f"| `{name}` | {kinds[fam.type]} | {labels} | {RECORDED_BY[fam.name]} | {fam.documentation} |")
    lines += ["", "## vLLM's names", "",
              "The router exports these too, so dashboards made for vLLM (its Grafana JSON, llm-d's, the Gateway",
              "API Inference Extension's endpoint picker) work unchanged: each is the Baton metric beside it, read",
              "at the same scrape, with the label `model` renamed `model_name`. `deploy/observability/` holds a",
              "Grafana dashboard on them (tests/test_dashboard.py runs its queries against a live router).", "",
              "| vLLM's name | type | labels | made from |", "| --- | --- | --- | --- |"]
    router = {f.name: f for f in Metrics("router").registry.collect()}
    for name, (source, keep) in VLLM_NAMES.items():
        fam = router[name]
        shown = name + ("_total" if fam.type == "counter" else "")
        labels = ", ".join(["model_name", *(["finished_reason"] if keep else [])])
        kept = f" (status {' / '.join(keep)})" if keep else ""
        lines.append(f"| `{shown}` | {kinds[fam.type]} | {labels} | `{source}`{kept} |")
    lines += ["", "Not exported (Baton has no such state, or counts it elsewhere): `vllm:num_requests_swapped`,",
              "`vllm:num_preemptions_total`, `vllm:request_prefill_time_seconds`, `vllm:request_decode_time_seconds`.",
              ""]
    return "\n".join(lines)


def _labels(name: str) -> tuple[str, ...]:
    m = Metrics("any")
    for value in vars(m).values():
        if getattr(value, "_name", None) == name:
            return tuple(value._labelnames)
    return ()


if __name__ == "__main__":
    print(table(), end="")
