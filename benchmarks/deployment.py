"""Local deployments for B2, one per topology:

XpYd[-ptpK][-dtpK]   X prefill + Y decode workers (1p1d, 1p3d, 3p1d, 2p2d, ...); -ptpK / -dtpK:
                     each prefill / decode worker tensor-parallel over K devices (1p2d-ptp2)
Ncolocated[-tpK]     N colocated workers behind the same router (4colocated, 2colocated-tp2)

Devices come from one pool, handed out in order (prefill workers first, then decode; a TP worker
takes K in a row); a pool shorter than the topology is reused round robin (the CPU: "cpu" for
every worker).

Every worker gets a free port and a Prometheus port (the handover histogram is read from
it); each process logs to its own file. CPU workers get an even share of the cores
(OMP_NUM_THREADS), since oversubscribed OpenMP threads stall each other.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from baton import environment
from baton.serving.processes import START_TIMEOUT_S, Child, free_port, stop_all, wait_serving, worker_command
from baton.v1 import admin_pb2

TOPOLOGIES = ("1p1d", "2colocated", "1colocated")     # the usual ones; any XpYd / Ncolocated is accepted
# issue 49's comparison at four devices: colocated replicas against every split of them
FOUR_DEVICES = ("4colocated", "2colocated-tp2", "1p3d", "2p2d", "3p1d", "1p2d-ptp2")
_PATTERN = re.compile(r"^(?:(\d+)p(\d+)d(?:-ptp(\d+))?(?:-dtp(\d+))?|(\d+)colocated(?:-tp(\d+))?)$")
GRAMMAR = "XpYd[-ptpK][-dtpK] (e.g. 1p1d, 3p1d, 1p2d-ptp2) or Ncolocated[-tpK] (e.g. 4colocated, 2colocated-tp2)"


ROLES = ("prefill", "decode", "colocated")
# decode <-> colocated keeps a worker's streams; anything to or from prefill moves them (or waits for prompts)
CHEAP = {("decode", "colocated"), ("colocated", "decode")}


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
    router_metrics: list[str] = field(default_factory=list)    # each router process's /metrics

    @property
    def metrics_urls(self) -> list[str]:
        return [w["metrics_url"] for w in self.workers]

    @property
    def devices(self) -> list[str]:
        return [d for w in self.workers for d in w["devices"]]

    def describe(self) -> dict:
        return {"topology": self.topology, "router": self.router_address, "http": self.http_url,
                "routers": max(1, len(self.router_metrics)), "workers": self.workers,
                "log_dir": str(self.log_dir) if self.log_dir else None}

    def stop(self) -> None:
        stop_all(self.children)


@dataclass(frozen=True, slots=True)
class Topology:
    """A parsed topology name: its workers' roles and tensor-parallel sizes, in launch order."""
    name: str
    workers: tuple[tuple[str, int], ...]          # (role, tp) per worker

    @property
    def num_devices(self) -> int:
        return sum(tp for _, tp in self.workers)

    @property
    def colocated(self) -> bool:
        return all(role == "colocated" for role, _ in self.workers)

    def count(self, role: str) -> int:
        return sum(r == role for r, _ in self.workers)

    def tp(self, role: str) -> int:
        return next((tp for r, tp in self.workers if r == role), 1)


def parse(topology: str) -> Topology:
    """'1p2d-ptp2' -> one TP2 prefill worker and two decode workers."""
    name = topology.strip()
    m = _PATTERN.match(name)
    if m is None or not any(int(g) for g in m.groups() if g):
        raise ValueError(f"unknown topology {topology!r}: use {GRAMMAR}; X, Y, N, K >= 1")
    prefill, decode, ptp, dtp, colocated, tp = (int(g) if g else None for g in m.groups())
    if any(k == 0 for k in (ptp, dtp, tp)):
        raise ValueError(f"topology {topology!r}: a tensor-parallel size must be >= 1")
    if colocated is not None:
        return Topology(name, (("colocated", tp or 1),) * colocated)
    if not prefill or not decode:
        raise ValueError(f"topology {topology!r} needs at least one prefill and one decode worker")
    return Topology(name, (("prefill", ptp or 1),) * prefill + (("decode", dtp or 1),) * decode)


def roles(topology: str) -> list[str]:
    """The workers of a topology, by role: '2p1d' -> prefill, prefill, decode."""
    return [role for role, _ in parse(topology).workers]


def candidates(num_devices: int, tp_sizes: tuple[int, ...] = (1, 2)) -> list[str]:
    """Every topology that uses exactly `num_devices` devices with workers of the given TP sizes
    (one size per role): colocated replicas first, then the splits by prefill share."""
    if num_devices < 1:
        raise ValueError(f"need at least one device, got {num_devices}")
    names = [f"{num_devices // tp}colocated{_tp('', tp)}" for tp in tp_sizes if num_devices % tp == 0]
    for ptp in tp_sizes:
        for dtp in tp_sizes:
            for x in range(1, num_devices):
                rest = num_devices - x * ptp
                if rest >= dtp and rest % dtp == 0:
                    names.append(f"{x}p{rest // dtp}d{_tp('p', ptp)}{_tp('d', dtp)}")
    def order(name: str) -> tuple:
        t = parse(name)
        return not t.colocated, t.count("prefill") * t.tp("prefill"), name
    return sorted(dict.fromkeys(names), key=order)


def _tp(role: str, tp: int) -> str:
    return f"-{role}tp{tp}" if tp > 1 else ""


