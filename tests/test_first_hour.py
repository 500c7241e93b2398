"""What a new user meets in their first hour, on one `baton serve` stack started as they would
(a non-default port, tokens, a router --request-timeout): the printed command works as printed,
the whole health service, clashes refused before anything loads, a clear status for a corrupt
body, usage that tells the truth about the prefix cache, no hidden deadline, CPU memory sized
to the model, and a stack that heals when a worker dies (supervision, issue 19)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from cluster import REPO, children, peak_rss_mib
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.serving.processes import free_port
from baton.supervisor import Process, RestartPolicy, Supervisor
from baton.v1 import router_pb2, router_pb2_grpc

pytestmark = pytest.mark.timeout(600)
BATON = [sys.executable, "-m", "baton"]
TOKEN = "first-hour-token-0123456789"
OTHER = "second-client-token-0123456789"
REQUEST_TIMEOUT_S = 8


class Stack:
    def __init__(self, tmp: Path):
        self.port = free_port()
        self.http_port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.tokens = tmp / "tokens"
        self.tokens.write_text(f"me:{TOKEN}\nthem:{OTHER}\n")
        self.log_path = tmp / "serve.log"
        # the installed `baton` on PATH, as in an activated venv
        self.env = dict(os.environ, PYTHONUNBUFFERED="1",
                        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
        self.popen = subprocess.Popen(
            [*BATON, "serve", "--port", str(self.port), "--auth-token-file", str(self.tokens),
             "--request-timeout", str(REQUEST_TIMEOUT_S), "--http-port", str(self.http_port)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=open(self.log_path, "wb"), env=self.env)
        self.ready_line = self._wait_for_ready()
        self.http_line = self.popen.stdout.readline().decode()

    def _wait_for_ready(self) -> str:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and self.popen.poll() is None:
            line = self.popen.stdout.readline().decode()
            if "serving on" in line:
                return line
        raise AssertionError(f"no ready line; log:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stub(self, ch) -> router_pb2_grpc.RouterStub:
        return router_pb2_grpc.RouterStub(ch)

    def children(self, module: str) -> list[int]:
        """Pids of the launcher's children running `python -m <module>`."""
        pids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                stat = (d / "stat").read_text()
                cmd = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == self.popen.pid and module.encode() in cmd:
                pids.append(int(d.name))
        return pids

    def stop(self) -> int:
        self.popen.send_signal(signal.SIGTERM)
        return self.popen.wait(60)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("first-hour"))
    yield s
    assert s.stop() == 0, s.log()[-3000:]


def auth(token: str = TOKEN):
    return [("authorization", f"Bearer {token}")]


def chat(question: str, max_tokens: int = 32, **fields) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(chat=router_pb2.Chat(messages=[router_pb2.ChatMessage(role="user",
                                                                                            content=question)]),
                                      sampling=router_pb2.SamplingParams(max_tokens=max_tokens, **fields))


def answer(stub, req, timeout: float = 60, token: str = TOKEN) -> tuple[str, router_pb2.Usage]:
    text, usage = "", None
    for r in stub.Generate(req, timeout=timeout, metadata=auth(token)):
        text += r.text
        if r.HasField("usage"):
            usage = r.usage
    return text, usage


def test_the_printed_command_works_as_printed_and_answers_right_every_time(stack):
    """Item 6 (the ready line names --addr and how to pass the token: the token file, never the
    token) and item 9 (the embedded model's generation config makes its defaults greedy: the
    README's question is answered right, twice)."""
    assert f"--addr {stack.address}" in stack.ready_line and f"--auth-token-file {stack.tokens}" in stack.ready_line
    assert TOKEN not in stack.ready_line and stack.ready_line.split("try: ", 1)[1].startswith("baton generate")
    outs = [printed_command_answers(stack.ready_line, stack.env) for _ in range(2)]
    assert "Paris" in outs[0] and outs[0] == outs[1]
    assert "another process is converting" not in stack.log()      # the launcher made the model ready first


def printed_command_answers(line: str, env: dict) -> str:
    command = line.split("try: ", 1)[1].rsplit(")", 1)[0]
    run = subprocess.run(["bash", "-c", command], cwd="/", capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in env.items() if not k.startswith("BATON_")})
    assert run.returncode == 0, (command, run.stderr)
    return run.stdout


def test_without_the_venv_on_path_the_command_is_the_full_path(stack, monkeypatch):
    """`make serve` runs .venv/bin/baton with no venv activated: `baton` is not on PATH, so the
    line names the script itself, and that works from another directory."""
    from baton.launcher import build_parser, ready_lines
    bare = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and Path(d).resolve() != Path(sys.executable).parent.resolve())
    monkeypatch.setenv("PATH", bare)
    args = build_parser().parse_args(["--port", str(stack.port), "--auth-token-file", str(stack.tokens),
                                      "--http-port", str(stack.http_port)])
    grpc_line, http_line = ready_lines(args)
    assert f"try: {Path(sys.executable).parent.absolute() / 'baton'} generate" in grpc_line, grpc_line
    assert "Paris" in printed_command_answers(grpc_line, dict(os.environ, PATH=bare))
    assert http_line == stack.http_line.strip()


