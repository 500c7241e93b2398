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
import sys
import threading

from baton.router.config import add_auth_and_limits, add_generation_config, add_http_api
from baton.router.config import build_parser as router_parser
from baton.serving.grpc_server import port_is_free
from baton.serving.options import flag, parser
from baton.serving.processes import START_TIMEOUT_S, devices_for, free_port
from baton.serving.security import tls_from_args
from baton.serving.worker_config import add_worker_args
from baton.serving.worker_config import build_parser as worker_parser
from baton.supervisor import Process, Supervisor

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
    add_generation_config(p)
    add_http_api(p)
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
    taken = [f"{host}:{port} ({what})" for port, what in _ports(args) if not port_is_free(host, port)]
    if taken:          # before anything starts: a second `baton serve` must not report the first one's stack
        print(f"baton serve: {', '.join(taken)} in use (another Baton stack?): stop it, or pick other ports "
              "with --port / --http-port / --metrics-port", file=sys.stderr)
        return 1
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if "cpu" in (args.device, args.prefill_devices, args.decode_devices):
        # CPU workers share the machine's cores: oversubscribed torch threads crawl
        n = (args.instances if args.colocated else args.prefill_instances + args.decode_instances)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    sup = Supervisor(env, tls=tls_from_args(args))
    workers, router_flags = _workers(args)
    router = _router(args, router_flags)
    stopping = _on_signals()
    try:
        print(f"[baton] starting {len(workers)} worker(s) on {args.model} ...", file=sys.stderr, flush=True)
        for w in workers:
            sup.start(w)
        for w in workers:
            sup.wait_ready(w, START_TIMEOUT_S)
        sup.start(router)
        sup.wait_ready(router, START_TIMEOUT_S)
        print(f"baton is serving on {router.address}  (try: {_try_command(args, router.address)})", flush=True)
        if args.http_port:
            scheme = "https" if args.tls_cert else "http"
            print(f"OpenAI-compatible API on {scheme}://{args.host}:{args.http_port}/v1  (try: curl "
                  f"{scheme}://{args.host}:{args.http_port}/v1/models)", flush=True)
        while not stopping.is_set():
            if not sup.tick():
                sup.stop_all()
                return 1
            stopping.wait(0.5)
    except (RuntimeError, TimeoutError) as exc:
        print(f"[baton] {exc}", file=sys.stderr)
        sup.stop_all()
        return 1
    sup.stop_all()
    return 0


def _ports(args) -> list[tuple[int, str]]:
    ports = [(args.port, "the router's --port")]
    if args.http_port:
        ports.append((args.http_port, "the OpenAI API's --http-port (0: off)"))
    if args.metrics_port:
        n = args.instances if args.colocated else args.prefill_instances + args.decode_instances
        ports += [(args.metrics_port + i, "--metrics-port and the ports after it") for i in range(n + 1)]
    return ports


def _workers(args) -> tuple[list[Process], list[str]]:
    """The worker processes (each on a fixed free port: a restart comes back where it was) and
    the router flags that name them."""
    host = args.host
    shared = {role: passed_on(args, worker_parser(role)) for role in ("prefill", "decode")}
    specs = []
    if args.colocated:
        specs += [("colocated", i, "decode", d, ["--colocated"]) for i, d in
                  enumerate(devices_for(args.decode_devices or args.device, args.device, args.instances))]
    else:
        specs += [("prefill", i, "prefill", d, []) for i, d in
                  enumerate(devices_for(args.prefill_devices, args.device, args.prefill_instances))]
        specs += [("decode", i, "decode", d, []) for i, d in
                  enumerate(devices_for(args.decode_devices, args.device, args.decode_instances))]
    workers = []
    for n, (kind, i, role, device, extra) in enumerate(specs):
        port = free_port(host)
        if args.metrics_port:           # the router gets --metrics-port; workers the ports after it
            extra = [*extra, "--metrics-port", str(args.metrics_port + 1 + n)]
        module = "baton.prefill_service" if role == "prefill" else "baton.decode_service"
        cmd = [sys.executable, "-m", module, "--host", host, "--port", str(port), "--device", device,
               *shared[role], *extra]
        workers.append(Process(f"{kind}-{i}", cmd, f"{host}:{port}"))
    flags = []
    for kind in ("prefill", "decode", "colocated"):
        addrs = [w.address for w in workers if w.name.startswith(kind)]
        if addrs:
            flags += [f"--{kind}", ",".join(addrs)]
    return workers, flags


def _router(args, worker_flags: list[str]) -> Process:
    cmd = [sys.executable, "-m", "baton.router", "--host", args.host, "--port", str(args.port),
           *passed_on(args, router_parser()), *worker_flags]
    if args.metrics_port:
        cmd += ["--metrics-port", str(args.metrics_port)]
    return Process("router", cmd, f"{args.host}:{args.port}", critical=True)


def _try_command(args, address: str) -> str:
    """The command the ready line suggests, exactly as it must be typed for this stack."""
    flags = "" if address == "127.0.0.1:50051" else f" --addr {address}"
    if args.auth_token or args.auth_token_file:
        flags += " --token $BATON_AUTH_TOKEN"
    if args.tls_ca or args.tls_cert:
        flags += " --tls-ca <the CA bundle>"
    return f'baton generate "What is the capital of France?"{flags}'


def _on_signals() -> threading.Event:
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    return stopping
