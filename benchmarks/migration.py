"""The migration scenario on real devices: a decode worker SIGKILLed under running streams.

    python -m baton.benchmarks.migration --model qwen3-0.6b --devices cuda:0,cuda:1 \\
        --kv-backend direct --streams 24 --max-tokens 256 --output migration.json

Starts 2 prefill + 2 decode workers (one of each per device of the pool) and a router, runs
the streams once without a fault (the reference tokens), then again, SIGKILLing one decode
worker once every stream has `--kill-after` tokens. Reports completed / identical to the
fault-free run / migrated / lost, and the stall the clients saw: each stream's longest gap
between two chunks, against the same figure in the fault-free run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

from baton.benchmarks import deployment
from baton.kvtransfer.registry import CROSS_PROCESS_BACKENDS
from baton.v1 import router_pb2, router_pb2_grpc


async def stream(stub, i: int, args, progress: list[int], tag: str) -> dict:
    req = router_pb2.GenerateRequest(
        request_id=f"{tag}-s{i}", text=f"Story {i}: once upon a time, in a land far away,",
        sampling=router_pb2.SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True))
    ids, gaps, t0 = [], [], time.perf_counter()
    last = t0
    try:
        async for r in stub.Generate(req, timeout=600):
            now = time.perf_counter()
            if ids:
                gaps.append(now - last)
            ids += r.token_ids
            last = now
            progress[i] = len(ids)
        status = "OK"
    except grpc.aio.AioRpcError as exc:
        status = exc.code().name
        print(f"[migration] stream {i}: {status}: {exc.details()}", file=sys.stderr, flush=True)
    return {"ids": ids, "status": status, "max_gap_s": max(gaps, default=0.0), "seconds": time.perf_counter() - t0}


async def run(address: str, args, tag: str, kill=None) -> tuple[list[dict], dict]:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        progress = [0] * args.streams
        tasks = [asyncio.ensure_future(stream(stub, i, args, progress, tag)) for i in range(args.streams)]
        info = {}
        if kill is not None:
            while min(progress) < args.kill_after and not all(t.done() for t in tasks):
                await asyncio.sleep(0.005)
            info["killed_at_tokens"] = min(progress)
            info["killed_at_s"] = time.time()
            kill()
        return list(await asyncio.gather(*tasks)), info


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--devices", default="cpu", help="comma list: the device pool (one prefill + decode per device)")
    p.add_argument("--kv-backend", default="grpc", choices=CROSS_PROCESS_BACKENDS)
    p.add_argument("--streams", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--kill-after", type=int, default=32, help="kill once every stream has this many tokens")
    p.add_argument("--worker-args", default="", help="more worker flags")
    p.add_argument("--output", default="migration.json")
    p.add_argument("--log-dir", help="where the processes' logs go (default: a new temporary directory)")
    args = p.parse_args(argv)
    devices = args.devices.split(",")
    pool = devices + devices            # 2p2d hands these out in order: a prefill and a decode on each
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="baton-migration-"))
    worker_args = ["--kv-backend", args.kv_backend, *shlex.split(args.worker_args)]
    dep = deployment.launch("2p2d", args.model, pool, worker_args, log_dir, router_args=["--policy", "round_robin"])
    try:
        t = time.perf_counter()
        reference, _ = asyncio.run(run(dep.router_address, args, "clean"))
        clean_s = time.perf_counter() - t
        again, _ = asyncio.run(run(dep.router_address, args, "again"))    # run-to-run noise, no fault
        victim = next(c for c in dep.children if c.name.startswith("decode"))
        t = time.perf_counter()
        faulty, info = asyncio.run(run(dep.router_address, args, "fault",
                                       kill=lambda: victim.proc.send_signal(signal.SIGKILL)))
        fault_s = time.perf_counter() - t
    finally:
        dep.stop()
    same = sum(f["status"] == "OK" and f["ids"] == r["ids"] for f, r in zip(faulty, reference, strict=True))
    router_log = (log_dir / "router.log").read_text(errors="replace")
    moved = [line for line in router_log.splitlines() if "migrating" in line]
    migrated = {i for i in range(args.streams) if any(f"request fault-s{i}:" in line for line in moved)}
    same_migrated = sum(faulty[i]["ids"] == reference[i]["ids"] for i in migrated)
    run_to_run = sum(a["ids"] == r["ids"] for a, r in zip(again, reference, strict=True))
    prefix_kept = sum(f["ids"][:info.get("killed_at_tokens") or 0] == r["ids"][:info.get("killed_at_tokens") or 0]
                      for f, r in zip(faulty, reference, strict=True))
    gaps = sorted(f["max_gap_s"] for f in faulty)
    clean_gaps = sorted(r["max_gap_s"] for r in reference)
    result = {
        "model": args.model, "devices": devices, "kv_backend": args.kv_backend, "streams": args.streams,
        "max_tokens": args.max_tokens, "killed": victim.name, "killed_at_tokens": info.get("killed_at_tokens"),
        "completed": sum(f["status"] == "OK" for f in faulty), "identical_to_fault_free": same,
        "migrated": len(migrated), "migrated_identical": same_migrated,
        "fault_free_run_to_run_identical": run_to_run, "identical_before_the_kill": prefix_kept,
        "lost_or_failed": sum(f["status"] != "OK" for f in faulty),
        "statuses": sorted({f["status"] for f in faulty}),
        "stall_s": {"max": gaps[-1], "median_of_stream_max": statistics.median(gaps)},
        "fault_free_longest_gap_s": {"max": clean_gaps[-1], "median_of_stream_max": statistics.median(clean_gaps)},
        "wall_s": {"fault_free": round(clean_s, 2), "with_kill": round(fault_s, 2)}, "logs": str(log_dir),
    }
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    sys.exit(0 if same == args.streams else 1)


if __name__ == "__main__":
    main()
