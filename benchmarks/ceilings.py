"""Device ceilings, measured in the same run as the benchmark they normalise.

On an accelerator: a large device-to-device copy (bandwidth counting bytes read + written)
and a large bf16 matmul (FLOP/s); between two devices a raw peer copy (bytes moved / s).
On the CPU: a memcpy (read + written) and an fp32 matmul, so CPU runs have a roofline too.
Each figure is the best of a few timed repetitions after a warm-up: a ceiling, not a mean.
"""
from __future__ import annotations

import sys
import time

import torch

SIZES = {  # (copy bytes, matmul n) per device kind and mode
    ("cpu", False): (256 << 20, 2048),
    ("cpu", True): (32 << 20, 512),
    ("accel", False): (1 << 30, 8192),
    ("accel", True): (256 << 20, 4096),
}


def _device(spec: str) -> torch.device:
    dev = torch.device(spec)
    if dev.type == "cuda" and not torch.cuda.is_available():         # a ValueError: one line, no traceback
        raise ValueError(f"device {spec!r} asked for, but torch sees no CUDA GPU; use --device cpu")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {spec!r} asked for, but torch sees {torch.cuda.device_count()} CUDA GPU(s)")
    if dev.type == "npu":
        import torch_npu  # noqa: F401  (registers the npu device with torch)
    return dev


def synchronize(dev: torch.device) -> None:
    if dev.type != "cpu":
        getattr(torch, dev.type).synchronize(dev)


def _best_seconds(fn, devices: list[torch.device], reps: int) -> float:
    fn()                                     # warm-up: allocation, kernel selection
    for d in devices:
        synchronize(d)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        for d in devices:
            synchronize(d)
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth(device: str, nbytes: int, reps: int = 5) -> dict:
    dev = _device(device)
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev).fill_(1)
    dst = torch.empty_like(src)
    t = _best_seconds(lambda: dst.copy_(src), [dev], reps)
    return {"bytes_per_s": 2 * nbytes / t, "size_bytes": nbytes, "best_seconds": t,
            "method": "tensor copy on one device; bytes read + written"}


def matmul_rate(device: str, n: int, dtype: torch.dtype, reps: int = 3) -> dict:
    dev = _device(device)
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    t = _best_seconds(lambda: torch.mm(a, b), [dev], reps)
    return {"flops_per_s": 2 * n ** 3 / t, "shape": [n, n, n], "dtype": str(dtype).removeprefix("torch."),
            "best_seconds": t}


def fp8_matmul_rate(device: str, n: int, reps: int = 3, fast_accum: bool = False) -> dict:
    """A scaled e4m3 GEMM with row-wise scales, as FP8 weights run (models/layers/quantization.py), with
    the engine's accumulation (--fp8-accumulation)."""
    dev = _device(device)
    a = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn)
    sa, sb = torch.ones(n, 1, device=dev), torch.ones(1, n, device=dev)
    t = _best_seconds(lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                               use_fast_accum=fast_accum), [dev], reps)
    return {"flops_per_s": 2 * n ** 3 / t, "shape": [n, n, n], "dtype": "float8_e4m3fn (row-wise scaled)",
            "fast_accum": fast_accum, "best_seconds": t}


def peer_copy_bandwidth(src_device: str, dst_device: str, nbytes: int, reps: int = 5) -> dict:
    src_dev, dst_dev = _device(src_device), _device(dst_device)
    src = torch.empty(nbytes, dtype=torch.uint8, device=src_dev).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev)
    t = _best_seconds(lambda: dst.copy_(src), [src_dev, dst_dev], reps)
    out = {"bytes_per_s": nbytes / t, "size_bytes": nbytes, "best_seconds": t, "src": src_device,
           "dst": dst_device, "method": "tensor copy between devices; bytes moved"}
    if src_dev.type == dst_dev.type == "cuda":
        out["peer_access"] = torch.cuda.can_device_access_peer(src_dev.index or 0, dst_dev.index or 0)
    return out


def measure(device: str, matmul_dtype: torch.dtype | None = None, peer_device: str | None = None,
            quick: bool = False, fp8: bool = False, fp8_fast_accum: bool = False) -> dict:
    """All ceilings of `device` (and of its link to `peer_device`, when another device)."""
    dev = _device(device)
    kind = "cpu" if dev.type == "cpu" else "accel"
    nbytes, n = SIZES[(kind, quick)]
    dtype = matmul_dtype or (torch.float32 if kind == "cpu" else torch.bfloat16)
    print(f"[bench] measuring ceilings of {device} ...", file=sys.stderr, flush=True)
    out = {"device": device, "copy": copy_bandwidth(device, nbytes), "matmul": matmul_rate(device, n, dtype),
           "peer_copy": None}
    if fp8 and dev.type == "cuda":
        out["matmul_fp8"] = fp8_matmul_rate(device, n, fast_accum=fp8_fast_accum)
    if dev.type == "cpu":
        out["threads"] = torch.get_num_threads()
    if peer_device and peer_device != device and dev.type != "cpu":
        out["peer_copy"] = peer_copy_bandwidth(device, peer_device, nbytes)
    if dev.type != "cpu":          # hand the buffers back: the engine sizes its KV cache from free memory
        getattr(torch, dev.type).empty_cache()
    return out
