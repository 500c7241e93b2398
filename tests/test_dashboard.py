"""The shipped Grafana dashboard (deploy/observability/) and the panels of vLLM's own dashboards
read what a live Baton stack exports: known requests go through the OpenAI API of a real
`baton serve`, then every query's selectors are matched against the router's /metrics on its HTTP
port, the one scrape target (the worker's series served there beside the router's), as
Prometheus would scrape it.

Each query is checked twice. Its selectors: every vector selector (name and label matchers,
Grafana's variables put in) picks series out of the scrape, every `by (...)` label is on them, and
where the requests fix the answer the selected series sum to it. And its value: the query is
evaluated (tests/promql_eval.py: no PromQL evaluator is on PyPI, and no Prometheus server can be
fetched here) over a scrape before and one after the known requests, and gives what those requests
make: token and request rates, finish reasons, prefix-cache hit ratio, token-count histograms bucket
by bucket, latency quantiles and means inside what the client measured, idle gauges at 0, and no
value for events that did not happen (migrations, lost workers, KV transfers of a colocated worker)."""
from __future__ import annotations

import importlib.util
import json
import math
import re
import time
import urllib.request

import promql_parser
import pytest
from cluster import REPO
from prometheus_client.parser import text_string_to_metric_families
from promql_eval import Scrapes
from tiny_hub import Serve, tiny_checkpoint

from baton.serving.metrics import LATENCY_BUCKETS
from baton.serving.processes import free_port

pytestmark = pytest.mark.timeout(300)
DASHBOARD = REPO / "deploy" / "observability" / "grafana" / "dashboards" / "baton.json"
MAX_TOKENS = 5
TOKEN = "dashboard-test-token"
PROMPTS = ["the quick brown fox jumps over the lazy dog, then it sleeps in the sun " * 2] * 2 + ["hello there"]

