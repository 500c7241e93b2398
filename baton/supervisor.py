"""Keeps `baton serve`'s processes running. A process that dies is started again with the same
command (so the same port: the router's health checks find a restarted worker by themselves,
and a restarted router finds its workers) after a backoff that doubles; one that keeps dying
(more restarts than the policy allows within its window) is given up on, with a message
naming it and its last exit code. Giving up on the router ends the stack; giving up on a
worker leaves the others serving.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton import environment
from baton.serving.grpc_server import open_sync_channel
from baton.serving.logs import quiet_grpc
from baton.serving.processes import stop_all


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    backoff_s: float = 1.0               # the first restart's wait; it doubles with each restart in the window
    max_backoff_s: float = 30.0
    max_restarts: int = 5                # more restarts than this within window_s: a crash loop
    window_s: float = 120.0


@dataclass
class Process:
    name: str
    command: list[str]
    address: str
    critical: bool = False               # the stack cannot serve without it (the router)
    # a process sharing its address with others (routers on one port): it serves once it has written this
    # file (baton router --ready-file), which the address's health check cannot tell
    ready_file: Path | None = None
    proc: subprocess.Popen | None = None
    restarts: deque = field(default_factory=deque)    # when it was restarted, within the window
    restart_at: float | None = None      # dead, to be started again then
    ready: bool = False
    gave_up: bool = False

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    def __init__(self, env: dict, policy: RestartPolicy = RestartPolicy(), tls=None, out=None):
        self.env = quiet_grpc(dict(env))     # no gRPC core chatter from the children, unless the user asks
        # the children end with this process, even when it is killed outright (serving/grpc_server.py: run_server)
        self.env[environment.SUPERVISOR_PID.name] = str(os.getpid())
        self.policy = policy
        self.tls = tls
        self.out = out            # None: sys.stderr when said (setup_logging may have wrapped it since import)
        self.processes: list[Process] = []

    def say(self, text: str) -> None:
        print(f"[baton] {text}", file=self.out or sys.stderr, flush=True)

    def start(self, p: Process) -> None:
        if p not in self.processes:
            self.processes.append(p)
        if p.ready_file is not None:
            p.ready_file.unlink(missing_ok=True)
        p.proc = subprocess.Popen(p.command, env=self.env)
        p.ready, p.restart_at = False, None

    def healthy(self, p: Process, timeout: float = 0.5) -> bool:
        if p.ready_file is not None:
            return p.ready_file.exists()
        with open_sync_channel(p.address, self.tls) as ch:
            try:
                reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            except grpc.RpcError:
                return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def wait_ready(self, p: Process, timeout: float) -> None:
        """At start-up: until `p` serves; RuntimeError if it exits first, TimeoutError after `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not p.alive:
                raise RuntimeError(f"{p.name} exited with code {p.proc.returncode} during start-up; see its log above")
            if self.healthy(p, timeout=1.0):
                p.ready = True
                return
            time.sleep(0.25)
        raise TimeoutError(f"{p.name} at {p.address} not serving after {timeout:.0f}s")

    def tick(self) -> bool:
        """One round of supervision; False once the stack can no longer serve (the router was
        given up on)."""
        now = time.monotonic()
        for p in self.processes:
            if p.gave_up:
                continue
            if p.restart_at is None and not p.alive:
                self._died(p, now)
            elif p.restart_at is not None and now >= p.restart_at:
                self.say(f"restarting {p.name} (restart {len(p.restarts)} in the last "
                         f"{self.policy.window_s:.0f}s)")
                self.start(p)
            elif p.alive and not p.ready and self.healthy(p, timeout=0.2):
                p.ready = True
                self.say(f"{p.name} is back, serving on {p.address}")
            if p.gave_up and p.critical:
                return False
        return True

    def _died(self, p: Process, now: float) -> None:
        code = p.proc.returncode
        while p.restarts and now - p.restarts[0] > self.policy.window_s:
            p.restarts.popleft()
        if len(p.restarts) >= self.policy.max_restarts:
            p.gave_up = True
            self.say(f"{p.name} exited with code {code} and has crashed {len(p.restarts) + 1} times within "
                     f"{self.policy.window_s:.0f}s: giving up on it (see its log above)"
                     + ("; stopping the stack" if p.critical else "; the rest keeps serving"))
            return
        wait = min(self.policy.max_backoff_s, self.policy.backoff_s * 2 ** len(p.restarts))
        p.restarts.append(now)
        p.restart_at = now + wait
        p.ready = False
        self.say(f"{p.name} exited with code {code}; restarting it in {wait:.0f}s")

    def stop_all(self, grace: float = 10.0) -> None:
        stop_all([p for p in self.processes if p.alive], grace)
