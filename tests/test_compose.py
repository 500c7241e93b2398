"""docker-compose.yml can't drift from reality: every service's command parses with the real
CLI, profiles reserve the right accelerators, and the default stack runs as compose runs it,
each service on a host of its own (tests/netns.py), answering requests and scaling."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from cluster import REPO
from netns import Network

COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
# the images' ENTRYPOINT is `baton`: a service's command is a baton subcommand and its flags
COMMANDS = {"prefill": "baton.prefill_service.main", "decode": "baton.decode_service.main",
            "router": "baton.router.main"}


def _parser_accepts(command: list[str]) -> None:
    assert command[0] in COMMANDS, command
    main = __import__(COMMANDS[command[0]], fromlist=["main"])
    seen = {}

    class Stop(Exception):
        pass

    def fake_run(coro, name):  # stop right after argument parsing and config validation
        coro.close()
        raise Stop
    orig = main.run_server
    main.run_server = fake_run
    try:
        main.main(command[1:])
    except Stop:
        seen["ok"] = True
    except SystemExit as exc:  # argparse error
        raise AssertionError(f"{command} rejected by the CLI: exit {exc.code}") from exc
    finally:
        main.run_server = orig
    assert seen.get("ok"), f"{command} did not reach start-up"


@pytest.mark.parametrize("name", [n for n, s in SERVICES.items() if s.get("command", [""])[0] in COMMANDS])
def test_every_service_command_parses_with_the_real_cli(name):
    _parser_accepts(SERVICES[name]["command"])


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.ascend"])
def test_the_images_run_baton_as_an_unprivileged_user_with_a_hub_cache_volume(dockerfile):
    text = (REPO / dockerfile).read_text()
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*?\])$", text, flags=re.M | re.S).group(1).replace("\\\n", ""))
    assert entry == ["baton"] or (entry[:2] == ["/bin/bash", "-c"] and "exec baton \"$@\"" in entry[2])
    assert json.loads(re.search(r"^CMD (\[.*\])$", text, flags=re.M).group(1))[0] == "serve"
    assert re.search(r"^USER baton$", text, flags=re.M) and "useradd --uid 1000" in text
    assert "HF_HOME=/var/cache/huggingface" in text and 'VOLUME ["/var/cache/huggingface"]' in text
    assert "COPY pyproject.toml README.md LICENSE ./" in text          # pip install . needs the license file
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".git", ".venv", "**/__pycache__"} <= set(ignored)


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
    # every profile's services alike, the GPU and NPU routers too (what a dependent service or an orchestrator waits on)
    for name, service in SERVICES.items():
        if service.get("command", [""])[0] in ("prefill", "decode", "router"):
            assert "baton.serving.healthcheck" in service["healthcheck"]["test"], name


def _default_profile_services() -> list[str]:
    """The services `docker compose up` starts (COMPOSE_PROFILES from .env), in dependency order."""
    env = dict(line.split("=", 1) for line in (REPO / ".env").read_text().splitlines()
               if line and not line.startswith("#"))
    profiles = set(env["COMPOSE_PROFILES"].split(","))
    names = [n for n, s in SERVICES.items() if profiles & set(s.get("profiles", []))]
    order: list[str] = []
    while len(order) < len(names):
        ready = [n for n in names if n not in order and set(SERVICES[n].get("depends_on", {})) <= set(order)]
        assert ready, f"depends_on has a cycle among {names}"
        order += ready
    return order


def _interpolate(value: str) -> str:
    """Compose's ${VAR:-default}, with this environment."""
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: os.environ.get(m[1]) or m[2], str(value))


def _as_run_here(argv: list[str]) -> list[str]:
    """The image's `python` is this venv's."""
    return [sys.executable if a == "python" else a for a in argv]


def _entrypoint(command: list[str]) -> list[str]:
    """A service's command as its image runs it: after the ENTRYPOINT, `baton` (this venv's)."""
    return [sys.executable, "-m", "baton", *command]