# The queries of vLLM's common panels (its examples/observability Grafana JSON; llm-d's and the
# Gateway API Inference Extension's endpoint picker read the same gauges), as they select series.
VLLM_PANELS = [
    'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$model_name"}'
    '[$__rate_interval])))',
    'rate(vllm:e2e_request_latency_seconds_sum{model_name="$model_name"}[$__rate_interval]) / '
    'rate(vllm:e2e_request_latency_seconds_count{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_per_output_token_seconds_bucket{model_name="$model_name"}'
    '[$__rate_interval])))',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket{model_name="$model_name"}'
    '[$__rate_interval])))',
    'vllm:num_requests_running{model_name="$model_name"}',
    'vllm:num_requests_waiting{model_name="$model_name"}',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="$model_name"}'
    '[$__rate_interval])))',
    'vllm:gpu_cache_usage_perc{model_name="$model_name"}',
    'vllm:kv_cache_usage_perc{model_name="$model_name"}',
    'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}[$__rate_interval]))',
    'rate(vllm:request_queue_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'sum(rate(vllm:prefix_cache_hits_total[5m])) / sum(rate(vllm:prefix_cache_queries_total[5m]))',
]
# counters with a label value per event (a migration's outcome, a lost worker's role): no series
# until one happens, which these requests do not make; their family must be exported all the same
EVENT_ONLY = {"baton_requests_total", "baton_migrations_total", "baton_worker_losses_total",
              "baton_kv_transfer_bytes_total", "baton_kv_transfer_failures_total"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A colocated `baton serve` on a tiny checkpoint; the known requests; two scrapes of one target,
    the router's /metrics on its HTTP port (the worker's series come with it: --worker-metrics,
    which `baton serve` turns on), as a Prometheus pointed at it would take them."""
    tmp = tmp_path_factory.mktemp("dashboard")
    model = tiny_checkpoint(tmp / "tiny-model")
    port, http = free_port(), free_port()
    serve = Serve([str(model), "--colocated", "--port", str(port), "--http-port", str(http),
                   "--cache-dir", str(tmp / "cache"), "--num-kv-blocks", "64", "--api-key", TOKEN],
                  {}, tmp / "serve.log")
    url = f"http://127.0.0.1:{http}/metrics"
    try:
        before = parse(scrape_until(url, 0))
        t0 = time.monotonic()
        usages, walls = [], []
        for prompt in PROMPTS:
            start = time.monotonic()
            usages.append(complete(http, prompt))
            walls.append(time.monotonic() - start)
        router = scrape_until(url, len(PROMPTS))
        seconds = time.monotonic() - t0
    finally:
        serve.stop()
    return {"model": "tiny-model", "usages": usages, "series": parse(router), "families": families(router),
            "router_text": router, "router": parse(router), "scrapes": Scrapes(before, parse(router), seconds),
            "longest_request": max(walls)}


def complete(http: int, prompt: str) -> dict:
    body = json.dumps({"model": "tiny-model", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{http}/v1/completions", body,
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)["usage"]


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def scrape_until(url: str, finished: int) -> str:
    """The merged metrics once the worker's are in (its series carry `worker`), the router has
    counted every request finished (it counts as a stream ends) and its KV gauge, which says what
    it heard at its last health check (every 0.5 s), has caught up with the idle worker."""
    deadline = time.monotonic() + 10
    while True:
        text = scrape(url)
        samples = parse(text)
        done = sum(s.value for s in samples if s.name == "vllm:request_success_total")
        kv = sum(s.value for s in samples if s.name == "vllm:kv_cache_usage_perc")
        if (done >= finished and 'worker="' in text and kv == 0) or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def parse(text: str) -> list:
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def families(text: str) -> set[str]:
    """The metric names a scrape declares (a counter under its name with and without _total)."""
    names = re.findall(r"^# TYPE (\S+) ", text, flags=re.M)
    return {*names, *(f"{n}_total" for n in names)}


def grafana(expr: str, model: str) -> str:
    """The query as Grafana sends it: its variables put in (the model's name has no regex character)."""
    return expr.replace("$__rate_interval", "1m").replace("$model_name", model)


def selectors(expr: str) -> list[tuple[object, tuple[str, ...]]]:
    """Every vector selector of the query, with the `by (...)` labels of the aggregations above it."""
    found, by = [], []

    def pre(node):
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None and \
                node.modifier.type == promql_parser.AggModifierType.By:
            by.append(tuple(node.modifier.labels))
        if isinstance(node, promql_parser.VectorSelector):
            found.append((node, tuple(label for labels in by for label in labels)))

    def post(node):
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None and \
                node.modifier.type == promql_parser.AggModifierType.By:
            by.pop()

    promql_parser.walk(promql_parser.parse(expr), pre, post)
    return found


def matches(selector, sample) -> bool:
    if sample.name != selector.name:
        return False
    for m in selector.matchers.matchers:
        value = sample.labels.get(m.name, "")
        op = promql_parser.MatchOp
        if m.op == op.Equal:
            ok = value == m.value
        elif m.op == op.NotEqual:
            ok = value != m.value
        else:
            ok = (re.fullmatch(m.value, value) is not None) == (m.op == op.Re)
        if not ok:
            return False
    return True


def expected(stack) -> dict[str, float]:
    """What the known requests make each selected series sum to."""
    prompt = sum(u["prompt_tokens"] for u in stack["usages"])
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in stack["usages"])
    n, generated = len(PROMPTS), len(PROMPTS) * MAX_TOKENS
    out = {"vllm:prompt_tokens_total": prompt, "vllm:generation_tokens_total": generated,
           "vllm:request_success_total": n, "vllm:prefix_cache_queries_total": prompt,
           "vllm:prefix_cache_hits_total": cached, "vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0,
           "vllm:request_prompt_tokens_count": n, "vllm:request_prompt_tokens_sum": prompt,
           "vllm:request_generation_tokens_count": n, "vllm:request_generation_tokens_sum": generated,
           "vllm:inter_token_latency_seconds_count": generated - n,      # the gaps between a request's tokens
           "vllm:time_per_output_token_seconds_count": generated - n}
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        out[f"vllm:{name}_count"] = n
    return out