def test_the_openai_api_is_announced_and_wants_the_same_token(stack):
    import openai
    url = f"http://127.0.0.1:{stack.http_port}/v1"
    assert url in stack.http_line, stack.http_line
    # the curl it suggests sends the header the API wants (naming the token file, not a token)
    curl = stack.http_line.split("try: ", 1)[1].rsplit(")", 1)[0]
    assert curl == f'curl -H "Authorization: Bearer <a token in {stack.tokens}>" {url}/models', curl
    with urllib.request.urlopen(urllib.request.Request(f"{url}/models", headers={
            "Authorization": f"Bearer {TOKEN}"}), timeout=10) as r:
        assert r.status == 200
    for key in ("", "not-a-token"):
        with pytest.raises(openai.AuthenticationError) as err:
            openai.OpenAI(base_url=url, api_key=key or "x", max_retries=0,
                          default_headers={} if key else {"Authorization": ""}).models.list()
        assert err.value.status_code == 401
    client = openai.OpenAI(base_url=url, api_key=TOKEN, max_retries=0)
    r = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=24,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content


def test_the_whole_health_service(stack):
    """Item 1: Check, Watch (streams, starting with the current status) and List, with the
    grpcio-health-checking client, open without a token."""
    with grpc.insecure_channel(stack.address) as ch:
        h = health_pb2_grpc.HealthStub(ch)
        serving = health_pb2.HealthCheckResponse.SERVING
        assert h.Check(health_pb2.HealthCheckRequest(service="baton.v1.Router"), timeout=10).status == serving
        watch = h.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert next(watch).status == serving
        watch.cancel()
        listed = h.List(health_pb2.HealthListRequest(), timeout=10).statuses
        assert {"", "baton.v1.Router"} <= set(listed) and all(s.status == serving for s in listed.values())


def test_a_corrupt_body_is_invalid_argument_without_a_traceback(stack):
    """Item 5: bytes that are not a GenerateRequest."""
    with grpc.insecure_channel(stack.address) as ch:
        call = ch.unary_stream("/baton.v1.Router/Generate", request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)
        for body in (b"\xff\xff\xff\xff", b"\x12\x05ab"):      # a bad tag; a string cut short
            with pytest.raises(grpc.RpcError) as err:
                list(call(body, timeout=10, metadata=auth()))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
            assert "not a valid message" in err.value.details()
    time.sleep(0.5)
    assert "Traceback" not in stack.log()


def test_repeated_prompt_reports_its_cached_tokens(stack):
    """Item 4: usage.cached_prompt_tokens through the router, from the decode worker's prefix cache
    hit on the prefill side."""
    long = "Here is a list of fruits: " + ", ".join(f"fruit number {i}" for i in range(60)) + ". Which is first?"
    with grpc.insecure_channel(stack.address) as ch:
        stub = stack.stub(ch)
        _, first = answer(stub, chat(long, 4))
        _, again = answer(stub, chat(long, 4))
    assert first.cached_prompt_tokens <= 32          # at most the chat template's system prefix, seen before
    assert again.cached_prompt_tokens >= first.prompt_tokens - 16, (first, again)   # all but the last block


def test_the_router_deadline_is_configured_and_says_so(stack):
    """Item 3: no deadline nobody asked for; the one configured (--request-timeout) is reported
    as the router's, not blamed on a worker. A client deadline of its own is the client's."""
    with grpc.insecure_channel(stack.address) as ch:
        stub = stack.stub(ch)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            for _ in stub.Generate(chat("Count to a million.", 100000, ignore_eos=True, temperature=0),
                                   metadata=auth()):      # no client deadline
                pass
        took = time.monotonic() - t0
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value
        assert "--request-timeout of 8s" in err.value.details() and "worker" not in err.value.details()
        assert REQUEST_TIMEOUT_S - 1 < took < REQUEST_TIMEOUT_S + 10


