"""`baton serve`: router + prefill + decode (or colocated) workers as separate local processes.

Workers get free loopback ports; the router gets --port (default 50051). Every flag of
`baton serve` that a worker or the router also takes is passed on to it, so the stack a user
starts first has the same security, limits and engine settings as one started by hand. The
launcher first checks what it can without starting anything (the flags, the model, the devices,
the ports: baton/preflight.py) and has the model made ready once for every process; it waits
until every process reports SERVING, prints the router address with commands that work as
printed, and on Ctrl-C / SIGTERM stops them all (SIGTERM, then SIGKILL after the grace period).
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from baton import environment, preflight
from baton.client import DEFAULT_ADDR, baton_command
from baton.router.config import add_router_args
from baton.router.config import build_parser as router_parser
from baton.serving.grpc_server import host_problem, port_is_free
from baton.serving.logs import setup_logging
from baton.serving.options import flag, parser, port_clash
from baton.serving.processes import START_TIMEOUT_S, WILDCARD_HOSTS, devices_for, free_port
from baton.serving.security import tls_from_args
from baton.serving.server_config import DEFAULT_PORTS
from baton.serving.worker.worker_config import add_worker_args
from baton.serving.worker.worker_config import build_parser as worker_parser
from baton.supervisor import Process, Supervisor

NAMED_TOKEN = "<the --api-key / --auth-token token>"
# set per process by the launcher, never passed on from `baton serve`'s own value
PER_PROCESS = {"host", "port", "metrics_port", "device", "colocated", "prefill", "decode", "help", "config"}


def build_parser() -> argparse.ArgumentParser:
    p = parser("baton serve", "router + prefill + decode workers as separate local processes",
               usage="baton serve [MODEL] [flags]")
    add_worker_args(p, DEFAULT_PORTS["router"])      # --port is the router's; workers listen on free loopback ports
    t = p.add_argument_group("topology")
    flag(t, "--prefill-instances", type=int, default=1, help="prefill workers")
    flag(t, "--decode-instances", type=int, default=1, help="decode workers")
    flag(t, "--colocated", type=bool, default=False, help="colocated worker(s) instead of prefill + decode")
    flag(t, "--instances", type=int, default=1, help="colocated workers (with --colocated)")
    flag(t, "--prefill-devices", help="comma list, one per prefill instance (unset: --device)")
    flag(t, "--decode-devices", help="comma list, one per decode instance (unset: --device)")
    flag(t, "--routers", type=int, default=1,
         help="router processes sharing --port and --http-port (baton router --reuse-port: the kernel deals "
              "connections out among them): one carries ~280 short requests a second; their /metrics on --http-port "
              "is one router's, each also serves its own and the workers' on a metrics port of its own (--metrics-port: "
              "the ports after the workers'), which the ready lines list for `baton top` / `baton elastic --metrics-url`")
    add_planner_args(t)
    add_router_args(p)
    return p


def add_planner_args(t) -> None:
    flag(t, "--planner", type=bool, default=False,
         help="let `baton plan` choose the prefill / decode instance counts (or colocated) for --planner-devices: "
              "the split with the best predicted goodput for --planner-dataset at the --planner-slo-* targets "
              "(profiles --planner-devices' first device once, cached in --planner-profile)")
    flag(t, "--planner-devices", help="comma list of devices to split, one worker each (unset: --prefill-devices "
         "and --decode-devices together, else --device twice)")
    flag(t, "--planner-dataset", default="random",
         help="the workload to plan for: random, prefill-heavy, decode-heavy, mixed, shared-prefix or a .jsonl")
    flag(t, "--planner-slo-ttft-ms", type=float, default=1000.0, help="the planner's TTFT target")
    flag(t, "--planner-slo-tpot-ms", type=float, default=50.0, help="the planner's TPOT target")
    flag(t, "--planner-profile", help="the planner's device profile cache (unset: "
         "<cache dir>/profiles/<model>-<device kind>.json)")


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
        elif isinstance(value, list):
            out += [name, *map(str, value)]
        else:
            out += [name, str(value)]
    return out


def serve(args: argparse.Namespace) -> int:
    setup_logging(args.log_level, args.log_format)        # this process's lines read as its children's
    # the file's settings are in `args` now and reach each process as flags (passed_on): the file
    # itself, a `baton serve` file, is read by no router or worker parser (here or in a child)
    environment.unset(environment.twin("--config"))
    if args.planner:
        code = apply_plan(args)
        if code:
            return code
    counts = ["instances"] if args.colocated else ["prefill_instances", "decode_instances"]
    for name in [*counts, "routers"]:
        if getattr(args, name) < 1:
            print(f"baton serve: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    ignored = _ignored_count(args)
    if ignored:             # a count of workers the topology has none of would be dropped without a word
        print(f"baton serve: {ignored}", file=sys.stderr)
        return 2
    wrong_host = host_problem(args.host)
    if wrong_host:          # before a worker's port is picked on it
        print(f"baton serve: {wrong_host}", file=sys.stderr)
        return 2
    specs = _specs(args)
    workers, worker_flags = _workers(args, specs)
    roles = ["colocated"] if args.colocated else ["prefill", "decode"]
    wrong = preflight.problem(args, roles, [s.device for s in specs] + _split(args.tp_devices),
                              [*passed_on(args, router_parser()), *worker_flags])
    if wrong:          # what a worker would refuse after loading torch, said in a blink, once
        print(f"baton serve: {wrong}", file=sys.stderr)
        return 2
    clash = port_clash(_ports(args))
    if clash:
        print(f"baton serve: {clash}", file=sys.stderr)
        return 2
    host = args.host
    taken = [f"{host}:{port} ({what})" for port, what in _ports(args) if not port_is_free(host, port)]
    if taken:          # before anything starts: a second `baton serve` must not report the first one's stack
        print(f"baton serve: {', '.join(taken)} in use (another Baton stack?): stop it, or pick other ports "
              "with --port / --http-port / --metrics-port", file=sys.stderr)
        return 1
    env = environment.for_children(PYTHONUNBUFFERED="1")
    if "cpu" in (args.device, args.prefill_devices, args.decode_devices):
        # CPU workers share the machine's cores: oversubscribed torch threads crawl
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // len(workers))))
    stopping = _on_signals()
    code = preflight.prepare_model(args, env, stopping)
    if code or stopping.is_set():
        return code
    ready_dir = Path(tempfile.mkdtemp(prefix="baton-serve-")) if args.routers > 1 else None
    try:
        return _run(Supervisor(env, tls=tls_from_args(args)), workers,
                    _routers(args, worker_flags, len(workers), ready_dir), args, stopping)
    finally:
        if ready_dir is not None:
            shutil.rmtree(ready_dir, ignore_errors=True)


def _run(sup: Supervisor, workers: list[Process], routers: list[Process], args, stopping: threading.Event) -> int:
    try:
        print(f"[baton] starting {len(workers)} worker(s) on {args.model} ...", file=sys.stderr, flush=True)
        for w in workers:
            sup.start(w)
        for w in workers:
            sup.wait_ready(w, START_TIMEOUT_S)
        for router in routers:           # one after another: a shared port's health says nothing of the next
            sup.start(router)
            sup.wait_ready(router, START_TIMEOUT_S)
        for line in ready_lines(args, routers):
            print(line, flush=True)
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


def planner_devices(args) -> list[str]:
    if args.planner_devices:
        return _split(args.planner_devices)
    given = _split(args.prefill_devices) + _split(args.decode_devices)
    return given or [args.device, args.device]


def apply_plan(args) -> int:
    """--planner: run `baton plan` (its own process: the profile's engine must let go of the device
    before the workers take it) and set the topology flags from its pick."""
    import json
    import subprocess
    import tempfile
    devices = planner_devices(args)
    from baton.benchmarks.device_profile import default_path
    profile = args.planner_profile or str(default_path(args.model, devices[0], args.cache_dir))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        cmd = [sys.executable, "-m", "baton", "plan", "--model", str(args.model), "--devices", str(len(devices)),
               "--device", devices[0], "--dataset", args.planner_dataset, "--tp-sizes", "1",
               "--slo-ttft-ms", f"{args.planner_slo_ttft_ms:g}", "--slo-tpot-ms", f"{args.planner_slo_tpot_ms:g}",
               "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
               "--profile", profile, "--output", str(out)]
        if getattr(args, "num_kv_blocks", None):        # the KV the workers will hold, for the simulation
            cmd += ["--worker-args", f"--num-kv-blocks {args.num_kv_blocks}"]
        print(f"[baton] --planner: planning {len(devices)} device(s) ({', '.join(devices)}) ...", file=sys.stderr,
              flush=True)
        try:
            done = subprocess.run(cmd, stdout=sys.stderr, timeout=900)
        except subprocess.TimeoutExpired:
            print("baton serve: --planner: `baton plan` took over 15 minutes; give --prefill-instances / "
                  "--decode-instances yourself", file=sys.stderr)
            return 1
        if done.returncode or not out.is_file():
            print(f"baton serve: --planner: `baton plan` failed (exit {done.returncode}); its message is above",
                  file=sys.stderr)
            return done.returncode or 1
        plan = json.loads(out.read_text())
    pick = next(iter(plan["workloads"].values()))["slos"]
    best = next(iter(pick.values()))["best"]
    if best is None:
        print("baton serve: --planner: no split meets the targets on these devices; loosen --planner-slo-*-ms "
              "or add devices", file=sys.stderr)
        return 2
    set_topology(args, best, devices)
    print(f"[baton] --planner: {best} (predicted goodput {next(iter(pick.values()))['goodput']:.3g} req/s)",
          file=sys.stderr, flush=True)
    return 0


def set_topology(args, topology: str, devices: list[str]) -> None:
    """The launcher's flags for a planned topology (one device per worker, in the order given)."""
    from baton.benchmarks.deployment import parse
    t = parse(topology)
    if t.colocated:
        args.colocated, args.instances = True, t.count("colocated")
        args.decode_devices = ",".join(devices[:args.instances])
        return
    n_p, n_d = t.count("prefill"), t.count("decode")
    args.colocated = False
    args.prefill_instances, args.decode_instances = n_p, n_d
    args.prefill_devices, args.decode_devices = ",".join(devices[:n_p]), ",".join(devices[n_p:n_p + n_d])