def check_query(stack, expr: str) -> None:
    expr = grafana(expr, stack["model"])
    want = expected(stack)
    for selector, by in selectors(expr):
        picked = [s for s in stack["series"] if matches(selector, s)]
        if not picked:
            assert selector.name in EVENT_ONLY and selector.name in stack["families"], \
                f"{selector} selects nothing from Baton's /metrics (in {expr})"
            continue
        for s in picked:
            missing = set(by) - set(s.labels)
            assert not missing, f"{s.name} lacks the label(s) {missing} that {expr} groups by"
        name = selector.name.removesuffix("_bucket")
        if selector.name.endswith("_bucket"):       # the +Inf bucket is the count
            picked, name = [s for s in picked if s.labels["le"] == "+Inf"], f"{name}_count"
        if name in want:
            assert sum(s.value for s in picked) == pytest.approx(want[name]), f"{selector} in {expr}"


def dashboard_queries() -> list[str]:
    return [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]


def test_the_dashboard_json_is_what_its_generator_writes():
    spec = importlib.util.spec_from_file_location("dashboard", REPO / "deploy" / "observability" / "dashboard.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert DASHBOARD.read_text() == gen.render(), "regenerate: python deploy/observability/dashboard.py"


@pytest.mark.parametrize("expr", dashboard_queries())
def test_each_dashboard_query_selects_what_baton_exports(stack, expr):
    check_query(stack, expr)


@pytest.mark.parametrize("expr", VLLM_PANELS)
def test_each_vllm_panel_query_selects_what_baton_exports(stack, expr):
    check_query(stack, expr)


def test_the_known_requests_hit_the_prefix_cache_and_are_counted(stack):
    """The repeated prompt found its blocks cached; the counters say so, in both names."""
    assert stack["usages"][1]["prompt_tokens_details"]["cached_tokens"] > 0
    series = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in stack["router"]}
    hits = series[("vllm:prefix_cache_hits_total", (("model_name", stack["model"]),))]
    assert hits == series[("baton_prefix_cache_hits_total", (("model", stack["model"]),))] > 0


def test_the_model_variable_finds_the_model(stack):
    """The dashboard's $model_name comes from label_values(vllm:num_requests_running, model_name)."""
    variable = next(v for v in json.loads(DASHBOARD.read_text())["templating"]["list"] if v["name"] == "model_name")
    metric, label = re.fullmatch(r"label_values\((\S+), (\w+)\)", variable["definition"]).groups()
    assert {s.labels[label] for s in stack["series"] if s.name == metric} == {stack["model"]}


def test_metrics_on_the_http_port_need_no_token_and_carry_both_names(stack):
    """Scraped without the --api-key every /v1 request needed, as Prometheus scrapes vLLM's."""
    text = stack["router_text"]
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text and "# TYPE baton_ttft_seconds histogram" in text
    assert not re.search(r"^vllm:\S+_created", text, flags=re.M)


@pytest.mark.parametrize("expr, says", [
    ('vllm:num_requests_swapped{model_name="$model_name"}', "selects nothing"),       # vLLM has it; Baton not
    ('sum by (engine) (vllm:num_requests_running{model_name="$model_name"})', "lacks the label(s) {'engine'}"),
    ('vllm:prompt_tokens_total{model_name="another-model"}', "selects nothing"),
])
def test_the_check_refuses_what_baton_does_not_export(stack, expr, says):
    with pytest.raises(AssertionError, match=re.escape(says)):
        check_query(stack, expr)


# what each evaluated query must give, by the first metric it reads (a prefix of its name)
LATENCIES = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
             "vllm:time_per_output_token_seconds", "vllm:request_queue_time_seconds", "baton_step_seconds")
NEVER_HAPPENED = ("baton_requests_total", "baton_migrations_total", "baton_worker_losses_total",
                  "baton_kv_transfer_bytes_total", "baton_kv_transfer_failures_total", "baton_handover_seconds",
                  "baton_kv_landed_seconds")


