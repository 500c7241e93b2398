"""Writes Baton's Grafana dashboard: deploy/observability/grafana/dashboards/baton.json.

    python deploy/observability/dashboard.py      # after editing this file; a test keeps them in step

Its request panels query vLLM's names (`vllm:*`, `model_name`), which the router exports beside its
own, so the dashboard and the ones users already run for vLLM read the same series; the panels on
what only Baton has (migrations, lost workers, KV transfer, handover) query `baton_*`.
tests/test_dashboard.py runs every query against a live stack's /metrics after known requests.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).parent / "grafana" / "dashboards" / "baton.json"
MODEL = 'model_name=~"$model_name"'
RATE = "[$__rate_interval]"


def quantiles(metric: str, qs=(0.5, 0.99)) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{MODEL}}}{RATE})))", f"p{int(q * 100)}")
            for q in qs]


def mean(metric: str) -> tuple[str, str]:
    return (f"sum(rate({metric}_sum{{{MODEL}}}{RATE})) / sum(rate({metric}_count{{{MODEL}}}{RATE}))", "mean")


# (title, unit, [(query, legend)], kind); grouped in rows of two panels
PANELS = [
    ("Requests finished / s, by finish reason", "reqps",
     [(f"sum by (finished_reason) (rate(vllm:request_success_total{{{MODEL}}}{RATE}))", "{{finished_reason}}")],
     "timeseries"),
    ("Requests failed / s, by status (Baton)", "reqps",
     [(f'sum by (status) (rate(baton_requests_total{{model=~"$model_name", status!~"stop|length|abort"}}{RATE}))',
       "{{status}}")], "timeseries"),
    ("Token throughput", "tokens/s",
     [(f"sum(rate(vllm:prompt_tokens_total{{{MODEL}}}{RATE}))", "prompt"),
      (f"sum(rate(vllm:generation_tokens_total{{{MODEL}}}{RATE}))", "generation")], "timeseries"),
    ("Scheduler state", "short",
     [(f"sum(vllm:num_requests_running{{{MODEL}}})", "running"),
      (f"sum(vllm:num_requests_waiting{{{MODEL}}})", "waiting")], "timeseries"),
    ("Time to first token", "s", [*quantiles("vllm:time_to_first_token_seconds"),
                                  mean("vllm:time_to_first_token_seconds")], "timeseries"),
    ("Inter-token latency", "s", [*quantiles("vllm:inter_token_latency_seconds"),
                                  mean("vllm:inter_token_latency_seconds")], "timeseries"),
    ("End-to-end request latency", "s", [*quantiles("vllm:e2e_request_latency_seconds"),
                                         mean("vllm:e2e_request_latency_seconds")], "timeseries"),
    ("Queue time (router admission)", "s", quantiles("vllm:request_queue_time_seconds"), "timeseries"),
    ("KV cache usage (decode workers)", "percentunit",
     [(f"max(vllm:kv_cache_usage_perc{{{MODEL}}})", "used")], "timeseries"),
    ("Prefix cache hit rate", "percentunit",
     [(f"sum(rate(vllm:prefix_cache_hits_total{{{MODEL}}}{RATE})) / "
       f"sum(rate(vllm:prefix_cache_queries_total{{{MODEL}}}{RATE}))", "hits / queried prompt tokens")],
     "timeseries"),
    ("Prompt length", "short",
     [(f"sum by (le) (increase(vllm:request_prompt_tokens_bucket{{{MODEL}}}{RATE}))", "{{le}}")], "heatmap"),
    ("Generation length", "short",
     [(f"sum by (le) (increase(vllm:request_generation_tokens_bucket{{{MODEL}}}{RATE}))", "{{le}}")], "heatmap"),
    ("Stream migrations and lost workers (Baton)", "short",
     [(f"sum by (outcome) (increase(baton_migrations_total{RATE}))", "migration {{outcome}}"),
      (f"sum by (role, how) (increase(baton_worker_losses_total{RATE}))", "lost {{role}} ({{how}})")],
     "timeseries"),
    ("KV transfer (Baton workers)", "Bps",
     [(f"sum by (direction) (rate(baton_kv_transfer_bytes_total{RATE}))", "{{direction}}"),
      (f"sum by (reason) (rate(baton_kv_transfer_failures_total{RATE}))", "failed: {{reason}}")],
     "timeseries"),
    ("Prefill-to-decode handover, p99 (Baton)", "s",
     [(f"histogram_quantile(0.99, sum by (le) (rate(baton_handover_seconds_bucket{RATE})))", "handover"),
      (f"histogram_quantile(0.99, sum by (le) (rate(baton_kv_landed_seconds_bucket{RATE})))", "KV landed")],
     "timeseries"),
    ("Engine step time, p99, by kind (Baton workers)", "s",
     [(f"histogram_quantile(0.99, sum by (le, kind) (rate(baton_step_seconds_bucket{RATE})))", "{{kind}}")],
     "timeseries"),
    ("Router busy share: near 1, the router is the limit (Baton)", "percentunit",
     [("max(baton_router_busy_ratio)", "busiest router")], "timeseries"),
]


def panel(i: int, title: str, unit: str, targets: list[tuple[str, str]], kind: str) -> dict:
    p = {"id": i + 1, "type": kind, "title": title, "datasource": {"type": "prometheus", "uid": "${datasource}"},
         "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
         "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
         "targets": [{"refId": chr(ord("A") + n), "expr": expr, "legendFormat": legend,
                      "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                     for n, (expr, legend) in enumerate(targets)]}
    if kind == "heatmap":
        p["targets"] = [{**t, "format": "heatmap"} for t in p["targets"]]
        p["options"] = {"calculate": False, "yAxis": {"unit": unit}}
    return p


def dashboard() -> dict:
    return {
        "uid": "baton-overview", "title": "Baton", "tags": ["baton", "vllm", "llm"], "timezone": "browser",
        "schemaVersion": 39, "version": 1, "editable": True, "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus"},
            {"name": "model_name", "label": "Model", "type": "query", "refresh": 2, "includeAll": True,
             "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"},
             "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "definition": "label_values(vllm:num_requests_running, model_name)",
             "query": {"query": "label_values(vllm:num_requests_running, model_name)", "refId": "model_name"}},
        ]},
        "panels": [panel(i, *spec) for i, spec in enumerate(PANELS)],
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(render())
    print(f"wrote {OUT}", file=sys.stderr)
