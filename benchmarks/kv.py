"""B3 — KV transfer (`baton bench kv`): for each backend and request size (tokens of a given
model's KV, rounded up to whole blocks), latency p50/p99 and effective bandwidth, as a
fraction of a reference measured in the same run: a plain loopback socket copy for the
grpc backend, the raw peer copy between the two devices for device-direct backends.

Backends are pluggable (BACKENDS); `grpc` pushes between two processes on 127.0.0.1
through baton.benchmarks.kv_loopback, on one warm connection, exactly as a prefill worker does;
`direct` and `nixl` go between two processes on --device and --peer-device, measured alike
(--peer-device may equal --device: two processes on one GPU). `nixl` writes straight into the
receiver's paged KV cache (of --model's layout), as into a decode worker's pages; `nixl-staged`
is its fallback, a buffer registered per transfer (the decode engine's copy into the blocks
then comes after the landing, not timed here).
"""
from __future__ import annotations

import argparse
import math
import sys

from baton.benchmarks import ceilings, record
from baton.benchmarks.model_shape import DTYPE_BYTES, ModelShape, shape_of
from baton.benchmarks.stats import percentile
from baton.engine.config import DEFAULT_MODEL

FULL = dict(model="qwen3-0.6b", tokens="512,2048,8192,32768", iters=10)
SMOKE = dict(model=DEFAULT_MODEL, tokens="16,128", iters=3)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="whose KV shape sizes the payloads (default qwen3-0.6b; "
                   f"smoke: {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="bfloat16", choices=tuple(DTYPE_BYTES), help="KV cache dtype")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="as the workers' flag: fp8 sizes the payloads as a float8 e4m3 cache (--dtype float8_e4m3fn)")
    p.add_argument("--block-size", type=int, default=16, help="payloads are whole KV blocks")
    p.add_argument("--tokens", default=None, help="comma list of request sizes in tokens "
                   "(default 512,2048,8192,32768; smoke 16,128)")
    p.add_argument("--backends", default="grpc", help=f"comma list of {', '.join(BACKENDS)}")
    p.add_argument("--iters", type=int, default=None, help="timed transfers per size (default 10; smoke 3)")
    p.add_argument("--chunk-bytes", type=int, default=None, help="grpc chunk size (default: the backend's)")
    p.add_argument("--window-bytes", type=int, default=None, help="grpc credit window (default: the backend's)")
    p.add_argument("--device", default="cpu", help="device whose ceilings are recorded (device backends: the "
                   "sending device)")
    p.add_argument("--peer-device", default=None, help="receiving device of device-direct backends")
    p.add_argument("--prefill-chunk-tokens", type=int, default=4096, help="device-direct backends: the "
                   "prefill chunk the streamed measure sends a piece after (the engine's default budget)")


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    for k, v in (SMOKE if args.smoke else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    try:
        args.token_sizes = [int(t) for t in str(args.tokens).split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"bad --tokens {args.tokens!r}: use a comma list of integers") from None
    if not args.token_sizes or min(args.token_sizes) < 1:
        raise ValueError("--tokens needs at least one size >= 1")
    if args.iters < 1:
        raise ValueError(f"--iters must be >= 1, got {args.iters}")
    args.backend_names = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in args.backend_names if b not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown KV backend(s) {unknown}: available {', '.join(BACKENDS)} "
                         "(device-direct backends plug in here as they land)")
    return args


def payload_bytes(shape: ModelShape, tokens: int, dtype: str, block_size: int) -> tuple[int, int]:
    """(bytes, tokens rounded up to whole blocks) of one request's KV: layers x (K, V) x kv
    heads x head_dim x dtype per token, as kvtransfer's layout packs it."""
    padded = math.ceil(tokens / block_size) * block_size
    return padded * shape.kv_bytes_per_token(DTYPE_BYTES[dtype]), padded


