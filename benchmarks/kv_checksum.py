"""What proving a KV transfer costs (issue 51; engine/kv_proof.py, engine/runner/kv_checksum.py):
the checksum of one request's KV (qwen3-8b, 2,048 tokens: 288 MiB of bf16) timed where each side
computes it, next to the transfer it guards. The bar: <= 2 % of B3's transfer time at 288 MiB.

  prove          prefill: the checksum of the packed payload (one read of it), and its copy to
                 the host, as KVCache.prove queues it after the pack
  check_payload  decode: the landed payload's checksum where it lies on the cache's device
                 (direct, memory; grpc into a CPU engine)
  check_blocks   decode: the checksum of the blocks it was written into (nixl's in-place
                 payloads; grpc into a device's cache), gathered from a paged cache

  in the copy's pass (Platform.pack_kv / unpack_kv, what the engine runs): the pack with its sums,
                 weighed and copied to the host, against the same pack without; the unpack into
                 the blocks with its sums, weighed, against the same unpack without. The
                 differences are what the checksum adds (on CUDA one pass: the bytes are read once;
                 elsewhere a second read). Device-timed over back-to-back calls (events), medians
                 of --rounds.

Transfer references, same run: on the CPU the grpc backend between two processes on loopback
(baton.benchmarks.kv_loopback, as B3 runs it); on CUDA a raw copy of the payload to --peer-device
(the ceiling the direct backend reaches 0.82 of: docs/benchmarks.md), or within the device when
there is one GPU; plus any given with --transfer-ms (e.g. B3's p50 from `baton bench kv`). The
fractions are serialized upper bounds: the whole payload proven after the pack and checked after
the landing. With chunked prefill only the last piece's share is on the critical path.

  python -m baton.benchmarks.kv_checksum                          # CPU (and CUDA when present)
  python -m baton.benchmarks.kv_checksum --devices cuda:0 --peer-device cuda:1 --output kvsum.json
  python -m baton.benchmarks.kv_checksum --devices cuda:0 --b3 b3-direct.json   # B3's figures as references
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from baton.benchmarks.model_shape import DTYPE_BYTES, shape_of
from baton.engine.runner import kv_checksum

BAR = 0.02


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="baton.benchmarks.kv_checksum", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3-8b", help="whose KV layout sizes the payload")
    p.add_argument("--tokens", type=int, default=2048, help="the request's tokens (qwen3-8b bf16 2048: 288 MiB)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float8_e4m3fn"))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--devices", default=None, help="comma list (default: cpu, and cuda:0 when present)")
    p.add_argument("--peer-device", default=None, help="CUDA reference: copy to this device (default cuda:1 "
                   "when present, else within the device)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--no-grpc", action="store_true", help="CPU: skip the grpc loopback reference")
    p.add_argument("--transfer-ms", default="", help="more references: NAME=MS,... (e.g. direct=1.24)")
    p.add_argument("--b3", default=None, help="a `baton bench kv` record (direct backend): its p50, ready -> landed "
                   "p50 and pipelined time per transfer at --tokens become references")
    p.add_argument("--rounds", type=int, default=7, help="in-pass timings: rounds of --iters calls, median")
    p.add_argument("--output", default=None, help="JSON path")
    args = p.parse_args(argv)
    devices = args.devices.split(",") if args.devices else ["cpu"] + (["cuda:0"] if torch.cuda.is_available() else [])
    given = {k: float(v) / 1e3 for k, v in (kv.split("=") for kv in args.transfer_ms.split(",") if kv)}
    if args.b3:
        given.update(b3_references(args.b3, args.tokens))
    results = [measure(torch.device(d), args, given) for d in devices]
    out = {"model": args.model, "tokens": args.tokens, "dtype": args.dtype, "bar": BAR, "results": results}
    if args.output:
        with open(args.output, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def measure(device: torch.device, args, given: dict[str, float]) -> dict:
    shape = shape_of(args.model)
    dtype = getattr(torch, args.dtype)
    n = -(-args.tokens // args.block_size)
    rows = 2 * shape.layers
    # a paged cache twice the request, the request's blocks scattered in it, as a decode worker's
    cache = torch.empty(shape.layers, 2, 2 * n, args.block_size, shape.kv_heads,
                        shape.head_dim * DTYPE_BYTES[args.dtype], dtype=torch.uint8, device=device)
    cache.random_(0, 256)
    cache = cache.view(dtype)
    blocks = torch.randperm(2 * n)[:n].tolist()
    payload = cache.index_select(2, torch.tensor(blocks, device=device)).reshape(-1).view(torch.uint8)
    nbytes = payload.numel()
    _say(f"{device}: {args.model} {args.tokens} tokens {args.dtype}: {nbytes / 2**20:.0f} MiB in {n} blocks")
    timings = {
        "prove": _time(lambda: kv_checksum.partial(payload, rows, n).to("cpu", non_blocking=True), device, args.iters),
        "check_payload": _time(lambda: kv_checksum.of_payload(payload, rows, n), device, args.iters),
        "check_blocks": _time(lambda: kv_checksum.of_blocks(cache, blocks), device, args.iters)}
    sent = kv_checksum.to_hex(kv_checksum.partial(payload, rows, n))
    assert kv_checksum.to_hex(kv_checksum.of_blocks(cache, blocks)) == sent, "the two sides disagree"
    transfers = {**_references(payload, device, args), **given}
    seconds = {k: statistics.median(v) for k, v in timings.items()}
    for k, s in seconds.items():
        _say(f"{device}: {k:13s} {s * 1e3:8.3f} ms  ({nbytes / s / 1e9:6.1f} GB/s)")
    in_pass = measure_in_pass(cache, blocks, rows, device, args)
    added = in_pass["added_s"]
    for name, t in transfers.items():
        _say(f"{device}: vs {name} ({t * 1e3:.2f} ms): the checksum in the copies' pass adds {added * 1e3:.4f} ms = "
             f"{added / t:.2%} (bar {BAR:.0%}: {'met' if added / t <= BAR else 'NOT met'})")
    fractions = {}
    for name, t in transfers.items():
        both = {"payload": (seconds["prove"] + seconds["check_payload"]) / t,
                "blocks": (seconds["prove"] + seconds["check_blocks"]) / t}
        fractions[name] = both
        _say(f"{device}: vs {name} ({t * 1e3:.2f} ms, {nbytes / t / 1e9:.1f} GB/s): prove + check the payload "
             f"{both['payload']:.2%}, prove + check the blocks {both['blocks']:.2%} (bar {BAR:.0%}: "
             f"{'met' if max(both.values()) <= BAR else 'NOT met'}, serialized)")
    return {"device": str(device), "nbytes": nbytes, "num_blocks": n, "threads": torch.get_num_threads(),
            "seconds": seconds, "samples": timings, "transfer_seconds": transfers, "fraction_of_transfer": fractions,
            "in_pass": {**in_pass, "fraction_of_transfer": {k: added / t for k, t in transfers.items()}}}


def measure_in_pass(cache: torch.Tensor, blocks: list[int], rows: int, device: torch.device, args) -> dict:
    """What the engine runs (KVCache.pack / land): Platform.pack_kv and unpack_kv with and without
    the checksum; with it, its running total made first and copied to the host after, as the engine
    does (the total's zeros and the copies are what the checksum adds beside the kernels)."""
    from baton.engine.platforms import get_platform
    platform = get_platform(str(device))
    index = torch.tensor(blocks, device=device)
    into = torch.tensor(sorted(blocks), device=device)          # a decode worker's cache, other blocks
    dst = torch.empty_like(cache)
    data = platform.pack_kv(cache, index)

    def zeros():
        return torch.zeros(2, dtype=torch.int64, device=device)

    def pack_proven():
        total = zeros()
        platform.pack_kv(cache, index, total, 0)
        return total.to("cpu", non_blocking=True, copy=True)

    def unpack_checked():
        total = zeros()
        platform.unpack_kv(dst, into, data, total, 0)
        return total.to("cpu", non_blocking=True, copy=True)

    calls = {"index_select": lambda: cache.index_select(2, index), "pack": lambda: platform.pack_kv(cache, index),
             "pack_proven": pack_proven, "unpack": lambda: platform.unpack_kv(dst, into, data),
             "unpack_checked": unpack_checked}
    seconds = {k: statistics.median(_device_time(fn, device, args.iters) for _ in range(args.rounds))
               for k, fn in calls.items()}
    sent, landed = zeros(), zeros()
    platform.pack_kv(cache, index, sent, 0)
    platform.unpack_kv(dst, into, data, landed, 0)
    assert kv_checksum.to_hex(sent) == kv_checksum.to_hex(landed) \
        == kv_checksum.to_hex(kv_checksum.partial(data, rows, len(blocks))), "the paths disagree"
    for k, v in seconds.items():
        _say(f"{device}: in the pass: {k:15s} {v * 1e3:8.4f} ms  ({data.numel() / v / 1e9:6.1f} GB/s)")
    added = max(0.0, seconds["pack_proven"] - seconds["pack"]) + max(0.0, seconds["unpack_checked"] - seconds["unpack"])
    return {"platform": platform.name, "one_pass": platform.checksum_in_pass, "seconds": seconds, "added_s": added,
            "pack_vs_index_select": seconds["pack"] / seconds["index_select"]}


def _device_time(fn, device: torch.device, iters: int) -> float:
    """Seconds a call, back to back: device events around `iters` calls on a GPU (launches overlap the
    work, as the engine's queue does), the host's clock elsewhere."""
    fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def b3_references(path: str, tokens: int) -> dict[str, float]:
    """From a `baton bench kv` record: the direct backend's transfer at `tokens`, three ways."""
    with open(path) as f:
        rec = json.load(f)
    rows = [t for t in rec["results"]["transfers"] if t.get("tokens") == tokens]
    if not rows:
        raise ValueError(f"{path} has no transfer of {tokens} tokens: run `baton bench kv --tokens {tokens}`")
    t = rows[0]
    out = {f"B3 {t['backend']} p50": t["latency_s"]["p50"],
           f"B3 {t['backend']} ready -> landed p50": t["from_ready"]["latency_s"]["p50"]}
    pipe = t.get("pipelined")
    if pipe:
        out[f"B3 {t['backend']} pipelined, per transfer"] = pipe["seconds"] / pipe["transfers_in_flight"]
    return out


def _references(payload: torch.Tensor, device: torch.device, args) -> dict[str, float]:
    if device.type == "cpu":
        if args.no_grpc:
            return {}
        from baton.benchmarks.kv_loopback import measure_grpc_loopback
        _say("cpu: the grpc loopback reference (two processes on 127.0.0.1) ...")
        return {"grpc loopback": measure_grpc_loopback(payload.numel(), repeats=3, baseline=False)["latency_ms"] / 1e3}
    if device.type != "cuda":
        return {}
    peer = args.peer_device or ("cuda:1" if torch.cuda.device_count() > 1 else str(device))
    dst = torch.empty_like(payload, device=peer)
    name = f"raw copy {device} -> {peer}"
    return {name: statistics.median(_time(lambda: dst.copy_(payload), device, args.iters, also=dst.device))}


def _time(fn, device: torch.device, iters: int, also: torch.device | None = None) -> list[float]:
    def sync():
        for d in {device, also or device}:
            if d.type == "cuda":
                torch.cuda.synchronize(d)
    fn()
    sync()
    seconds = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        seconds.append(time.perf_counter() - t0)
    return seconds


def _say(line: str) -> None:
    print(f"[bench] kvsum: {line}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