def _healthy(net: Network, host, name: str, deadline: float) -> None:
    """Wait as `depends_on: condition: service_healthy` waits: the service's own healthcheck
    command, run inside its container, until it passes."""
    test = SERVICES[name]["healthcheck"]["test"]
    assert test[0] == "CMD", test
    while time.monotonic() < deadline:
        assert host.procs[0].poll() is None, f"{name} exited {host.procs[0].returncode}"
        if net.run(host, _as_run_here(test[1:]), timeout=30, capture_output=True).returncode == 0:
            return
        time.sleep(1)
    raise AssertionError(f"{name} never became healthy")


class ComposeStack:
    """The default profile's services, each in a namespace of its own, run exactly as the file
    writes them: command, environment, dependency order, service names that resolve."""

    def __init__(self, net: Network, logs: Path):
        self.net, self.logs, self.hosts = net, logs, {}
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
        self.env["PYTHONUNBUFFERED"] = "1"
        for name in _default_profile_services():
            for dep, cond in SERVICES[name].get("depends_on", {}).items():     # compose waits first
                if cond.get("condition") == "service_healthy":
                    _healthy(net, self.hosts[dep], dep, time.monotonic() + 300)
            self.start(name, name)
        self.client = net.add("client")
        _healthy(net, self.hosts["router"], "router", time.monotonic() + 300)

    def start(self, name: str, service: str):
        """One container of `service` (a second one is what `--scale service=2` adds)."""
        svc = SERVICES[service]
        env = dict(self.env, **{k: _interpolate(v) for k, v in svc.get("environment", {}).items()})
        host = self.net.add(name, service=service)
        log = open(self.logs / f"{name}.log", "wb")
        self.net.popen(host, _entrypoint(svc["command"]), cwd=REPO, env=env, stdout=log,
                       stderr=subprocess.STDOUT)
        self.hosts[name] = host
        return host

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def client_run(self, *args: str, timeout: float = 300) -> dict:
        run = self.net.run(self.client, [sys.executable, str(REPO / "tests" / "compose_client.py"), *args],
                           timeout=timeout, capture_output=True, text=True, cwd=REPO)
        assert run.returncode == 0, run.stderr[-3000:]
        return json.loads(run.stdout.strip().splitlines()[-1])

    def blocks(self, name: str, port: int, role: str) -> tuple[int, int, int]:
        """(KV blocks free, total, sequences running or waiting) of a worker, asked over gRPC
        from inside its own host."""
        stub = f"{role}_pb2_grpc.{role.capitalize()}Stub(grpc.insecure_channel('127.0.0.1:{port}'))"
        code = (f"import grpc; from baton.v1 import worker_pb2, {role}_pb2_grpc; "
                f"s = {stub}.GetStatus(worker_pb2.GetStatusRequest(), timeout=10); "
                "print(s.kv_blocks_free, s.kv_blocks_total, s.running + s.waiting)")
        run = self.net.run(self.hosts[name], [sys.executable, "-c", code], timeout=60, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-2000:]
        free, total, busy = map(int, run.stdout.split())
        return free, total, busy

    def metric(self, name: str, port: int, metric: str) -> float:
        code = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/metrics').read().decode())"
        run = self.net.run(self.hosts[name], [sys.executable, "-c", code], timeout=30, capture_output=True, text=True)
        return sum(float(line.rsplit(" ", 1)[1]) for line in run.stdout.splitlines() if line.startswith(metric))


@pytest.fixture(scope="module")
def compose(tmp_path_factory):
    with Network("bt") as net:
        yield ComposeStack(net, tmp_path_factory.mktemp("compose"))