def _ports(args) -> list[tuple[int, str]]:
    ports = [(args.port, "--port (the router's gRPC)")]
    if args.http_port:
        ports.append((args.http_port, "--http-port (the OpenAI API; 0: off)"))
    if args.metrics_port:
        n = args.instances if args.colocated else args.prefill_instances + args.decode_instances
        ports += [(args.metrics_port + i, f"--metrics-port{f' + {i}' if i else ''} (metrics, one port per process)")
                  for i in range(n + max(1, args.routers))]
    return ports


@dataclass(frozen=True, slots=True)
class Spec:
    kind: str            # prefill | decode | colocated: its name's stem
    index: int
    role: str            # the worker command's: prefill | decode
    device: str
    extra: tuple[str, ...] = ()


def _specs(args) -> list[Spec]:
    if args.colocated:
        return [Spec("colocated", i, "decode", d, ("--colocated",)) for i, d in
                enumerate(devices_for(args.decode_devices or args.device, args.device, args.instances))]
    return [Spec("prefill", i, "prefill", d) for i, d in
            enumerate(devices_for(args.prefill_devices, args.device, args.prefill_instances))] + \
        [Spec("decode", i, "decode", d) for i, d in
         enumerate(devices_for(args.decode_devices, args.device, args.decode_instances))]


