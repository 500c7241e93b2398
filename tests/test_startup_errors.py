"""What a user sees when a stack cannot start: `baton serve` checks the flags, the model and the
devices before it starts anything (baton/preflight.py) and says what is wrong in one line; a
worker or router that fails at start on a user error does the same, without a traceback. And the
model is made ready once, by one process, then never again."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from argparse import Namespace
from pathlib import Path

import pytest
from cluster import REPO

from baton import preflight
from baton.serving.processes import free_port

pytestmark = pytest.mark.timeout(300)
BATON = [sys.executable, "-m", "baton"]


def run(*argv: str, timeout: float = 60, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    out = subprocess.run([*BATON, *argv], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, **(env or {})})
    return out, time.monotonic() - t0


def one_line(out: subprocess.CompletedProcess) -> str:
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    return lines[0]


def serve_refuses(*flags: str, env: dict | None = None) -> str:
    """`baton serve` with these flags: exit 2 within seconds, one line, nothing started."""
    out, took = run("serve", "--port", str(free_port()), *flags, env=env)
    assert out.returncode == 2, out.stderr
    assert took < 10, f"took {took:.1f}s: the check must come before anything loads"
    line = one_line(out)
    assert line.startswith("baton serve: ") and not out.stdout
    return line


# -- baton serve: refused before anything starts ---------------------------------------------------
def test_a_hub_name_missing_from_the_cache_with_the_network_off_says_what_to_do(tmp_path):
    line = serve_refuses("Qwen/Qwen3-8B", env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)})
    assert f"--model Qwen/Qwen3-8B: not in the Hugging Face cache ({tmp_path})" in line
    assert "HF_HUB_OFFLINE is set" in line and "hf download Qwen/Qwen3-8B" in line


@pytest.mark.parametrize("how", ["flag", "variable"])
def test_a_serve_config_file_reaches_every_process_as_flags(tmp_path, how):
    """A `baton serve` file (with settings only serve has) is checked as the router would take it."""
    path = tmp_path / "serve.yaml"
    path.write_text("prefill-instances: 1\nmax-inflight: 0\n")
    flags, env = (["--config", str(path)], None) if how == "flag" else ([], {"BATON_CONFIG": str(path)})
    assert "--max-inflight must be >= 1" in serve_refuses(*flags, env=env)


def test_a_revision_of_what_is_no_hub_model_is_refused():
    assert "only a Hub model (ORG/NAME) has revisions" in serve_refuses("--revision", "v1")


@pytest.mark.parametrize("flags, says", [
    (["--port", "8000", "--http-port", "8000"], "--port (the router's gRPC) and --http-port (the OpenAI API; 0: off) are both port 8000"),
    (["--http-port", "9100", "--metrics-port", "9099"], "--http-port (the OpenAI API; 0: off) and --metrics-port + 1"),
])
def test_one_port_given_to_two_listeners_is_refused(flags, says):
    assert says in serve_refuses(*flags)


@pytest.mark.parametrize("model, says", [
    ("no-such-model", "no such preset, directory or .gguf file"),
    ("missing.gguf", "no such file"),
    ("{tmp}", "no config.json in that directory"),
])
def test_a_model_baton_cannot_load_is_one_line(model, says, tmp_path):
    assert says in serve_refuses("--model", model.format(tmp=tmp_path))


@pytest.mark.parametrize("flags, says", [
    (["--device", "gpu0"], "use cpu, cuda:N or npu:N"),
    (["--decode-devices", "cuda:x"], "--device cuda:x: use cpu, cuda:N or npu:N"),
    (["--device", "npu:0"], "no Ascend NPU"),
    (["--block-size", "3"], "block_size must be a power of two"),
    (["--auth-token-file", "/no/such/tokens"], "--auth-token-file /no/such/tokens: No such file"),
    (["--kv-secret-file", "/no/such/secret"], "--kv-secret-file /no/such/secret: No such file"),
    (["--tokenizer", "/no/such/dir"], "--tokenizer /no/such/dir: no such directory"),
    (["--max-inflight", "0"], "--max-inflight must be >= 1"),
])
def test_a_setting_a_process_would_refuse_is_one_line(flags, says):
    if "npu:0" in flags and preflight._ascend_present():
        pytest.skip("this machine has an Ascend NPU")
    assert says in serve_refuses(*flags)


@pytest.mark.skipif(preflight.cuda_devices() != 0, reason="this machine has (or may have) an NVIDIA GPU")
def test_cuda_on_a_machine_without_a_gpu_is_one_line():
    line = serve_refuses("--device", "cuda:0")
    assert "no NVIDIA GPU" in line and "use --device cpu" in line


def test_json_logs_carry_the_refusal_as_one_error_object():
    out, _ = run("serve", "--log-format", "json", "--model", "no-such-model")
    record = json.loads(one_line(out))
    assert out.returncode == 2 and record["level"] == "ERROR" and "no such preset" in record["message"]


def test_the_model_check_agrees_with_resolve_model(tmp_path):
    """The launcher's torch-free check refuses what resolve_model refuses, and lets through what it
    takes (the unknown names cost resolve_model nothing; it raises before importing anything)."""
    from baton.models.source import resolve_model
    for bad in ("no-such-model", str(tmp_path / "missing.gguf"), str(tmp_path)):
        assert preflight.model_problem(bad) is not None
        with pytest.raises(ValueError):
            resolve_model(bad)
    for good in ("smollm2-135m-instruct", "qwen3-8b", "tiny-llama"):
        assert preflight.model_problem(good) is None
    (tmp_path / "config.json").write_text("{}")
    assert preflight.model_problem(str(tmp_path)) is None
    assert preflight.model_problem("Qwen/Qwen3-8B") is None       # a Hub name: fetched when the stack starts


def test_cuda_visible_devices_is_counted_as_cuda_counts_it(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert preflight.cuda_devices() in (0, None)          # (None: a machine whose GPUs can't be told)
    assert preflight.device_problem("cpu") is None and preflight.device_problem("cpu:0") is None


# -- a process started by hand: one line too -------------------------------------------------------
def test_a_router_with_a_model_it_cannot_load_says_so_in_one_line():
    out, _ = run("router", "--port", "0", "--model", "no-such-model", "--prefill", "127.0.0.1:1",
                 "--decode", "127.0.0.1:2")
    assert out.returncode == 2 and one_line(out).startswith("baton router: unknown model 'no-such-model'")


def test_a_worker_with_a_model_it_cannot_load_says_so_in_one_line():
    out, _ = run("decode", "--port", "0", "--model", "no-such-model")
    errors = [line for line in out.stderr.splitlines() if line.strip() and not line.startswith("[baton] ")]
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert len(errors) == 1 and errors[0].startswith("baton decode: unknown model 'no-such-model'"), out.stderr


def test_a_bad_flag_value_is_one_line_not_the_usage():
    out, _ = run("decode", "--block-size", "3")
    assert out.returncode == 2 and one_line(out).startswith("baton decode: error: block_size must be a power of two")


# -- a router without healthy workers: the HTTP and gRPC users are told what they can check ------------
def test_a_router_without_workers_answers_health_with_the_workers_and_needs_no_torch(tmp_path):
    port, http = free_port(), free_port()
    log = tmp_path / "router.log"
    router = subprocess.Popen([*BATON, "router", "--port", str(port), "--http-port", str(http), "--prefill",
                               "127.0.0.1:1", "--decode", "127.0.0.1:2"], cwd=REPO, stderr=open(log, "wb"))
    try:
        deadline = time.monotonic() + 120
        while "ready on" not in log.read_text() and time.monotonic() < deadline:
            assert router.poll() is None, log.read_text()
            time.sleep(0.2)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=10)
        body = json.loads(err.value.read())
        assert err.value.code == 503 and body["reason"].startswith("no healthy worker: prefill (0 of 1 healthy)")
        assert {(w["address"], w["healthy"]) for w in body["workers"]} == {("127.0.0.1:1", False),
                                                                           ("127.0.0.1:2", False)}
        assert "libtorch" not in Path(f"/proc/{router.pid}/maps").read_text()     # transformers without torch
        out, _ = run("generate", "hi", "--addr", f"127.0.0.1:{port}", "--timeout", "10")
        assert out.returncode == 1 and "GET /health on the HTTP port or the GetServerInfo RPC" in out.stderr
        assert "is a router running" not in out.stderr and not out.stderr.startswith("\n"), out.stderr
    finally:
        router.terminate()
        router.wait(30)


def test_a_router_on_an_unconverted_gguf_converts_it_in_a_child_and_stays_torch_free(tmp_path):
    from tiny_gguf import write_tiny_gguf
    gguf = write_tiny_gguf(tmp_path / "tiny-qwen3.gguf", "qwen3")
    log = tmp_path / "router.log"
    router = subprocess.Popen([*BATON, "router", "--port", str(free_port()), "--model", str(gguf), "--cache-dir",
                               str(tmp_path / "cache"), "--colocated", "127.0.0.1:1"], cwd=REPO,
                              stderr=open(log, "wb"))
    try:
        deadline = time.monotonic() + 180
        while "ready on" not in log.read_text() and time.monotonic() < deadline:
            assert router.poll() is None, log.read_text()
            time.sleep(0.2)
        assert "converted in" in log.read_text() and "Traceback" not in log.read_text(), log.read_text()
        assert "libtorch" not in Path(f"/proc/{router.pid}/maps").read_text()
    finally:
        router.terminate()
        router.wait(30)


# -- the model, made ready once -------------------------------------------------------------------
def args_for(model: str, cache: Path) -> Namespace:
    return Namespace(model=model, tokenizer=None, revision=None, cache_dir=str(cache), log_level="info", log_format="text")


def test_a_stamp_is_ready_only_while_what_it_records_is_there(tmp_path):
    made = tmp_path / "model"
    made.mkdir()
    stamp = tmp_path / "stamp.json"
    stamp.write_text(json.dumps({"weights": str(made), "tokenizer": str(made)}))
    assert preflight.is_ready(stamp)
    made.rmdir()                                    # a cleared cache: made again
    assert not preflight.is_ready(stamp) and not preflight.is_ready(tmp_path / "none.json")


def test_the_model_is_prepared_by_one_child_once_then_never_again(tmp_path, monkeypatch):
    """A preset with its own tokenizer directory: no conversion, so the child only reads configs."""
    from baton.models.source import resolve_model
    tokenizer = resolve_model("smollm2-135m-instruct").tokenizer_dir()
    args = args_for("tiny-llama", tmp_path / "cache")
    args.tokenizer = tokenizer
    assert preflight.prepare_model(args, dict(os.environ), threading.Event()) == 0
    assert preflight.is_ready(preflight.stamp_path(args))

    def no_process(*a, **kw):
        raise AssertionError("a later start must not start a process")
    monkeypatch.setattr(preflight.subprocess, "Popen", no_process)
    assert preflight.prepare_model(args, {}, threading.Event()) == 0
