"""A user's mistake on the public interfaces, met as a new user meets it: `baton generate`, `baton
role`, `baton elastic`, `baton serve` and the servers' --host, the offline `LLM`. Each is one line
naming the flag (or the argument) at fault, exit 2, no traceback; nothing is sent or started."""
from __future__ import annotations

import asyncio
import json

import pytest
from test_elastic import PLAN
from test_startup_errors import serve_refuses

from baton.serving.grpc_server import PortInUse, Server
from baton.serving.processes import free_port

NOWHERE = "127.0.0.1:1"         # nothing listens there: a check that let a request through would fail to connect


def refused(main, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("flags, says", [
    (["--seed", "-1"], "--seed -1: must be in [0, 18446744073709551615]"),
    (["--max-tokens", "-3"], "--max-tokens -3: must be in [1, 4294967295]"),
    (["--top-k", "99999999999"], "--top-k 99999999999: must be in"),
    (["--timeout", "0"], "--timeout must be > 0"),
    (["--timeout", "-1"], "--timeout must be > 0"),
    (["--chat", "--raw"], "--raw: not allowed with argument --chat"),
    (["--addr", "127.0.0.1:99999"], "--addr 127.0.0.1:99999: the port must be in [1, 65535]"),
])
def test_generate_refuses_a_bad_flag_value_naming_the_flag(flags, says, capsys):
    from baton.client import main
    argv = ["hi", *flags] if "--addr" in flags else ["hi", "--addr", NOWHERE, *flags]
    assert says in refused(main, argv, capsys)


@pytest.mark.parametrize("timeout", ["-5", "0", "1e7"])
def test_role_refuses_a_timeout_it_cannot_send(timeout, capsys):
    from baton.client import role_main
    err = refused(role_main, ["127.0.0.1:2", "decode", "--addr", NOWHERE, "--timeout", timeout], capsys)
    assert "--timeout must be in (0, 4294967] seconds" in err


@pytest.mark.parametrize("text, says", [
    ("{}", "not a plan written by `baton plan --output` (it has no 'workloads')"),
    ("garbage", "not a plan written by `baton plan --output` (not JSON:"),
    (None, "No such file or directory"),
])
def test_elastic_says_what_is_wrong_with_the_plan_file(text, says, tmp_path, capsys):
    from baton.elastic import main
    path = tmp_path / "plan.json"
    if text is not None:
        path.write_text(text)
    err = refused(main, ["--plan", str(path), "--addr", NOWHERE, "--once"], capsys)
    assert f"--plan {path}: {says}" in err


@pytest.mark.parametrize("flags, says", [
    (["--host", "no-such-host.invalid"], "--host no-such-host.invalid: not an address of this machine"),
    (["--prefill-instances", "0"], "--prefill-instances must be >= 1, got 0"),
    (["--decode-instances", "-1"], "--decode-instances must be >= 1, got -1"),
    (["--colocated", "--instances", "0"], "--instances must be >= 1, got 0"),
    (["--colocated", "--prefill-instances", "2"], "--prefill-instances 2 counts prefill workers, which --colocated has none"),
    (["--instances", "2"], "--instances 2 counts colocated workers: add --colocated"),
])
def test_serve_refuses_what_it_cannot_start_in_one_line(flags, says):
    assert says in serve_refuses(*flags)


@pytest.mark.parametrize("host", ["no-such-host.invalid", "999.1.1.1"])
def test_a_server_on_a_host_it_cannot_have_says_so_not_that_the_port_is_taken(host):
    async def start() -> str:
        with pytest.raises(PortInUse) as exc:
            Server(host, free_port(), [])
        return str(exc.value)
    said = asyncio.run(start())
    assert f"--host {host}: not an address of this machine" in said and "in use" not in said


def test_the_offline_api_refuses_an_empty_chat_list_and_params_of_the_wrong_type(embedded_llm):
    from baton import SamplingParams
    with pytest.raises(ValueError, match="no conversations given"):
        embedded_llm.chat([], SamplingParams(max_tokens=2))
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams or a list of them, got dict"):
        embedded_llm.generate(["hi"], {"max_tokens": 2})
    with pytest.raises(TypeError, match="got str"):
        embedded_llm.generate(["hi", "ho"], ["max_tokens", "2"])
    assert embedded_llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=2))[0].token_ids   # it still serves


def test_a_request_a_worker_refuses_as_invalid_gets_the_workers_reason_alone():
    """A setting only the worker can judge (priority on an fcfs deployment): the client reads the
    worker's reason as it gave it, not wrapped in a retry report ("failed on every worker tried")."""
    import grpc
    from test_failover import FakeWorker, collect, request, service, worker

    from baton.serving.grpc_server import ServiceError
    reason = "priority 1 needs a deployment started with --scheduling-policy priority"

    class Refuses(FakeWorker):
        async def Admit(self, req, timeout=None):
            raise grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       reason)

    svc = service([worker("p:1", "prefill", FakeWorker()), worker("d:1", "decode", Refuses())])
    with pytest.raises(ServiceError) as exc:
        asyncio.run(asyncio.wait_for(collect(svc, request(3)), 10))
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT and str(exc.value) == reason