def _ignored_count(args) -> str | None:
    """A worker count given for the other topology (they default to 1)."""
    if args.colocated:
        for role in ("prefill", "decode"):
            n = getattr(args, f"{role}_instances")
            if n != 1:
                return (f"--{role}-instances {n} counts {role} workers, which --colocated has none of: "
                        f"give --instances {n} for {n} colocated workers")
    elif args.instances != 1:
        return (f"--instances {args.instances} counts colocated workers: add --colocated, or give "
                "--prefill-instances / --decode-instances")
    return None


def _workers(args, specs: list[Spec]) -> tuple[list[Process], list[str]]:
    """The worker processes (each on a fixed free port: a restart comes back where it was) and
    the router flags that name them."""
    host = args.host
    shared = {role: passed_on(args, worker_parser(role)) for role in ("prefill", "decode")}
    workers = []
    for n, s in enumerate(specs):
        port = free_port(host)
        extra = list(s.extra)
        if args.metrics_port:           # the router gets --metrics-port; workers the ports after it
            extra += ["--metrics-port", str(args.metrics_port + 1 + n)]
        module = "baton.prefill_service" if s.role == "prefill" else "baton.decode_service"
        cmd = [sys.executable, "-m", module, "--host", host, "--port", str(port), "--device", s.device,
               *shared[s.role], *extra]
        workers.append(Process(f"{s.kind}-{s.index}", cmd, f"{host}:{port}"))
    flags = []
    for kind in ("prefill", "decode", "colocated"):
        addrs = [w.address for w in workers if w.name.startswith(kind)]
        if addrs:
            flags += [f"--{kind}", ",".join(addrs)]
    return workers, flags


