"""`baton serve`: router + prefill + decode (or colocated) workers as separate local processes.

Workers get free loopback ports; the router gets --port (default 50051). The launcher waits
until every process reports SERVING, prints the router address, and on Ctrl-C / SIGTERM
stops them all (SIGTERM, then SIGKILL after the grace period).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from baton.serving.processes import (
    START_TIMEOUT_S,
    Child,
    devices_for,
    free_port,
    stop_all,
    wait_serving,
    worker_command,
)


def serve(args) -> int:
    host = args.host
    worker_args = ["--block-size", str(args.block_size)]
    if args.num_kv_blocks:
        worker_args += ["--num-kv-blocks", str(args.num_kv_blocks)]
    if args.max_model_len:
        worker_args += ["--max-model-len", str(args.max_model_len)]
    children: list[Child] = []
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if "cpu" in (args.device, args.prefill_devices, args.decode_devices):
        # CPU workers share the machine's cores: oversubscribed torch threads crawl
        n = (args.instances if args.colocated else args.prefill_instances + args.decode_instances)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))

    def start(name: str, module: str, device: str, extra: list[str]) -> str:
        port = free_port(host)
        if args.metrics_port:           # the router gets --metrics-port; workers the ports after it
            extra = [*extra, "--metrics-port", str(args.metrics_port + 1 + len(children))]
        cmd = worker_command(module, host, port, args.model, device, worker_args + extra)
        children.append(Child(name, f"{host}:{port}", subprocess.Popen(cmd, env=env)))
        return f"{host}:{port}"

    try:
        router_flags: list[str] = []
        if args.colocated:
            addrs = [start(f"colocated-{i}", "baton.decode_service", d, ["--colocated"])
                     for i, d in enumerate(devices_for(args.decode_devices or args.device, args.device, args.instances))]
            router_flags += ["--colocated", ",".join(addrs)]
        else:
            pre = [start(f"prefill-{i}", "baton.prefill_service", d, [])
                   for i, d in enumerate(devices_for(args.prefill_devices, args.device, args.prefill_instances))]
            dec = [start(f"decode-{i}", "baton.decode_service", d, [])
                   for i, d in enumerate(devices_for(args.decode_devices, args.device, args.decode_instances))]
            router_flags += ["--prefill", ",".join(pre), "--decode", ",".join(dec)]
        print(f"[baton] starting {len(children)} worker(s) on {args.model} ...", file=sys.stderr, flush=True)
        for c in children:
            wait_serving(c.address, c.proc, c.name, START_TIMEOUT_S)
        router_addr = f"{host}:{args.port}"
        cmd = [sys.executable, "-m", "baton.router", "--host", host, "--port", str(args.port), "--model", args.model,
               "--policy", args.policy, *router_flags]
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
