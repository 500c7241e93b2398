"""Hosts of our own on one machine: a Linux network namespace per 'container', joined by a
bridge, with names resolving as compose resolves them.

What a container sees, a process started here sees: its own interfaces and address (loopback
is its own, so 127.0.0.1 is not its peers), a host name of its own, and an /etc/hosts that
maps every service name to the addresses of that service's hosts (`ip netns exec` mounts
/etc/netns/NS/hosts over /etc/hosts). The bridge lives in a namespace of its own, so no
test traffic touches the machine's own interfaces. Needs root and iproute2.

    with Network("bt") as net:
        a = net.add("decode", service="decode")
        net.popen(a, ["python", "-m", ...])
"""
from __future__ import annotations

import os
import random
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path


def _ip(*args: str) -> None:
    run = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if run.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {run.stderr.strip()}")


@dataclass
class Host:
    ns: str                    # the namespace's name
    hostname: str              # what `hostname` says inside (a container id, in Docker)
    ip: str
    service: str | None        # the compose service it belongs to: its name resolves here
    procs: list[subprocess.Popen] = field(default_factory=list)


class Network:
    def __init__(self, prefix: str):
        tag = f"{prefix}{os.getpid() % 10000}"
        self.prefix = tag
        self.switch = f"{tag}-sw"
        a, b = random.randint(16, 31), random.randint(0, 255)      # 172.16.0.0/12, as Docker picks
        self.subnet = f"172.{a}.{b}"
        self.hosts: list[Host] = []
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def add(self, name: str, service: str | None = None) -> Host:
        """A new host on the network (a container of `service`, if given)."""
        i = len(self.hosts) + 2
        host = Host(f"{self.prefix}-{name}", f"{random.getrandbits(48):012x}", f"{self.subnet}.{i}", service)
        _ip("netns", "add", host.ns)
        _ip("-n", self.switch, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0", "netns", host.ns)
        _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
        _ip("-n", host.ns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
        _ip("-n", host.ns, "link", "set", "eth0", "up")
        _ip("-n", host.ns, "link", "set", "lo", "up")
        self.hosts.append(host)
        self.write_hosts()
        return host

    def names(self, host: Host) -> dict[str, list[str]]:
        """What `host` resolves: each service to its hosts' addresses, and itself."""
        out: dict[str, list[str]] = {host.hostname: [host.ip]}
        for h in self.hosts:
            if h.service:
                out.setdefault(h.service, []).append(h.ip)
        return out

    def write_hosts(self, overrides: dict[str, dict[str, list[str]]] | None = None) -> None:
        """Rewrite every host's /etc/hosts in place (a running process sees the change, as a
        re-resolving client sees compose's DNS change). `overrides[ns][name]` replaces one
        name's addresses as one host sees them."""
        for h in self.hosts:
            names = self.names(h) | (overrides or {}).get(h.ns, {})
            lines = ["127.0.0.1 localhost", "::1 localhost"]
            lines += [f"{ip} {name}" for name, ips in names.items() for ip in ips]
            path = Path("/etc/netns") / h.ns / "hosts"
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as f:          # same inode: the bind mount inside sees it
                f.write("\n".join(lines) + "\n")

    def command(self, host: Host, argv: list[str]) -> list[str]:
        """`argv` as run inside `host`: its network, its /etc/hosts, its own host name."""
        return ["ip", "netns", "exec", host.ns, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                host.hostname, *argv]

    def popen(self, host: Host, argv: list[str], **kw) -> subprocess.Popen:
        p = subprocess.Popen(self.command(host, argv), **kw)
        host.procs.append(p)
        return p

    def run(self, host: Host, argv: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(host, argv), timeout=timeout, **kw)

    def close(self) -> None:
        for h in self.hosts:
            for p in h.procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=30)
        for h in self.hosts:
            subprocess.run(["ip", "netns", "del", h.ns], capture_output=True, timeout=30)
            shutil.rmtree(Path("/etc/netns") / h.ns, ignore_errors=True)
        subprocess.run(["ip", "netns", "del", self.switch], capture_output=True, timeout=30)
