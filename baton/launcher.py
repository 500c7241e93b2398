"""`baton serve`: router + prefill + decode (or colocated) workers as separate local processes.

Workers get free loopback ports; the router gets --port (default 50051). Every flag of
`baton serve` that a worker or the router also takes is passed on to it, so the stack a user
starts first has the same security, limits and engine settings as one started by hand. The
launcher waits until every process reports SERVING, prints the router address, and on
Ctrl-C / SIGTERM stops them all (SIGTERM, then SIGKILL after the grace period).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from baton.router.config import add_auth_and_limits
from baton.router.config import build_parser as router_parser
from baton.serving.options import flag, parser
from baton.serving.processes import (
    START_TIMEOUT_S,
    Child,
    devices_for,
    free_port,
    stop_all,
    wait_serving,
)
from baton.serving.worker_config import add_worker_args
from baton.serving.worker_config import build_parser as worker_parser

# set per process by the launcher, never passed on from `baton serve`'s own value
PER_PROCESS = {"host", "port", "metrics_port", "device", "colocated", "prefill", "decode", "help"}


def build_parser() -> argparse.ArgumentParser:
    p = parser("baton serve", "router + prefill + decode workers as separate local processes")
    add_worker_args(p, 50051)      # --port is the router's; workers listen on free loopback ports
    t = p.add_argument_group("topology")
    flag(t, "--prefill-instances", type=int, default=1, help="prefill workers")
    flag(t, "--decode-instances", type=int, default=1, help="decode workers")
    flag(t, "--colocated", type=bool, default=False, help="colocated worker(s) instead of prefill + decode")
    flag(t, "--instances", type=int, default=1, help="colocated workers (with --colocated)")
    flag(t, "--prefill-devices", help="comma list, one per prefill instance (unset: --device)")
    flag(t, "--decode-devices", help="comma list, one per decode instance (unset: --device)")
    add_auth_and_limits(p)
    flag(p, "--policy", default="least_loaded", choices=("round_robin", "least_loaded", "prefix_aware"),
         help="how the router picks a worker for a request")
    return p


def passed_on(args: argparse.Namespace, child: argparse.ArgumentParser) -> list[str]:
    """The flags of `child` whose value in `args` differs from the child's own default."""
    out: list[str] = []
    for action in child._actions:
        if not action.option_strings or action.dest in PER_PROCESS or not hasattr(args, action.dest):
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        name = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            out.append(name if value else f"--no-{name[2:]}")
        else:
            out += [name, str(value)]
    return out


def serve(args: argparse.Namespace) -> int:
    host = args.host
    children: list[Child] = []
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if "cpu" in (args.device, args.prefill_devices, args.decode_devices):
        # CPU workers share the machine's cores: oversubscribed torch threads crawl
        n = (args.instances if args.colocated else args.prefill_instances + args.decode_instances)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    shared = {role: passed_on(args, worker_parser(role)) for role in ("prefill", "decode")}

    def start(name: str, module: str, role: str, device: str, extra: list[str]) -> str:
        port = free_port(host)
        if args.metrics_port:           # the router gets --metrics-port; workers the ports after it
            extra = [*extra, "--metrics-port", str(args.metrics_port + 1 + len(children))]
        cmd = [sys.executable, "-m", module, "--host", host, "--port", str(port), "--device", device,
               *shared[role], *extra]
        children.append(Child(name, f"{host}:{port}", subprocess.Popen(cmd, env=env)))
        return f"{host}:{port}"

    try:
        router_flags: list[str] = []
        if args.colocated:
            addrs = [start(f"colocated-{i}", "baton.decode_service", "decode", d, ["--colocated"])
                     for i, d in enumerate(devices_for(args.decode_devices or args.device, args.device, args.instances))]
            router_flags += ["--colocated", ",".join(addrs)]
        else:
            pre = [start(f"prefill-{i}", "baton.prefill_service", "prefill", d, [])
                   for i, d in enumerate(devices_for(args.prefill_devices, args.device, args.prefill_instances))]
            dec = [start(f"decode-{i}", "baton.decode_service", "decode", d, [])
                   for i, d in enumerate(devices_for(args.decode_devices, args.device, args.decode_instances))]
            router_flags += ["--prefill", ",".join(pre), "--decode", ",".join(dec)]
        print(f"[baton] starting {len(children)} worker(s) on {args.model} ...", file=sys.stderr, flush=True)
        for c in children:
            wait_serving(c.address, c.proc, c.name, START_TIMEOUT_S)
        router_addr = f"{host}:{args.port}"
        cmd = [sys.executable, "-m", "baton.router", "--host", host, "--port", str(args.port),
               *passed_on(args, router_parser()), *router_flags]
        if args.metrics_port:
            cmd += ["--metrics-port", str(args.metrics_port)]
        children.append(Child("router", router_addr, subprocess.Popen(cmd, env=env)))
        wait_serving(router_addr, children[-1].proc, "router", START_TIMEOUT_S)
        print(f"baton is serving on {router_addr}  (try: baton generate \"What is the capital of France?\")",
              flush=True)
        _wait_until_signal_or_exit(children)
    except KeyboardInterrupt:
        pass
    except (RuntimeError, TimeoutError) as exc:
        print(f"[baton] {exc}", file=sys.stderr)
        stop_all(children)
        return 1
    stop_all(children)
    return 0


def _wait_until_signal_or_exit(children: list[Child]) -> None:
    stop = {"flag": False}

    def handler(signum, frame):
        stop["flag"] = True
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    while not stop["flag"]:
        for c in children:
            if c.proc.poll() is not None:
                print(f"[baton] {c.name} exited with code {c.proc.returncode}; stopping the rest",
                      file=sys.stderr)
                return
        time.sleep(0.5)
