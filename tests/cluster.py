"""Real Baton processes on loopback for end-to-end tests: start, wait healthy, kill, stop."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from baton.serving.processes import free_port, wait_serving
from baton.v1 import router_pb2, router_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 180.0


@dataclass
class Proc:
    name: str
    cmd: list[str]
    address: str
    popen: subprocess.Popen | None = None
    log: Path | None = None
    env: dict = field(default_factory=dict)      # this process's own variables, over the cluster's

    def start(self, env: dict, log_dir: Path) -> None:
        self.log = log_dir / f"{self.name}.log"
        f = open(self.log, "ab")
        self.popen = subprocess.Popen(self.cmd, cwd=REPO, env={**env, **self.env}, stdout=f,
                                      stderr=subprocess.STDOUT)

    def wait_ready(self, tls=None) -> None:
        try:
            wait_serving(self.address, self.popen, self.name, START_TIMEOUT_S, tls)
        except Exception as exc:
            raise RuntimeError(f"{exc}\n--- {self.name} log ---\n{self.tail()}") from exc

    def tail(self, n: int = 60) -> str:
        if not self.log or not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.popen and self.popen.poll() is None:
            self.popen.send_signal(sig)
            self.popen.wait(30)

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def peak_rss_mib(self) -> float:
        """The peak resident memory so far (VmHWM), MiB, of the process and its children (a
        worker's engine core)."""
        return sum(peak_rss_mib(pid) for pid in [self.popen.pid, *children(self.popen.pid)])

    def status(self, timeout: float = 5.0, tls=None):
        """The worker's own GetStatus (works while the router is down)."""
        from baton.serving.grpc_server import open_sync_channel
        from baton.v1 import decode_pb2_grpc, prefill_pb2_grpc, worker_pb2
        with open_sync_channel(self.address, tls) as ch:
            stub_cls = prefill_pb2_grpc.PrefillStub if self.name.startswith("prefill") else decode_pb2_grpc.DecodeStub
            return stub_cls(ch).GetStatus(worker_pb2.GetStatusRequest(), timeout=timeout)


def peak_rss_mib(pid: int) -> float:
    """One process's peak resident memory so far (VmHWM), MiB (0 if it is gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return 0.0
    return next((int(line.split()[1]) / 1024 for line in lines if line.startswith("VmHWM:")), 0.0)


def children(pid: int) -> list[int]:
    """The pids of a process's children."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@dataclass
class Cluster:
    log_dir: Path
    procs: list[Proc] = field(default_factory=list)
    router: Proc | None = None
    env: dict = field(default_factory=dict)
    tls: object = None                    # engine.security.TLSConfig the test talks to the cluster with
    http_url: str = ""                    # the OpenAI API's base URL (launch(http=True))

    @classmethod
    def launch(cls, log_dir: Path, prefill: int = 1, decode: int = 1, colocated: int = 0,
               worker_args: list[str] = (), router_args: list[str] = (), env: dict | None = None,
               ports: dict[str, int] | None = None, extra: dict[str, list[str]] | None = None,
               tls=None, worker_env: dict[str, dict] | None = None, http: bool = False) -> Cluster:
        """`ports`/`extra`/`worker_env`: a fixed port / more flags / environment variables for the
        worker of that name ("decode-0");
        `tls`: how this test process reaches the cluster (its health checks) when it runs TLS;
        `http`: the router also serves the OpenAI API, at `c.http_url`."""
        # one torch thread per worker: several processes share CI's two cores
        c = cls(log_dir, env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {})), tls=tls)
        log_dir.mkdir(parents=True, exist_ok=True)
        ports, extra = ports or {}, extra or {}

        def make(role, i, module, args):
            name = f"{role}-{i}"
            return c._worker(role, i, module, [*args, *extra.get(name, [])], ports.get(name))
        workers = ([make("prefill", i, "baton.prefill_service", worker_args) for i in range(prefill)]
                   + [make("decode", i, "baton.decode_service", worker_args) for i in range(decode)]
                   + [make("colocated", i, "baton.decode_service", [*worker_args, "--colocated"])
                      for i in range(colocated)])
        for p in workers:
            p.env = dict((worker_env or {}).get(p.name, {}))
            p.start(c.env, log_dir)
        for p in workers:
            p.wait_ready(tls)
        flags = []
        for role in ("prefill", "decode", "colocated"):
            addrs = [p.address for p in workers if p.name.startswith(role)]
            if addrs:
                flags += [f"--{role}", ",".join(addrs)]
        port = free_port()
        if http:
            http_port = free_port()
            flags += ["--http-port", str(http_port)]
            c.http_url = f"http://127.0.0.1:{http_port}/v1"
        c.router = Proc("router", [sys.executable, "-m", "baton.router", "--port", str(port), *flags, *router_args],
                        f"127.0.0.1:{port}")
        c.router.start(c.env, log_dir)
        c.procs.append(c.router)
        c.router.wait_ready(tls)
        return c

    @classmethod
    def serve(cls, log_dir: Path, args: list[str] = ()) -> Cluster:
        """`baton serve` (router, prefill and decode as the launcher starts them), one process
        here: `c.router` is it; ready once it prints its ready line."""
        c = cls(log_dir, env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"))
        log_dir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        c.router = Proc("serve", [sys.executable, "-m", "baton", "serve", "--port", str(port), *args],
                        f"127.0.0.1:{port}")
        c.router.start(c.env, log_dir)
        c.procs.append(c.router)
        deadline = time.monotonic() + START_TIMEOUT_S
        while "is serving on" not in c.router.tail():
            if not c.router.alive or time.monotonic() > deadline:
                c.stop()
                raise RuntimeError(f"baton serve did not come up\n--- its log ---\n{c.router.tail()}")
            time.sleep(0.3)
        return c

    def _worker(self, role: str, i: int, module: str, extra, port: int | None = None) -> Proc:
        port = port or free_port()
        p = Proc(f"{role}-{i}", [sys.executable, "-m", module, "--port", str(port), *extra], f"127.0.0.1:{port}")
        self.procs.append(p)
        return p

    def worker(self, name: str) -> Proc:
        return next(p for p in self.procs if p.name == name)

    def restart(self, name: str) -> None:
        p = self.worker(name)
        p.kill()
        p.start(self.env, self.log_dir)
        p.wait_ready(self.tls)

    def stub(self) -> router_pb2_grpc.RouterStub:
        return router_pb2_grpc.RouterStub(grpc.insecure_channel(self.router.address))

    def server_info(self) -> router_pb2.ServerInfo:
        return self.stub().GetServerInfo(router_pb2.GetServerInfoRequest(), timeout=5)

    def wait_blocks_free(self, timeout: float = 15.0) -> router_pb2.ServerInfo:
        """Until every healthy worker reports free == total (health checks refresh each second)."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.server_info()
            healthy = [w for w in info.workers if w.healthy]
            if healthy and all(w.kv_blocks_free == w.kv_blocks_total and w.running == 0 and w.waiting == 0
                               for w in healthy):
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"KV blocks still held after {timeout}s: {info}")
            time.sleep(0.3)

    def wait_workers_idle(self, timeout: float = 15.0) -> int:
        """Until every live worker holds no KV block and runs nothing, asked directly (no router
        needed); returns the blocks still held when it gives up (0 = clean)."""
        deadline = time.monotonic() + timeout
        while True:
            held = 0
            for p in self.procs:
                if p is self.router or not p.alive:
                    continue
                try:
                    s = p.status(tls=self.tls)
                except grpc.RpcError:
                    held += 1 << 20          # unreachable counts as not clean
                    continue
                held += (s.kv_blocks_total - s.kv_blocks_free) + s.running + s.waiting
            if held == 0 or time.monotonic() > deadline:
                return held
            time.sleep(0.3)

    def wait_health(self, address: str, healthy: bool, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(w.address == address and w.healthy == healthy for w in self.server_info().workers):
                return
            time.sleep(0.3)
        raise AssertionError(f"{address} did not become {'healthy' if healthy else 'unhealthy'}")

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.alive:
                p.popen.send_signal(signal.SIGTERM)
        for p in self.procs:
            if p.popen is None:
                continue
            try:
                p.popen.wait(15)
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()