def plan(topology: str, devices: list[str]) -> list[tuple[str, list[str]]]:
    """(role, devices) of every worker of a topology, one device per TP rank, handed out from
    the pool in order."""
    if not devices:
        raise ValueError("no devices to place the workers on")
    out, i = [], 0
    for role, tp in parse(topology).workers:
        out.append((role, [devices[(i + k) % len(devices)] for k in range(tp)]))
        i += tp
    return out


def tp_flags(ranks: list[str]) -> list[str]:
    """A worker's tensor-parallel flags: none for one device."""
    return [] if len(ranks) == 1 else ["--tp-size", str(len(ranks)), "--tp-devices", ",".join(ranks)]


def _env(workers: list[tuple[str, list[str]]]) -> dict:
    env = environment.for_children(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    on_cpu = sum(device == "cpu" for _, ranks in workers for device in ranks)
    if on_cpu and environment.get("OMP_NUM_THREADS") is None:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // on_cpu))
    return env


def launch(topology: str, model: str, devices: list[str], worker_args: list[str], log_dir: Path,
           router_args: list[str] = (), host: str = "127.0.0.1", switchable: bool = False,
           routers: int = 1) -> Deployment:
    """Start the workers, then the router; return once every process reports SERVING. `switchable`:
    every worker is a `baton decode --role ROLE` one, whose role can change in place (a `baton
    prefill` worker's cannot). `routers` > 1: that many router processes share the router's ports
    (--reuse-port), each with a metrics port of its own, as replicas behind one Service would."""
    if routers < 1:
        raise ValueError(f"routers must be >= 1, got {routers}")
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
        for i, (role, ranks) in enumerate(workers):
            port, mport = free_port(host), free_port(host)
            module = "baton.prefill_service" if role == "prefill" and not switchable else "baton.decode_service"
            as_role = ["--role", role] if switchable else ["--colocated"] if role == "colocated" else []
            extra = ["--metrics-port", str(mport), *worker_args, *tp_flags(ranks), *as_role]
            name = f"{role}-{i}"
            start(name, worker_command(module, host, port, model, ranks[0], extra), f"{host}:{port}")
            dep.workers.append({"role": role, "address": f"{host}:{port}", "device": ranks[0], "devices": ranks,
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
        if routers == 1:
            dep.router_metrics = [f"http://{host}:{http_port}/metrics"]
            wait_ready(start("router", cmd, dep.router_address), log_dir)
        for i in range(routers if routers > 1 else 0):   # one after another: each is ready once its log says so
            mport = free_port(host)
            dep.router_metrics.append(f"http://{host}:{mport}/metrics")
            wait_logged(start(f"router-{i}", [*cmd, "--reuse-port", "--metrics-port", str(mport)], dep.router_address),
                        log_dir, "router ready on")
    except BaseException:
        dep.stop()
        raise
    return dep


def wait_logged(child: Child, log_dir: Path, line: str) -> None:
    """Until `child`'s log holds `line` (a process sharing its port with others, whose health check
    any of them may answer); LaunchError, with the log's tail, if it exits or times out first."""
    log = log_dir / f"{child.name}.log"
    deadline = time.monotonic() + START_TIMEOUT_S
    while line not in log.read_text(errors="replace"):
        if child.proc.poll() is not None or time.monotonic() > deadline:
            why = "exited" if child.proc.poll() is not None else f"not ready after {START_TIMEOUT_S:.0f}s"
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
            raise LaunchError(f"{child.name} {why}\n--- {log} ---\n{tail}")
        time.sleep(0.2)


def wait_ready(child: Child, log_dir: Path) -> None:
    """Until `child` serves; LaunchError, with the tail of its log, if it exits or times out first."""
    try:
        wait_serving(child.address, child.proc, child.name, START_TIMEOUT_S)
    except (RuntimeError, TimeoutError) as exc:
        log = log_dir / f"{child.name}.log"
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:]) if log.exists() else ""
        raise LaunchError(f"{exc}\n--- {log} ---\n{tail}") from exc


# -- a topology reached by role switches (baton elastic, bench flip) ---------------------------------

def split_counts(topology: str) -> dict[str, int] | None:
    """Workers per role of a topology; None for a tensor-parallel one (not reachable by role switches)."""
    topo = parse(topology)
    if any(tp != 1 for _, tp in topo.workers):
        return None
    return {role: sum(r == role for r, _ in topo.workers) for role in ROLES}


def next_move(current: dict[str, int], want: dict[str, int]) -> tuple[str, str] | None:
    """One worker's (from role, to role) that brings `current` closer to `want`; the cheap moves first."""
    surplus = [r for r in ROLES if current.get(r, 0) > want.get(r, 0)]
    deficit = [r for r in ROLES if current.get(r, 0) < want.get(r, 0)]
    moves = [(a, b) for a in surplus for b in deficit]
    if not moves:
        return None
    return min(moves, key=lambda m: (m not in CHEAP, ROLES.index(m[0]), ROLES.index(m[1])))


def switch_one(admin, workers, move: tuple[str, str], timeout_s: float, metadata=()):
    """Switch the least-loaded worker of role move[0] to move[1] (Admin.SwitchRole, authenticated by
    `metadata`); `workers`: the router's ServerInfo workers. Its answer; grpc.RpcError if refused."""
    src, dst = move
    w = min((w for w in workers if w.role == src), key=lambda w: w.running + w.waiting)
    return admin.SwitchRole(admin_pb2.AdminSwitchRoleRequest(worker=w.address, role=dst, timeout_ms=int(timeout_s * 1000)),
                            timeout=timeout_s + 15, metadata=metadata)