def test_the_compose_stack_answers_across_hosts(compose):
    """Every container has its own address: a decode worker telling its peers 0.0.0.0 (or
    127.0.0.1) sends the prefill worker to itself, and the request fails."""
    got = compose.client_run("ask", "router")
    assert "Paris" in got["grpc"] and got["grpc_finish"] == "FINISH_REASON_STOP", got
    assert "Paris" in got["openai"] and got["model"] == "smollm2-135m-instruct", got
    decode = compose.hosts["decode"]
    ready = next(line for line in compose.log("decode").splitlines() if "push KV to" in line)
    assert f"push KV to {decode.ip}:50062" in ready, ready          # its engine core's --kv-port
    assert compose.metric("decode", 9061, "baton_kv_transfer_bytes_total") > 0     # KV crossed hosts


def test_decode_scales_from_one_to_two_and_back_under_load(compose, tmp_path):
    """`docker compose up --scale decode=2`, then back to 1, while 4 streams run: the router
    finds the new container through the service name, sends it traffic once healthy, and
    drains the one that leaves (SIGTERM, as `docker stop` sends). No request fails."""
    stop = tmp_path / "stop"
    load = threading.Thread(target=lambda: results.append(compose.client_run("load", "router", "4", str(stop))))
    results: list[dict] = []
    load.start()
    try:
        time.sleep(2)
        second = compose.start("decode-2", "decode")                 # up: the name now has two addresses
        _healthy(compose.net, second, "decode", time.monotonic() + 300)
        deadline = time.monotonic() + 30
        while compose.metric("decode-2", 9061, "baton_kv_transfer_bytes_total") == 0:
            assert time.monotonic() < deadline, "the router never sent the new decode worker a request"
            time.sleep(1)
        first = compose.hosts["decode"]                              # down: the first one leaves
        compose.net.write_hosts({h.ns: {"decode": [second.ip]} for h in compose.net.hosts})
        first.procs[0].send_signal(signal.SIGTERM)
        assert first.procs[0].wait(timeout=60) == 0, compose.log("decode")[-2000:]
        left = time.time()
        finished = Path(f"{stop}.jsonl")                            # traffic on the survivor alone:
        deadline = time.monotonic() + 120                            # requests sent after it left, done
        while sum(json.loads(line)["start"] > left for line in finished.read_text().splitlines()) < 4:
            assert time.monotonic() < deadline, "no request ran after the scale-down"
            time.sleep(1)
    finally:
        stop.touch()
        load.join(timeout=180)
    requests = results[0]["requests"]
    failed = [r for r in requests if not r["ok"]]
    assert not failed, "\n".join(map(json.dumps, failed[:5])) + "\n" + compose.log("router")[-4000:]
    assert sum(r["start"] > left for r in requests) >= 4, "no request ran after the scale-down"
    for name, port, role in (("prefill", 50071, "prefill"), ("decode-2", 50061, "decode")):   # nothing held
        deadline = time.monotonic() + 30
        while (got := compose.blocks(name, port, role))[0] != got[1] or got[2]:
            assert time.monotonic() < deadline, (name, got)
            time.sleep(1)
    router = compose.log("router")
    assert f"worker {second.ip}:50061 found through decode:50061" in router, router[-3000:]
    assert f"worker {first.ip}:50061 left decode:50061" in router, router[-3000:]


def test_a_wildcard_bind_address_is_never_what_peers_are_told():
    from baton.serving.processes import WILDCARD_HOSTS, reachable_host
    for host in WILDCARD_HOSTS:
        assert reachable_host(host) not in WILDCARD_HOSTS
    assert reachable_host("0.0.0.0", "decode-1.decode.default.svc") == "decode-1.decode.default.svc"
    assert reachable_host("10.1.2.3") == "10.1.2.3"
    from baton.serving.worker.worker_config import parse_worker_args
    for flags in (["--advertise-host", "0.0.0.0"], ["--advertise-host", "[::]"], ["--kv-advertise", "0.0.0.0:50061"]):
        with pytest.raises(SystemExit):            # said, not advertised
            parse_worker_args("decode", flags)


def test_each_profile_builds_its_own_image_and_the_cpu_stack_starts_alone():
    images = {}
    for svc in SERVICES.values():
        if "build" not in svc:                    # Prometheus, Grafana: their own images
            continue
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
