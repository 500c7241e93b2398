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


def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.slow
    for item in items:
        if item.module is not None and item.module.__name__.rsplit(".", 1)[-1] in SLOW_MODULES:
            item.add_marker(slow)
        elif SHARED_STACKS.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(slow)


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
