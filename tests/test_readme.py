"""The README's examples, run as written against a real stack (the shared 1 prefill + 1 decode
cluster, its addresses put in for the README's defaults): the gRPC stub snippet, the grpcurl
request body, the OpenAI client snippet and the offline `LLM.chat` snippet (as a script) each answer the
README's question right."""
from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys

from cluster import REPO
from google.protobuf import json_format

from baton.v1 import router_pb2

README = (REPO / "README.md").read_text()
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", README, flags=re.S)


def block(language: str, marker: str) -> str:
    [code] = [code for lang, code in BLOCKS if lang == language and marker in code]
    return code


def run(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    return out.getvalue()


def test_the_grpc_stub_example_answers(pd_cluster):
    code = block("python", "router_pb2_grpc.RouterStub").replace("127.0.0.1:50051", pd_cluster.router.address)
    assert "Paris" in run(code)


def test_the_grpcurl_body_is_a_generate_request():
    body = re.search(r"-d '(.*?)'", block("bash", "grpcurl"), flags=re.S).group(1)
    req = json_format.Parse(body, router_pb2.GenerateRequest())
    assert req.chat.messages[0].content == "What is the capital of France?" and req.sampling.max_tokens == 32


def test_the_openai_example_answers(pd_cluster):
    code = block("python", "from openai import OpenAI").replace("http://127.0.0.1:8000/v1", pd_cluster.http_url)
    assert "Paris" in run(code)


def test_the_offline_chat_example_answers_as_a_script_and_exits_clean():
    """Run as a user runs it: a script whose `llm` lives until the interpreter ends (whose exit once
    printed a traceback from LLM.__del__)."""
    proc = subprocess.run([sys.executable, "-c", block("python", "llm.chat(")], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0 and "Paris" in proc.stdout and proc.stdout.rstrip().endswith("stop"), proc
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr[-2000:]

