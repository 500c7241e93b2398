"""Session-wide fixtures: the embedded model (converted once) and its HF reference."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# stacks started by tests keep off port 8000 unless a test asks for the HTTP API (--http-port N)
os.environ.setdefault("BATON_HTTP_PORT", "0")

# The modules that start served stacks or run long parity checks: 12 s or more each on a 2-core
# machine, together ~90 % of the suite's time (measured 2026-11-28 with --junitxml). `make
# test-fast` (pytest -m "not slow") leaves them out, and every test elsewhere that needs a shared
# served stack (SHARED_STACKS) or is marked slow itself: the inner loop, ~2.5 minutes of CI's
# durations (2026-11-28); CI runs all.
SLOW_MODULES = frozenset({
    "test_async_scheduling", "test_benchmarks", "test_chaos", "test_choices", "test_cli", "test_compose",
    "test_contract", "test_dashboard", "test_engine", "test_first_hour", "test_goodput", "test_hub_models",
    "test_kv_direct", "test_kv_warm", "test_lm_eval", "test_logprobs", "test_long_prompts", "test_models",
    "test_openai_api", "test_openai_fields", "test_planner", "test_platform_contract", "test_quantization",
    "test_role_switch", "test_sampling", "test_security", "test_services", "test_speculative", "test_startup_errors",
    "test_structured_output", "test_tools_api", "test_vl_serving",
})


SHARED_STACKS = frozenset({"pd_cluster", "colocated_cluster"})

# `make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadfile`): each module runs
# whole on one worker (its module-scoped stack started once). The modules go out longest first, so
# that neither worker is left with a long one at the end, and the modules on the shared stacks one
# after another, so that one worker takes most of them (and starts the shared stacks once).
# CI's serial durations (2026-11-29), in seconds (test_long_prompts: after its two 7k tests became one);
# the shared stacks' modules together under SHARED.
SHARED = "shared stacks"
MODULE_SECONDS = {
    "test_chaos": 158, SHARED: 150, "test_long_prompts": 66, "test_benchmarks": 74, "test_kv_direct": 57,
    "test_speculative": 49, "test_role_switch": 49, "test_flip": 48, "test_engine": 44, "test_first_hour": 27,
    "test_kv_events": 27, "test_compose": 24, "test_hub_models": 24, "test_expert_parallel": 23,
    "test_async_scheduling": 22, "test_goodput": 20, "test_contract": 19, "test_startup_errors": 18,
    "test_quantization": 17, "test_planner": 15,
}
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER:
    # torch's OpenMP threads sleep when they wait instead of spinning: with two workers' threads and
    # their stacks on two cores, spinning threads took the cores from the ones with work (test_engine
    # ran 3.4x slower beside test_chaos; passive, 1.6x). Set before torch loads its OpenMP runtime.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # and one thread a process, as the stacks' workers already run (tests/cluster.py): the box is ~95 % busy
    # through the suite, so a second thread only adds hand-offs (test_engine beside one busy core: 57 s on one
    # thread, 62 s on two passive ones, 128 s on two spinning). Subprocesses inherit it.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def _module_name(item) -> str:
    return item.module.__name__.rsplit(".", 1)[-1] if item.module is not None else item.nodeid.split("::")[0]


def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.slow
    shared_modules = set()
    for item in items:
        if _module_name(item) in SLOW_MODULES:
            item.add_marker(slow)
        elif SHARED_STACKS.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(slow)
        if SHARED_STACKS.intersection(getattr(item, "fixturenames", ())):
            shared_modules.add(_module_name(item))
    if XDIST_WORKER:        # every worker sorts its collection alike: xdist hands the files out in this order
        def unit(item):
            return SHARED if _module_name(item) in shared_modules else _module_name(item)
        first_seen = {}
        for i, item in enumerate(items):
            first_seen.setdefault(unit(item), i)
        items.sort(key=lambda it: (-MODULE_SECONDS.get(unit(it), 0), first_seen[unit(it)]))


@pytest.fixture(scope="session")
def embedded_source():
    from baton.models import source as model_source
    return model_source.resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def embedded_llm():
    from baton.engine import LLM
    return LLM()


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch in this process on one thread for a module whose served stack shares the cores with the
    reference answers it computes here, as the workers run (OMP_NUM_THREADS=1): two threads spin
    against the stack's processes, several times slower (test_chaos's 12 stories of 40 tokens: 72 s
    against 14 s on a loaded 2-core box)."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def hf_embedded(embedded_source):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(embedded_source.weights_path, torch_dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def reliability():
    """The reliability suite's report: scenarios record into it, written once at the end."""
    from reliability import Report
    report = Report()
    yield report
    where = report.write()
    if where is not None:
        print(f"\n[reliability] report written to {where}/report.md")


@pytest.fixture(scope="session")
def pd_cluster(tmp_path_factory):
    """One router + prefill + decode on loopback, shared by the modules that only send traffic
    (services, fuzzing, the OpenAI API, metrics); modules that kill processes launch their own."""
    from cluster import Cluster

    from baton.serving.processes import free_port
    ports = {name: free_port() for name in ("router", "prefill-0", "decode-0")}
    # a 16-token prefill budget: every longer prompt's KV goes over in several pieces
    c = Cluster.launch(tmp_path_factory.mktemp("pd-logs"), prefill=1, decode=1, http=True,
                       worker_args=["--num-kv-blocks", "256", "--max-num-seqs", "32"],
                       router_args=["--metrics-port", str(ports["router"])],
                       extra={"prefill-0": ["--max-num-batched-tokens", "16", "--metrics-port", str(ports["prefill-0"])],
                              "decode-0": ["--metrics-port", str(ports["decode-0"])]})
    c.metrics_urls = {name: f"http://127.0.0.1:{port}/metrics" for name, port in ports.items()}
    yield c
    c.stop()


@pytest.fixture(scope="session")
def colocated_cluster(tmp_path_factory):
    """One router + one colocated worker, the OpenAI API on, chats rendered with the Hermes / Qwen3-style
    tools template: the tools tests' stack, which the logprobs tests reuse for their colocated
    comparison (token-id requests: the template does not touch them)."""
    from cluster import Cluster
    c = Cluster.launch(tmp_path_factory.mktemp("colocated-logs"), prefill=0, decode=0, colocated=1, http=True,
                       worker_args=["--num-kv-blocks", "128", "--max-num-seqs", "8"],
                       router_args=["--chat-template", "hermes_tools", "--reasoning-parser", "qwen3"])
    yield c
    c.stop()


@pytest.fixture
def canned_routers():
    """A router's metrics without a router: `serve(pages, health=None)` starts a tiny HTTP server that
    answers /metrics with `pages` in turn (the last one from then on) and /health with `health` (404
    when None, as a router's metrics port has none), and returns its /metrics URL. Stopped after the test.
    DOWN: a /metrics URL where nothing listens."""
    import http.server
    import json
    import threading

    servers = []

    def serve(pages: list[str], health: dict | None = None) -> str:
        pages = list(pages)

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path == "/health" and health is None:
                    self.send_error(404)
                    return
                body = json.dumps(health) if self.path == "/health" else pages.pop(0) if len(pages) > 1 else pages[0]
                self.send_response(200)
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args):
                pass
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}/metrics"
    serve.DOWN = "http://127.0.0.1:1/metrics"
    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()
