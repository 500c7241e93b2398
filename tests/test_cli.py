"""The `baton` command as a user meets it: `baton serve` brings the stack up and
`baton generate` streams an answer from it; bad usage says what to do."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster import REPO

from baton.serving.processes import free_port

pytestmark = pytest.mark.timeout(600)
BATON = [sys.executable, "-m", "baton"]


def test_baton_serve_then_generate_answers_paris(tmp_path):
    """With two routers sharing the port (--routers 2): both serve before the ready line, either answers,
    and the ready lines give both routers' metrics, which `baton top` reads as one deployment."""
    port = free_port()
    log = open(tmp_path / "serve.log", "wb")
    serve = subprocess.Popen([*BATON, "serve", "--port", str(port), "--num-kv-blocks", "256", "--routers", "2",
                              "--http-port", str(free_port())], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=log, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        deadline = time.monotonic() + 300
        line = b""
        while time.monotonic() < deadline and serve.poll() is None:
            line = serve.stdout.readline()
            if b"serving on" in line:
                break
        assert f"127.0.0.1:{port}".encode() in line, (tmp_path / "serve.log").read_text()
        assert (tmp_path / "serve.log").read_text().count(f"router ready on 127.0.0.1:{port}") == 2
        out = subprocess.run([*BATON, "generate", "What is the capital of France?", "--addr", f"127.0.0.1:{port}",
                              "--temperature", "0", "--max-tokens", "32"], cwd=REPO, capture_output=True,
                             timeout=120, text=True)
        assert out.returncode == 0, out.stderr
        assert "Paris" in out.stdout
        assert "FINISH_REASON" in out.stderr
        while b"--metrics-url" not in line and serve.poll() is None:       # (printed with the ready line)
            line = serve.stdout.readline()
        urls = line.decode().split("--metrics-url ")[1].split(")")[0].strip()
        assert len(urls.split(",")) == 2, line
        top = subprocess.run([*BATON, "top", "--metrics-url", urls, "--once", "--interval", "0.5"], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
        assert top.returncode == 0 and "2 of 2 routers" in top.stdout, top.stdout + top.stderr
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(60) == 0          # Ctrl-C / SIGTERM stops every child cleanly
    # nothing left listening: the router port is free again
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_generate_without_a_router_says_how_to_start_one():
    out = subprocess.run([*BATON, "generate", "hi", "--addr", f"127.0.0.1:{free_port()}", "--timeout", "3"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "baton serve" in out.stderr


def test_unknown_command_lists_the_commands():
    out = subprocess.run([*BATON, "frobnicate"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "serve" in out.stderr


def test_help_shows_what_a_user_needs_and_help_all_the_rest():
    from baton.launcher import build_parser
    from baton.models.source import PRESETS
    short, full = build_parser().format_help(), help_all(build_parser())
    for test_only in ("--npu-emulation", "--kv-fault-stall-s"):
        assert test_only not in short and test_only in full
    flowing = " ".join(short.split()).replace("- ", "-")            # (argparse wraps lines at hyphens)
    assert "--help-all" in short and all(name in flowing for name in PRESETS)
    assert "random weights" in short


def help_all(p) -> str:
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        p.parse_args(["--help-all"])
    return out.getvalue()


def test_client_help_has_no_server_flags_and_bench_says_what_smoke_launches():
    from baton.benchmarks.cli import build_parser as bench_parser
    from baton.client import build_parser
    text = build_parser().format_help()
    assert "--tls-require-client-cert" not in text and "--tls-ca" in text and "--auth-token-file" in text
    serve = bench_parser("serve")._subparsers._group_actions[0].choices["serve"].format_help()
    assert "--smoke with neither --addr nor --launch/--topologies launches its own 1p1d" in " ".join(serve.split())


def test_every_listing_of_the_bench_verbs_names_the_same_ones():
    """`baton --help`, `baton bench --help`, the README and docs/benchmarks.md all list
    `BENCHMARKS`' verbs, in its order (relay once went missing from two of them)."""
    import re

    from baton.benchmarks.cli import BENCHMARKS
    from baton.benchmarks.cli import build_parser as bench_parser
    from baton.cli import usage
    verbs = list(BENCHMARKS)
    listed = [usage(), bench_parser(selected="").format_help()]
    listed += [(REPO / doc).read_text() for doc in ("README.md", "docs/benchmarks.md")]
    for text in listed:
        found = re.findall(r"(?:bench|benchmarks:) +\{?(\w+(?: *[|/,] *\w+){2,})", text)
        assert found, text[:200]
        for names in found:
            assert re.split(r" *[|/,] *", names) == verbs, names


def test_log_records_read_as_the_progress_lines_and_lines_stay_whole():
    import io
    import logging

    from baton.serving.logs import Lines, TextFormatter, json_line
    fmt = TextFormatter()
    record = logging.LogRecord("baton.router", logging.WARNING, __file__, 1, "worker %s down", ("x",), None)
    assert fmt.format(record) == "[baton] router: warning: worker x down"
    record = logging.LogRecord("baton", logging.INFO, __file__, 1, "hello", (), None)
    assert fmt.format(record) == "[baton] hello"
    out = io.StringIO()
    writes = []
    out.write = lambda text: writes.append(text) or len(text)
    out.isatty = lambda: True                                # a terminal (elsewhere: tests/test_progress.py)
    lines = Lines(out)
    print("[baton] decode: loading", file=lines)            # print writes text, then "\n": one write out
    lines.write("\rbar 50%")                                 # a progress bar is shown as it redraws
    assert writes == ["[baton] decode: loading\n", "\rbar 50%"]
    assert '"level": "ERROR"' in json_line("baton serve: --model x: no such file")


def test_the_ready_lines_name_the_token_never_print_it(monkeypatch, tmp_path):
    from baton.launcher import build_parser, ready_lines
    token = "a-token-of-sixteen-chars-or-more"
    monkeypatch.delenv("BATON_AUTH_TOKEN", raising=False)
    grpc_line, http_line = ready_lines(build_parser().parse_args(["--api-key", token, "--http-port", "8000"]))
    assert token not in grpc_line + http_line
    assert "--auth-token <the --api-key / --auth-token token>" in grpc_line
    assert '-H "Authorization: Bearer <the --api-key / --auth-token token>"' in http_line
    monkeypatch.setenv("BATON_AUTH_TOKEN", token)         # given by its variable: the line uses it
    grpc_line, http_line = ready_lines(build_parser().parse_args(["--host", "0.0.0.0", "--http-port", "8000"]))
    assert '--auth-token "$BATON_AUTH_TOKEN"' in grpc_line and "Bearer $BATON_AUTH_TOKEN" in http_line
    assert "serving on 127.0.0.1:50051" in grpc_line and "http://127.0.0.1:8000/v1" in http_line


def test_with_several_routers_the_ready_lines_give_each_ones_metrics():
    from baton.launcher import _routers, build_parser, ready_lines
    args = build_parser().parse_args(["--routers", "2", "--metrics-port", "9100", "--http-port", "8000"])
    *_, metrics = ready_lines(args, _routers(args, [], 2, Path("/tmp")))
    assert "top --metrics-url http://127.0.0.1:9100/metrics,http://127.0.0.1:9103/metrics)" in metrics
    args = build_parser().parse_args(["--http-port", "8000"])
    assert len(ready_lines(args, _routers(args, [], 2, None))) == 2     # one router: its --http-port says all


def test_the_ready_lines_of_a_tls_stack_name_its_ca(monkeypatch, tmp_path):
    from baton.launcher import build_parser, ready_lines
    monkeypatch.delenv("BATON_AUTH_TOKEN", raising=False)
    args = build_parser().parse_args(["--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-ca", str(tmp_path / "ca.pem"),
                                      "--http-port", "8443"])
    grpc_line, http_line = ready_lines(args)
    assert f"--tls-ca {tmp_path / 'ca.pem'}" in grpc_line
    assert f"curl --cacert {tmp_path / 'ca.pem'} https://127.0.0.1:8443/v1/models" in http_line
