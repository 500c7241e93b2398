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

    def fake_run(coro, name):  # stop right after argument parsing and config validation
        coro.close()
        raise Stop
    orig = main.run_server
    main.run_server = fake_run
    try:
        main.main(command[3:])
    except Stop:
        seen["ok"] = True
    except SystemExit as exc:  # argparse error
        raise AssertionError(f"{command} rejected by the CLI: exit {exc.code}") from exc
    finally:
        main.run_server = orig
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
    for arg in command:                  # --host 0.0.0.0 stays, as in the containers
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
        # bound to 0.0.0.0, the decode worker must still tell its peers an address they can dial
        ready = next(line for line in (tmp_path / "decode.log").read_text().splitlines() if "push KV to" in line)
        pushed_to = ready.split("push KV to ")[1].split()[0]
        assert pushed_to.rsplit(":", 1)[0] not in ("0.0.0.0", "", "::", "[::]"), ready
    finally:
        c.stop()


def test_a_wildcard_bind_address_is_never_what_peers_are_told():
    from baton.serving.processes import WILDCARD_HOSTS, reachable_host
    for host in WILDCARD_HOSTS:
        assert reachable_host(host) not in WILDCARD_HOSTS
    assert reachable_host("0.0.0.0", "decode-1.decode.default.svc") == "decode-1.decode.default.svc"
    assert reachable_host("10.1.2.3") == "10.1.2.3"


def test_each_profile_builds_its_own_image_and_the_cpu_stack_starts_alone():
    images = {}
    for svc in SERVICES.values():
        (profile,) = svc["profiles"]              # every service is in exactly one profile
        images.setdefault(svc["image"], set()).add((profile, repr(svc["build"])))
    assert all(len(builds) == 1 for builds in images.values()), images   # one build per image tag
    env = dict(line.split("=", 1) for line in (REPO / ".env").read_text().splitlines()
               if line and not line.startswith("#"))
    assert env["COMPOSE_PROFILES"] == "cpu"
    cuda = SERVICES["prefill-gpu"]["build"]["args"]
    assert "cu1" in cuda["TORCH_INDEX"] and cuda["WITH_COMPILER"] == "1"
    assert SERVICES["prefill-npu"]["build"]["dockerfile"] == "Dockerfile.ascend"
    for dockerfile in ("Dockerfile", "Dockerfile.ascend"):      # every package folder goes in the image
        text = (REPO / dockerfile).read_text()
        for folder in ("baton", "serving", "router", "prefill_service", "decode_service", "kvtransfer", "engine",
                       "models", "protos", "benchmarks"):
            assert f"COPY {folder} {folder}" in text, (dockerfile, folder)