def _split(devices: str | None) -> list[str]:
    return [d.strip() for d in (devices or "").split(",") if d.strip()]


def _routers(args, worker_flags: list[str], n_workers: int, ready_dir: Path | None) -> list[Process]:
    """The router process, or --routers of them sharing the ports: each then gets a metrics port of its
    own (--metrics-port for the first, the ports after the workers' for the others; free ones without
    --metrics-port) and a ready file in `ready_dir`, how the supervisor tells that one is serving."""
    cmd = [sys.executable, "-m", "baton.router", "--host", args.host, "--port", str(args.port),
           *passed_on(args, router_parser()), *worker_flags, "--worker-metrics"]
    address = f"{args.host}:{args.port}"
    if args.routers == 1:
        return [Process("router", cmd + (["--metrics-port", str(args.metrics_port)] if args.metrics_port else []),
                        address, critical=True)]
    out = []
    for i in range(args.routers):
        if args.metrics_port:
            mport = args.metrics_port if i == 0 else args.metrics_port + n_workers + i
        else:
            mport = free_port(args.host)
        ready = ready_dir / f"router-{i}.ready"
        out.append(Process(f"router-{i}", [*cmd, "--reuse-port", "--metrics-port", str(mport), "--ready-file",
                                           str(ready)], address, critical=True, ready_file=ready))
    return out


# -- the ready lines: commands that work as printed, in the shell that started the stack ------------
def ready_lines(args, routers: list[Process] = ()) -> list[str]:
    host = "127.0.0.1" if args.host in WILDCARD_HOSTS else args.host       # what a client on this host dials
    lines = [f"baton is serving on {host}:{args.port}  (try: {try_command(args, f'{host}:{args.port}')})"]
    if args.http_port:
        url = f"{'https' if args.tls_cert else 'http'}://{host}:{args.http_port}/v1"
        lines.append(f"OpenAI-compatible API on {url}  (try: {try_curl(args, url)})")
    if len(routers) > 1:        # --http-port's /metrics is whichever router answers: each one's own, all of them
        urls = ",".join(f"http://{host}:{r.command[r.command.index('--metrics-port') + 1]}/metrics" for r in routers)
        lines.append(f"{len(routers)} routers, each counting its own requests: their metrics together for "
                     f"`baton top` and `baton elastic` (try: {baton_command()} top --metrics-url {urls})")
    return lines


def try_command(args, address: str) -> str:
    """`baton generate` for this stack, exactly as it must be typed."""
    flags = "" if address == DEFAULT_ADDR else f" --addr {address}"
    if args.auth_token_file:
        flags += f" --auth-token-file {_path(args.auth_token_file)}"
    elif args.auth_token:
        var = _token_var(args)
        flags += f' --auth-token "{var}"' if var else f" --auth-token {NAMED_TOKEN}"
    if args.tls_cert:
        flags += f" --tls-ca {_path(args.tls_ca) if args.tls_ca else '<the CA that signed --tls-cert>'}"
        if args.tls_require_client_cert:
            flags += " --tls-cert <client cert> --tls-key <its key>"
        if args.tls_server_name:
            flags += f" --tls-server-name {shlex.quote(args.tls_server_name)}"
    return f'{baton_command()} generate "What is the capital of France?"{flags}'


def try_curl(args, url: str) -> str:
    flags = ""
    if args.tls_cert:
        flags += f" --cacert {_path(args.tls_ca) if args.tls_ca else '<the CA that signed --tls-cert>'}"
    if args.auth_token_file:
        flags += f' -H "Authorization: Bearer <a token in {_path(args.auth_token_file)}>"'
    elif args.auth_token:
        flags += f' -H "Authorization: Bearer {_token_var(args) or NAMED_TOKEN}"'
    return f"curl{flags} {url}/models"


def _token_var(args) -> str | None:
    """The variable the --auth-token came from, if it did: the hints name the token, never print it
    (these lines end up in logs)."""
    var = environment.twin("--auth-token")
    return f"${var}" if environment.get(var) == args.auth_token else None


def _path(path: str) -> str:
    return shlex.quote(str(Path(path).expanduser().absolute()))


def _on_signals() -> threading.Event:
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    return stopping
