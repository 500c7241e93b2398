"""Starting Baton processes and waiting for them: what the launcher (`baton serve`), the
benchmark harness and the tests share. Torch-free.
"""
from __future__ import annotations

import collections
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.serving.grpc_server import open_sync_channel
from baton.serving.security import tls_from_env

START_TIMEOUT_S = 600.0
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


def reachable_host(bind_host: str, advertise: str | None = None) -> str:
    """The host peers should dial to reach a server bound to `bind_host`: `advertise` when
    given; the bind host unless it is a wildcard (0.0.0.0 means nothing to another machine or
    container); else this machine's own address: what its host name resolves to (a
    container's or pod's IP: Docker and Kubernetes map the host name to it), or the address of
    the interface that routes outwards."""
    if advertise:
        return advertise
    if bind_host not in WILDCARD_HOSTS:
        return bind_host
    try:
        ip = socket.gethostbyname(socket.gethostname())
        if not ip.startswith("127."):
            return ip
    except OSError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.254.254.254", 9))        # UDP: picks a route, sends nothing
            ip = s.getsockname()[0]
            if not ip.startswith(("0.", "127.")):
                return ip
    except OSError:
        pass
    return socket.gethostname()


@dataclass
class Child:
    name: str
    address: str
    proc: subprocess.Popen


_GIVEN: collections.deque[int] = collections.deque(maxlen=1024)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, and not one this process was given lately: a caller that picks two ports before
    binding either (a worker's gRPC and KV ports) must not get the same one twice."""
    for _ in range(64):
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            break
    _GIVEN.append(port)
    return port


def devices_for(spec: str | None, default: str, n: int) -> list[str]:
    items = [d.strip() for d in (spec or "").split(",") if d.strip()] or [default]
    return [items[i % len(items)] for i in range(n)]


def worker_command(module: str, host: str, port: int, model: str, device: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", module, "--host", host, "--port", str(port), "--model", model,
            "--device", device, *extra]


def wait_serving(address: str, proc: subprocess.Popen, name: str, timeout: float, tls=None) -> None:
    """Until the process at `address` reports SERVING (TLS per `tls`, else per BATON_TLS_*)."""
    deadline = time.monotonic() + timeout
    with open_sync_channel(address, tls if tls is not None else tls_from_env()) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode} during start-up; see its log above")
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.25)
    raise TimeoutError(f"{name} at {address} not serving after {timeout:.0f}s")


def stop_all(children: list, grace: float = 10.0) -> None:
    """SIGTERM each (last started first), then SIGKILL what is still up after `grace` seconds;
    `children`: anything with a `.proc` (a Popen)."""
    for c in reversed(children):
        if c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for c in children:
        try:
            c.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()