# -- backends ------------------------------------------------------------------------------------
class GrpcLoopback:
    """The portable backend between two local processes, next to a TCP socket copy."""

    name = "grpc"
    reference = "plain TCP socket copy on 127.0.0.1 between two processes (same bytes, same run)"

    def __init__(self, args: argparse.Namespace):
        from baton.kvtransfer import grpc_options
        self.chunk = args.chunk_bytes or grpc_options.DEFAULT_CHUNK_BYTES
        self.window = args.window_bytes or grpc_options.DEFAULT_WINDOW_BYTES

    def measure(self, nbytes: int, iters: int) -> dict:
        # timed sends on one connection warmed by the layout handshake, as a prefill worker keeps it
        seconds, r = self._grpc(nbytes, iters)
        if seconds:
            latency = {"p50": percentile(seconds, 50), "p99": percentile(seconds, 99), "best": min(seconds),
                       "samples": list(seconds)}
        else:
            latency = {"p50": r["latency_ms"] / 1e3, "p99": None, "best": r["best_latency_ms"] / 1e3,
                       "samples": None}
        ref_bw = r["tcp_gbps"] * 1e9
        bw = nbytes / latency["p50"]
        return {"latency_s": latency, "bandwidth_bytes_per_s": bw,
                "reference": {"name": self.reference, "bandwidth_bytes_per_s": ref_bw,
                              "latency_s": r["tcp_latency_ms"] / 1e3},
                "fraction_of_reference": bw / ref_bw,
                "backend_config": {"chunk_bytes": self.chunk, "window_bytes": self.window},
                "cpu_seconds_per_gb": {"sender": r.get("sender_cpu_s_per_gb"),
                                       "receiver": r.get("receiver_cpu_s_per_gb")},
                # the prefill worker packs and pushes a request's KV after its prefill ends
                "overlap_with_prefill": {"streams_during_prefill": False, "hidden_fraction": 0.0}}

    def _grpc(self, nbytes: int, iters: int) -> tuple[list[float] | None, dict]:
        """(every send's seconds, baton.benchmarks.kv_loopback's summary with the TCP baseline)."""
        from baton.benchmarks.kv_loopback import measure_grpc_loopback
        r = measure_grpc_loopback(nbytes, self.chunk, self.window, repeats=iters, baseline=True)
        return r.get("seconds"), r       # without per-send seconds only the median and best are known


class DirectDevices:
    """The device-direct backend from --device to --peer-device (NCCL between GPUs, gloo on
    the CPU), next to a raw copy of the same bytes between the same two devices."""

    name = "direct"
    backend = "direct"                  # the registry's name
    model_layout = False                # payloads are whole blocks of the model's KV layout
    in_place = False                    # ... and the receiver holds a paged KV cache of it

    def __init__(self, args: argparse.Namespace):
        self.src = args.device
        self.dst = args.peer_device or args.device
        self.shape = shape_of(args.model)
        self.token_bytes = self.shape.kv_bytes_per_token(DTYPE_BYTES[args.dtype])
        self.chunk_tokens = args.prefill_chunk_tokens
        self.stand_in_prefill = not args.smoke      # seconds of CPU matmuls: left out of the smoke run
        self.reference = (f"raw tensor copy {self.src} -> {self.dst} (peer copy between devices; "
                          "same bytes, same run)")
        self.layout = dict(model=self.shape.name, architecture=self.shape.architecture, dtype=args.dtype,
                           block_size=args.block_size, num_layers=self.shape.layers,
                           num_kv_heads=self.shape.kv_heads, head_dim=self.shape.head_dim) if self.model_layout else None

    def measure(self, nbytes: int, iters: int) -> dict:
        from baton.benchmarks.kv_loopback import measure_direct
        tokens = nbytes // self.token_bytes
        # the prefill making this KV: 2 FLOPs per weight per token (attention's share left out)
        r = measure_direct(nbytes, self.src, self.dst, repeats=iters, overlap=self.stand_in_prefill,
                           prefill_flops=2.0 * self.shape.params * tokens,
                           chunks=max(1, math.ceil(tokens / self.chunk_tokens)), backend=self.backend,
                           layout=self.layout, in_place=self.in_place)
        ref = ceilings.peer_copy_bandwidth(self.src, self.dst, nbytes)
        latency = {"p50": percentile(r["seconds"], 50), "p99": percentile(r["seconds"], 99), "best": r["best_s"],
                   "samples": r["seconds"]}
        bw = nbytes / latency["p50"]
        ov, st, pipe, ready = r.get("overlap"), r.get("streamed"), r["pipelined"], r["from_ready"]["seconds"]
        steady = r["sustained"]
        ref_bw = ref["bytes_per_s"]
        return {"latency_s": latency, "bandwidth_bytes_per_s": bw,
                "reference": {"name": self.reference, "bandwidth_bytes_per_s": ref_bw,
                              "latency_s": ref["best_seconds"]},
                "fraction_of_reference": bw / ref_bw,
                # opened ahead (as at prefill start): KV ready -> landed, what is left after the prefill
                "from_ready": {"latency_s": {"p50": percentile(ready, 50), "p99": percentile(ready, 99),
                                             "samples": ready},
                               "fraction_of_reference": nbytes / percentile(ready, 50) / ref_bw},
                # a burst of transfers at once on the pair: control overlaps bytes
                "pipelined": {**pipe, "fraction_of_reference": pipe["bytes_per_s"] / ref_bw},
                # the pair's bandwidth under steady load: many transfers through a window
                "sustained": {**steady, "fraction_of_reference": steady["bytes_per_s"] / ref_bw},
                "backend_config": {"collective": r["collective"], "communicator": r["communicator"],
                                   "src": self.src, "dst": self.dst,
                                   "processes": r["processes"], "landed_in_place": r["landed_in_place"]},
                "overlap_with_prefill": {"streams_during_prefill": True,
                                         "per": f"prefill chunk of {self.chunk_tokens} tokens",
                                         "hidden_fraction": st["hidden_fraction"] if st else None,
                                         "streamed": st, "beside_unrelated_compute": ov}}