def _router_pages(*finished: int) -> list[str]:
    """A router's /metrics at successive scrapes, `finished` requests done by each."""
    from prometheus_client import generate_latest

    from baton.serving.metrics import Metrics
    m, pages = Metrics("router"), []
    m.serving_model("smol")
    for n in finished:
        while m.requests.labels("smol", "stop")._value.get() < n:
            m.finished(100, 10, 0)
            m.requests.labels("smol", "stop").inc()
        pages.append(generate_latest(m.registry).decode())
    return pages


def test_elastic_with_its_router_unreachable_holds_in_one_line(canned_routers, tmp_path, capsys):
    """Its metrics answer, its gRPC address does not (a wrong --addr, a router restarting)."""
    from baton.elastic import main
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    url = canned_routers(_router_pages(0, 1))
    with pytest.raises(SystemExit) as exit_:
        main(["--plan", str(tmp_path / "plan.json"), "--addr", NOWHERE, "--window", "0.05", "--once",
              "--metrics-url", url])
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and "Traceback" not in err, err
    assert f"[elastic] holding this window: the router at {NOWHERE} did not answer (UNAVAILABLE" in err


def test_elastic_once_prints_its_decision_even_when_it_is_none(canned_routers, tmp_path, capsys):
    from baton.elastic import main
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    main(["--plan", str(tmp_path / "plan.json"), "--addr", NOWHERE, "--window", "0.05", "--once",
          "--metrics-url", canned_routers(_router_pages(3))])
    assert "[elastic] no decision: no request finished in this window" in capsys.readouterr().err


def test_tls_files_that_hold_no_pem_are_named_not_taken_for_a_busy_port(tmp_path, capsys):
    from baton.client import main
    from baton.serving.security import TLSConfig
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")

    async def start() -> str:
        with pytest.raises(ValueError) as exc:
            Server("127.0.0.1", free_port(), [], tls=TLSConfig(cert=str(junk), key=str(junk)))
        return str(exc.value)
    said = asyncio.run(start())
    assert f"--tls-cert {junk}: no PEM certificate in it" in said and "in use" not in said
    err = refused(main, ["hi", "--addr", NOWHERE, "--tls-ca", str(junk)], capsys)
    assert f"--tls-ca {junk}: no PEM certificate in it" in err


@pytest.mark.parametrize("prompts, says", [
    ([{"role": "user", "content": "hi"}], "prompt 0 is a dict: chat messages go to llm.chat"),
    (None, "prompts must be a string, a list of strings or a list of token-id lists, got NoneType"),
    ([1.5, 2.0], "prompt 0 is a float"),
    ([b"hi"], "prompt 0 is a bytes"),
    ([["a", "b"]], "prompt 0 holds a str: a token-id list holds ints"),
])
def test_the_offline_api_names_a_prompt_of_the_wrong_type(prompts, says, embedded_llm):
    from baton import SamplingParams
    with pytest.raises(TypeError) as exc:
        embedded_llm.generate(prompts, SamplingParams(max_tokens=2))
    assert says in str(exc.value)


def test_ctrl_c_during_generate_cancels_the_stream_and_exits_130_quietly(monkeypatch, capsys):
    from baton import client
    from baton.v1 import router_pb2
    cancelled = []

    class Call:                     # a streaming call that the user interrupts after its first chunk
        def __init__(self):
            self.chunks = iter([router_pb2.GenerateResponse(text="Once")])

        def __iter__(self):
            return self

        def __next__(self):
            for chunk in self.chunks:
                return chunk
            raise KeyboardInterrupt

        def cancel(self):
            cancelled.append(True)

    class Stub:
        def __init__(self, channel):
            pass

        def Generate(self, req, timeout=None, metadata=None):
            return Call()

    monkeypatch.setattr(client.router_pb2_grpc, "RouterStub", Stub)
    with pytest.raises(SystemExit) as exit_:
        client.main(["hi", "--addr", NOWHERE])
    out, err = capsys.readouterr()
    assert exit_.value.code == 130 and cancelled == [True]
    assert out == "Once" and "Traceback" not in err and "interrupted" in err


def test_ctrl_c_ends_any_command_with_130_and_no_traceback(monkeypatch, tmp_path, capsys):
    """baton elastic (a loop a user stops with Ctrl-C), role, plan, bench: no KeyboardInterrupt traceback."""
    from baton import cli, elastic
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(PLAN))

    def interrupted(seconds):
        raise KeyboardInterrupt
    monkeypatch.setattr(elastic.time, "sleep", interrupted)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["elastic", "--plan", str(plan), "--addr", NOWHERE])
    assert exit_.value.code == 130 and "Traceback" not in capsys.readouterr().err


def test_a_negative_grace_is_refused_naming_the_flag():
    assert "--grace -1: must be a number of seconds >= 0" in serve_refuses("--grace", "-1")


@pytest.mark.parametrize("value", [2.5, True, "3"])
def test_max_tokens_must_be_a_whole_number(value):
    from baton import SamplingParams
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        SamplingParams(max_tokens=value).validate()
