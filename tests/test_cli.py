"""The `baton` command as a user meets it: `baton serve` brings the stack up and
`baton generate` streams an answer from it; bad usage says what to do."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from cluster import REPO

from baton.serving.processes import free_port

pytestmark = pytest.mark.timeout(600)
BATON = [sys.executable, "-m", "baton"]


def test_baton_serve_then_generate_answers_paris(tmp_path):
    port = free_port()
    log = open(tmp_path / "serve.log", "wb")
    serve = subprocess.Popen([*BATON, "serve", "--port", str(port), "--num-kv-blocks", "256"], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=log, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        deadline = time.monotonic() + 300
        line = b""
        while time.monotonic() < deadline and serve.poll() is None:
            line = serve.stdout.readline()
            if b"serving on" in line:
                break
        assert f"127.0.0.1:{port}".encode() in line, (tmp_path / "serve.log").read_text()
        out = subprocess.run([*BATON, "generate", "What is the capital of France?", "--addr", f"127.0.0.1:{port}",
                              "--temperature", "0", "--max-tokens", "32"], cwd=REPO, capture_output=True,
                             timeout=120, text=True)
        assert out.returncode == 0, out.stderr
        assert "Paris" in out.stdout
        assert "FINISH_REASON" in out.stderr
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
