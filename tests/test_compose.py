"""docker-compose.yml can't drift from reality: every service's command parses with the real
CLI, profiles reserve the right accelerators, and the default stack, started from the file's
own commands as local processes, answers a request."""
from __future__ import annotations

import sys

import pytest
import yaml
from cluster import REPO, Cluster, Proc
from test_services import collect

from baton.serving.processes import free_port
from baton.v1 import router_pb2

COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
MODULES = {"baton.prefill_service": "baton.prefill_service.main", "baton.decode_service": "baton.decode_service.main",
           "baton.router": "baton.router.main"}


def _parser_accepts(command: list[str]) -> None:
    assert command[:2] == ["python", "-m"], command
    module = command[2]
    main = __import__(MODULES[module], fromlist=["main"])
    seen = {}

    class Stop(Exception):
        pass

    def fake_run(coro):        # stop right after argument parsing and config validation
        coro.close()
        raise Stop
    orig = main.asyncio.run
    main.asyncio.run = fake_run
    try:
        main.main(command[3:])
    except Stop:
        seen["ok"] = True
    except SystemExit as exc:  # argparse error
        raise AssertionError(f"{command} rejected by the CLI: exit {exc.code}") from exc
    finally:
        main.asyncio.run = orig
    assert seen.get("ok"), f"{command} did not reach start-up"


@pytest.mark.parametrize("name", [n for n, s in SERVICES.items() if s["command"][0] == "python"])
def test_every_service_command_parses_with_the_real_cli(name):
    _parser_accepts(SERVICES[name]["command"])


def test_profiles_give_each_service_its_own_accelerator():
    gpu = {n: s for n, s in SERVICES.items() if "gpu" in s.get("profiles", [])}
    ids = [s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for s in gpu.values()
           if "deploy" in s]
    assert sorted(map(tuple, ids)) == [("0",), ("1",)]
    npu = {n: s for n, s in SERVICES.items() if "npu" in s.get("profiles", [])}
    davinci = [d for s in npu.values() for d in s.get("devices", []) if d[-1].isdigit()]
    assert sorted(davinci) == ["/dev/davinci0", "/dev/davinci1"]
    assert all("npu:" in " ".join(s["command"]) for s in npu.values() if "router" not in s["command"])


def test_default_services_have_healthchecks_and_the_router_waits_for_them():
    for name in ("prefill", "decode", "router"):
        assert "baton.serving.healthcheck" in SERVICES[name]["healthcheck"]["test"]
    assert set(SERVICES["router"]["depends_on"]) == {"prefill", "decode"}


def _localize(command: list[str], ports: dict[str, int]) -> list[str]:
    """Compose hostnames and ports -> loopback ports of this test."""
    out = []
    for arg in command:
        arg = arg.replace("0.0.0.0", "127.0.0.1")
        for svc, port in ports.items():
            arg = arg.replace(f"{svc}:{_compose_port(svc)}", f"127.0.0.1:{port}")
        out.append(arg)
    i = out.index("--port")
    svc = next(s for s in ports if SERVICES[s]["command"] == command)
    out[i + 1] = str(ports[svc])
    if "--metrics-port" in out:
        j = out.index("--metrics-port")
        out[j + 1] = str(free_port())
    return [sys.executable, *out[1:]]


def _compose_port(svc: str) -> str:
    cmd = SERVICES[svc]["command"]
    return cmd[cmd.index("--port") + 1]


def test_the_compose_stack_answers(tmp_path):
    names = ["prefill", "decode", "router"]          # dependency order, as depends_on says
    ports = {n: free_port() for n in names}
    env = dict(__import__("os").environ, PYTHONUNBUFFERED="1")
    for k, v in SERVICES["prefill"].get("environment", {}).items():
        env[k] = str(v).replace("${BATON_MODEL:-smollm2-135m-instruct}", "smollm2-135m-instruct")
    c = Cluster(tmp_path, env=env)
    try:
        for n in names:
            p = Proc(n, _localize(SERVICES[n]["command"], ports), f"127.0.0.1:{ports[n]}")
            c.procs.append(p)
            p.start(env, tmp_path)
            p.wait_ready()
        c.router = c.procs[-1]
        req = router_pb2.GenerateRequest(sampling=router_pb2.SamplingParams(temperature=0, max_tokens=24))
        req.chat.messages.add(role="user", content="What is the capital of France?")
        _, text, last = collect(c.stub(), req)
        assert "Paris" in text
    finally:
        c.stop()