def check_value(stack, expr: str) -> None:
    expr = grafana(expr, stack["model"])
    scrapes = stack["scrapes"]
    result = scrapes.evaluate(expr)
    values = [result] if isinstance(result, float) else list(result.values())
    metric = selectors(expr)[0][0].name
    usages, n = stack["usages"], len(PROMPTS)
    prompt = sum(u["prompt_tokens"] for u in usages)
    per_second = 1 / scrapes.seconds if "rate(" in expr else 1.0      # rate(), or increase()
    if metric.startswith(NEVER_HAPPENED):
        assert all(v == 0 or math.isnan(v) for v in values), (expr, result)
    elif metric.startswith(LATENCIES):
        # every latency of these requests lies inside the client's longest wait (a quantile inside
        # the bucket that holds it); queue time may be 0, the others are not
        bound = min(b for b in BUCKET_BOUNDS if b >= stack["longest_request"])
        low = 0 if "queue" in metric else 1e-9
        assert values and all(low <= v <= bound for v in values), (expr, result, bound)
    elif metric == "vllm:request_success_total":
        assert result == {(("finished_reason", "length"),): pytest.approx(n * per_second)}, expr
    elif metric == "vllm:prompt_tokens_total":
        assert values == [pytest.approx(prompt * per_second)], expr
    elif metric == "vllm:generation_tokens_total":
        assert values == [pytest.approx(n * MAX_TOKENS * per_second)], expr
    elif metric == "vllm:prefix_cache_hits_total":
        cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
        assert values == [pytest.approx(cached / prompt)] and 0 < cached < prompt, expr
    elif metric.startswith(("vllm:request_prompt_tokens", "vllm:request_generation_tokens")):
        counts = [u["prompt_tokens"] for u in usages] if "prompt" in metric else [MAX_TOKENS] * n
        for labels, v in result.items():          # each bucket: how many requests fell at or under it
            le = float(dict(labels)["le"])
            assert v == sum(c <= le for c in counts), (expr, labels, v)
    elif metric.startswith(("vllm:num_requests", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")):
        assert values == [0.0], (expr, result)    # idle once the requests are done
    elif metric == "baton_router_busy_ratio":     # a share of one thread's time; a few requests leave it low
        assert values and all(0 <= v < 0.8 for v in values), (expr, result)
    else:
        raise AssertionError(f"no expectation for {expr}: add one")


BUCKET_BOUNDS = (*LATENCY_BUCKETS, math.inf)


@pytest.mark.parametrize("expr", dashboard_queries() + VLLM_PANELS)
def test_each_query_evaluates_to_what_the_known_requests_make(stack, expr):
    check_value(stack, expr)


def test_the_evaluator_follows_prometheus_on_a_known_histogram():
    """Prometheus's documented interpolation: rank 2 of 4 falls in (1, 2] holding counts 1..3 -> 1.5;
    past the last finite bound -> that bound; an empty histogram -> NaN; sum / count is the mean."""
    from prometheus_client.samples import Sample
    from promql_eval import histogram_quantile

    def bucket(le, v):
        return Sample("h_bucket", {"le": le}, v)
    after = [bucket("1.0", 1), bucket("2.0", 3), bucket("+Inf", 4), Sample("h_sum", {}, 6.0), Sample("h_count", {}, 4)]
    scrapes = Scrapes([], after, 2.0)
    assert scrapes.evaluate("histogram_quantile(0.5, sum by (le) (increase(h_bucket[1m])))") == {(): 1.5}
    assert scrapes.evaluate("histogram_quantile(0.99, sum by (le) (rate(h_bucket[1m])))") == {(): 2.0}
    assert scrapes.evaluate("sum(rate(h_sum[1m])) / sum(rate(h_count[1m]))") == {(): 1.5}
    assert math.isnan(histogram_quantile(0.5, {(("le", "+Inf"),): 0.0})[()])