class NixlDevices(DirectDevices):
    """The nixl backend from --device to --peer-device (NIXL over UCX: shared memory or CMA on
    the CPU, CUDA IPC between GPUs), measured as the direct one, next to the same raw copy:
    straight into the receiver's KV cache pages."""

    name = backend = "nixl"
    model_layout = in_place = True


class NixlStaged(NixlDevices):
    """The nixl backend's fallback: into a buffer the receiver registers per transfer."""

    name = "nixl-staged"
    in_place = False


BACKENDS = {"grpc": GrpcLoopback, "direct": DirectDevices, "nixl": NixlDevices, "nixl-staged": NixlStaged}


# -- the run -------------------------------------------------------------------------------------
def run(args: argparse.Namespace, rec: dict) -> None:
    if args.kv_cache_dtype == "fp8":
        args.dtype = "float8_e4m3fn"
    shape = shape_of(args.model)
    rec["model"] = shape.to_json()
    rec["dtype"] = args.dtype
    devices = [args.device] + ([args.peer_device] if args.peer_device else [])
    rec["device"] = record.device_info(devices)
    rec["ceilings"] = ceilings.measure(args.device, peer_device=args.peer_device, quick=args.smoke)
    rows = []
    for name in args.backend_names:
        backend = BACKENDS[name](args)
        for tokens in args.token_sizes:
            nbytes, padded = payload_bytes(shape, tokens, args.dtype, args.block_size)
            print(f"[bench] kv {name}: {tokens} tokens = {nbytes / (1 << 20):.1f} MiB x {args.iters} ...",
                  file=sys.stderr, flush=True)
            row = {"backend": name, "tokens": tokens, "tokens_in_blocks": padded, "bytes": nbytes,
                   "iters": args.iters, **backend.measure(nbytes, args.iters)}
            rows.append(row)
            _print_row(row)
    rec["results"] = {"kv_bytes_per_token": shape.kv_bytes_per_token(DTYPE_BYTES[args.dtype]),
                      "block_size": args.block_size, "transfers": rows}


def _print_row(r: dict) -> None:
    lat = r["latency_s"]
    p99 = "-" if lat["p99"] is None else f"{lat['p99'] * 1e3:.1f}"
    print(f"[bench] kv {r['backend']} {r['tokens']} tokens ({r['bytes'] / (1 << 20):.1f} MiB): p50 "
          f"{lat['p50'] * 1e3:.1f} ms p99 {p99} ms, {r['bandwidth_bytes_per_s'] / 1e9:.3f} GB/s = "
          f"{r['fraction_of_reference']:.2f} of the reference", file=sys.stderr, flush=True)
    ready = r.get("from_ready")
    if ready:
        print(f"[bench]   opened ahead, KV ready -> landed: p50 {ready['latency_s']['p50'] * 1e3:.2f} ms = "
              f"{ready['fraction_of_reference']:.2f} of the reference", file=sys.stderr, flush=True)
    pipe = r.get("pipelined")
    if pipe:
        print(f"[bench]   {pipe['transfers_in_flight']} at once: {pipe['bytes_per_s'] / 1e9:.3f} GB/s = "
              f"{pipe['fraction_of_reference']:.2f} of the reference", file=sys.stderr, flush=True)
    steady = r.get("sustained")
    if steady:
        print(f"[bench]   sustained, {steady['transfers']} through a window of {steady['window']}: "
              f"{steady['bytes_per_s'] / 1e9:.3f} GB/s = {steady['fraction_of_reference']:.2f} of the reference",
              file=sys.stderr, flush=True)
    st = (r.get("overlap_with_prefill") or {}).get("streamed")
    if st:
        print(f"[bench]   streamed over {st['chunks']} prefill chunk(s) of {st['prefill_alone_s'] * 1e3:.1f} ms in "
              f"all: {st['exposed_s'] * 1e3:.2f} ms exposed after the prefill, {st['hidden_fraction']:.2f} of the "
              "transfer hidden", file=sys.stderr, flush=True)