def test_clashes_are_refused_before_anything_loads(stack, tmp_path):
    """Item 2: a second `baton serve`, a router, a decode worker, a metrics port: each taken port
    ends the process within seconds, non-zero, with one line that says what to do."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    taken = busy.getsockname()[1]
    cases = {
        "second serve": [*BATON, "serve", "--port", str(stack.port)],
        "router": [*BATON, "router", "--port", str(taken), "--decode", "127.0.0.1:1", "--prefill", "127.0.0.1:2"],
        "decode": [*BATON, "decode", "--port", str(taken)],
        "metrics": [*BATON, "decode", "--port", str(free_port()), "--metrics-port", str(taken)],
    }
    try:
        for name, cmd in cases.items():
            t0 = time.monotonic()
            run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
            lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
            assert run.returncode == 1, (name, run.stderr)
            assert time.monotonic() - t0 < 15, name            # before any model is loaded
            assert "Traceback" not in run.stderr and "in use" in lines[-1], (name, run.stderr)
            assert not any("serving on" in x for x in run.stdout.splitlines()), name
    finally:
        busy.close()


def test_an_empty_prompt_is_refused_by_the_cli_as_by_the_api(stack):
    """Item 8."""
    run = subprocess.run([*BATON, "generate", "", "--addr", stack.address], cwd=REPO, capture_output=True,
                         text=True, timeout=60, env=dict(stack.env, BATON_AUTH_TOKEN=TOKEN))
    assert run.returncode == 2 and "empty" in run.stderr


def test_cpu_workers_are_sized_to_the_model(stack):
    """Item 12: the 135M model's worker (its front and its engine core together) stays well under
    the 2.1 GiB it took with a fixed 1 GiB KV; the front, which never loads torch, is small."""
    peaks = {}
    for module in ("baton.prefill_service", "baton.decode_service"):
        for pid in stack.children(module):
            core, = children(pid)
            peaks[module] = (peak_rss_mib(pid), peak_rss_mib(core))
    # (1,701 MiB measured for the decode worker on 2026-11-28, once its core also sends KV and checks it
    # and the engine carries INT4 and the host tier: the bound moved from 1,700 with it)
    assert len(peaks) == 2 and max(front + core for front, core in peaks.values()) < 1800, peaks
    assert max(front for front, _ in peaks.values()) < 250, peaks


def test_a_killed_worker_is_restarted_and_rejoins(stack):
    """Issue 19: the launcher supervises; a SIGKILLed decode worker comes back on its port, the
    router finds it healthy again, and requests are answered. The stack never stopped."""
    [pid] = stack.children("baton.decode_service")
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and "decode-0 is back" not in stack.log():
        assert stack.popen.poll() is None, stack.log()[-3000:]
        time.sleep(0.5)
    log = stack.log()
    assert "decode-0 exited with code -9; restarting it" in log and "decode-0 is back" in log, log[-3000:]
    # one text format in the one terminal: the router's log records read as the progress lines
    assert "[baton] router: warning: worker" in log and " WARNING baton.router:" not in log, log[-3000:]
    with grpc.insecure_channel(stack.address) as ch:
        stub = stack.stub(ch)
        deadline = time.monotonic() + 30
        while not all(w.healthy for w in stub.GetServerInfo(router_pb2.GetServerInfoRequest(), timeout=5,
                                                             metadata=auth()).workers):
            assert time.monotonic() < deadline
            time.sleep(0.3)
        text, _ = answer(stub, chat("What is the capital of France?", 16))
    assert "Paris" in text


def test_a_crash_loop_is_given_up_with_a_message():
    """Issue 19: a worker that keeps dying is restarted with growing backoff, then given up on;
    giving up on the router (critical) ends the stack."""
    import io
    out = io.StringIO()
    sup = Supervisor(dict(os.environ), RestartPolicy(backoff_s=0.05, max_backoff_s=0.2, max_restarts=2,
                                                     window_s=60), out=out)
    dying = Process("decode-7", [sys.executable, "-c", "import sys; sys.exit(3)"], "127.0.0.1:1")
    router = Process("router", [sys.executable, "-c", "import sys; sys.exit(4)"], "127.0.0.1:2", critical=True)
    sup.start(dying)
    deadline = time.monotonic() + 30
    while not dying.gave_up and time.monotonic() < deadline:
        assert sup.tick()                      # a worker given up on does not stop the stack
        time.sleep(0.02)
    said = out.getvalue()
    assert dying.gave_up and said.count("restarting decode-7 (restart") == 2, said
    assert "decode-7 exited with code 3 and has crashed 3 times" in said and "the rest keeps serving" in said
    sup.start(router)
    stopped = threading.Event()
    while time.monotonic() < deadline and not stopped.is_set():
        if not sup.tick():
            stopped.set()
        time.sleep(0.02)
    assert stopped.is_set() and "stopping the stack" in out.getvalue()
    sup.stop_all()


def test_the_servers_end_with_a_supervisor_killed_outright(tmp_path):
    """`baton serve` killed by SIGKILL (no chance to stop its children): each server it started gets SIGTERM from
    the kernel (serving/grpc_server.py: end_with_supervisor, which run_server calls first) and ends, instead of
    living on as an orphan that holds its port."""
    pid_file = tmp_path / "server.pid"
    server = ("import os, pathlib, time\n"
              "from baton.serving.grpc_server import end_with_supervisor\n"
              "end_with_supervisor()\n"
              f"pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid()))\n"
              "time.sleep(120)\n")
    supervisor = ("import os, sys, time\n"
                  "from baton.supervisor import Process, Supervisor\n"
                  "sup = Supervisor(dict(os.environ))\n"
                  f"sup.start(Process('decode-0', [sys.executable, '-c', {server!r}], '127.0.0.1:1'))\n"
                  "time.sleep(120)\n")
    sup = subprocess.Popen([sys.executable, "-c", supervisor])
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        child = int(pid_file.read_text())
        sup.kill()
        sup.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            _reap(child)
            time.sleep(0.1)
        else:
            os.kill(child, signal.SIGKILL)
            pytest.fail("the server outlived its supervisor")
    finally:
        sup.kill()


def _reap(pid: int) -> None:
    """(The orphan is re-parented to init, or to this process where it is the subreaper: reap it if ours.)"""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
