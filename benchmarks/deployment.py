"""Local deployments for B2, one per topology:

XpYd        X prefill workers + Y decode workers, one device each (1p1d, 1p3d, 3p1d, 2p2d, ...)
Ncolocated  N colocated workers behind the same router (1colocated, 2colocated, 4colocated)

Devices come from one pool, handed out in order (prefill workers first, then decode); a pool
shorter than the topology is reused round robin (the CPU: "cpu" for every worker).

Every worker gets a free port and a Prometheus port (the handover histogram is read from
it); each process logs to its own file. CPU workers get an even share of the cores
(OMP_NUM_THREADS), since oversubscribed OpenMP threads stall each other.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from baton.serving.processes import START_TIMEOUT_S, Child, free_port, stop_all, wait_serving, worker_command

TOPOLOGIES = ("1p1d", "2colocated", "1colocated")     # the usual ones; any XpYd / Ncolocated is accepted
_PATTERN = re.compile(r"^(?:(\d+)p(\d+)d|(\d+)colocated)$")


class LaunchError(RuntimeError):
    """A process of the deployment did not come up; the message ends with its log."""


@dataclass
class Deployment:
    topology: str
    router_address: str
    workers: list[dict]                         # role, address, device, metrics_url, log
    children: list[Child] = field(default_factory=list)
    log_dir: Path | None = None
    http_url: str = ""                          # the router's OpenAI API

    @property
    def metrics_urls(self) -> list[str]:
        return [w["metrics_url"] for w in self.workers]

    @property
    def devices(self) -> list[str]:
        return [w["device"] for w in self.workers]

    def describe(self) -> dict:
        return {"topology": self.topology, "router": self.router_address, "http": self.http_url,
                "workers": self.workers,
                "log_dir": str(self.log_dir) if self.log_dir else None}

    def stop(self) -> None:
        stop_all(self.children)


def roles(topology: str) -> list[str]:
    """The workers of a topology, by role: '2p1d' -> prefill, prefill, decode."""
    m = _PATTERN.match(topology.strip())
    if m is None or not any(int(g) for g in m.groups() if g):
        raise ValueError(f"unknown topology {topology!r}: use XpYd (e.g. 1p1d, 1p3d, 3p1d) or Ncolocated "
                         "(e.g. 2colocated), X, Y, N >= 1")
    if m.group(3):
        return ["colocated"] * int(m.group(3))
    prefill, decode = int(m.group(1)), int(m.group(2))
    if not prefill or not decode:
        raise ValueError(f"topology {topology!r} needs at least one prefill and one decode worker")
    return ["prefill"] * prefill + ["decode"] * decode


def plan(topology: str, devices: list[str]) -> list[tuple[str, str]]:
    """(role, device) of every worker of a topology, devices handed out from the pool in order."""
    if not devices:
        raise ValueError("no devices to place the workers on")
    return [(role, devices[i % len(devices)]) for i, role in enumerate(roles(topology))]


def _env(workers: list[tuple[str, str]]) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    on_cpu = sum(device == "cpu" for _, device in workers)
    if on_cpu and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // on_cpu))
    return env


def launch(topology: str, model: str, devices: list[str], worker_args: list[str], log_dir: Path,
           router_args: list[str] = (), host: str = "127.0.0.1") -> Deployment:
    """Start the workers, then the router; return once every process reports SERVING."""
    workers = plan(topology, devices)
    log_dir.mkdir(parents=True, exist_ok=True)
    env = _env(workers)
    dep = Deployment(topology, "", [], log_dir=log_dir)

    def start(name: str, cmd: list[str], address: str) -> Child:
        log = log_dir / f"{name}.log"
        with open(log, "ab") as f:
            proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
        child = Child(name, address, proc)
        dep.children.append(child)
        return child

    try:
        for i, (role, device) in enumerate(workers):
            port, mport = free_port(host), free_port(host)
            module = "baton.prefill_service" if role == "prefill" else "baton.decode_service"
            extra = ["--metrics-port", str(mport), *worker_args, *(["--colocated"] if role == "colocated" else [])]
            name = f"{role}-{i}"
            start(name, worker_command(module, host, port, model, device, extra), f"{host}:{port}")
            dep.workers.append({"role": role, "address": f"{host}:{port}", "device": device,
                                "metrics_url": f"http://{host}:{mport}/metrics", "log": str(log_dir / f"{name}.log")})
        print(f"[bench] {topology}: starting {len(workers)} worker(s) on {model} (logs in {log_dir}) ...",
              file=sys.stderr, flush=True)
        for c in dep.children:
            wait_ready(c, log_dir)
        port = free_port(host)
        flags = []
        for role in ("prefill", "decode", "colocated"):
            addrs = [w["address"] for w in dep.workers if w["role"] == role]
            if addrs:
                flags += [f"--{role}", ",".join(addrs)]
        dep.router_address = f"{host}:{port}"
        http_port = free_port(host)
        dep.http_url = f"http://{host}:{http_port}/v1"          # the OpenAI API, for OpenAI-API load tools
        cmd = [sys.executable, "-m", "baton.router", "--host", host, "--port", str(port), "--model", model,
               "--http-port", str(http_port), *flags, *router_args]
        wait_ready(start("router", cmd, dep.router_address), log_dir)
    except BaseException:
        dep.stop()
        raise
    return dep


def wait_ready(child: Child, log_dir: Path) -> None:
    """Until `child` serves; LaunchError, with the tail of its log, if it exits or times out first."""
    try:
        wait_serving(child.address, child.proc, child.name, START_TIMEOUT_S)
    except (RuntimeError, TimeoutError) as exc:
        log = log_dir / f"{child.name}.log"
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:]) if log.exists() else ""
        raise LaunchError(f"{exc}\n--- {log} ---\n{tail}") from exc
