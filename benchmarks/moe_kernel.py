"""Device script for the fused MoE experts (engine/platforms/triton_kernels/moe.py): times the
whole expert step (alignment + both grouped GEMMs + the k-sum) on Qwen3-30B-A3B's shapes against
its floor, for the default tiles and a few alternatives. Needs a CUDA GPU and triton:

    PYTHONUNBUFFERED=1 python3 -m baton.benchmarks.moe_kernel --out "$OUT"

floor = max(weight bytes of the distinct experts the routing hits (+ activations) / copy
bandwidth, 2 * T * k * 3 * H * INTER / bf16 matmul rate), both ceilings measured here. Calls rotate
over several layers' weights (> the L2), routed uniformly at random, and replay from a CUDA graph.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

E, K, H, INTER = 128, 8, 2048, 768          # Qwen3-30B-A3B's experts
TOKENS = (1, 8, 64, 256, 2048, 8192)
LAYERS = 4                               # 4 x 1.2 GB of experts: far past the L2


def candidates(tokens: int):
    from baton.engine.platforms.triton_kernels.moe import MoeTiles, pick_tiles
    default = pick_tiles(tokens * K, E, H, INTER, torch.bfloat16)
    extra = {1: [MoeTiles(16, 64, 128, 4, 4), MoeTiles(16, 32, 128, 4, 5), MoeTiles(16, 64, 256, 8, 3),
                 MoeTiles(16, 16, 256, 4, 4)],
             8: [MoeTiles(16, 64, 128, 4, 4), MoeTiles(16, 32, 128, 4, 5)],
             64: [MoeTiles(16, 64, 128, 4, 4), MoeTiles(16, 64, 256, 8, 3), MoeTiles(16, 32, 128, 4, 5)],
             256: [MoeTiles(16, 64, 128, 4, 4), MoeTiles(32, 64, 64, 4, 4), MoeTiles(32, 128, 64, 4, 3)],
             2048: [MoeTiles(64, 128, 64, 8, 3), MoeTiles(128, 128, 64, 8, 3), MoeTiles(128, 128, 64, 8, 4)],
             8192: [MoeTiles(64, 128, 64, 8, 4), MoeTiles(128, 128, 64, 8, 4), MoeTiles(128, 128, 32, 8, 5)]}
    return [default] + [t for t in extra.get(tokens, []) if t != default]


def event_ms(fn, reps: int = 20) -> float:
    from baton.benchmarks.kernels_cuda import event_seconds
    return event_seconds(fn, reps) * 1e3


def ceilings() -> tuple[float, float]:
    src = torch.randn(1 << 28, device="cuda")                                  # 1 GiB
    dst = torch.empty_like(src)
    ms = event_ms(lambda: dst.copy_(src))
    copy = 2 * src.numel() * 4 / (ms / 1e3)
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = event_ms(lambda: a @ b)
    return copy, 2 * 8192 ** 3 / (ms / 1e3)


def graph_ms(calls, reps: int = 20) -> float:
    """Median time of one call from replays of a graph of all calls in turn."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    return event_ms(graph.replay, reps) / len(calls)


def bench_tokens(tokens: int, layers, copy_bw: float, rate: float) -> list[dict]:
    from baton.engine.platforms.base import LayerOps
    from baton.engine.platforms.triton_kernels.moe import fused_experts
    g = torch.Generator(device="cuda").manual_seed(tokens)
    inputs = []
    for w13, w2 in layers:
        x = torch.randn(tokens, H, device="cuda", generator=g).to(torch.bfloat16)
        ids, weights = LayerOps().moe_route(torch.randn(tokens, E, device="cuda", generator=g), K, True)
        inputs.append((x, w13, w2, ids, weights.to(torch.bfloat16)))
    hit = statistics.mean(len(torch.unique(ids)) for _, _, _, ids, _ in inputs)
    bytes_ = hit * 3 * H * INTER * 2 + 2 * tokens * H * 2
    floor = max(bytes_ / copy_bw, 2 * tokens * K * 3 * H * INTER / rate)
    x, w13, w2, ids, weights = inputs[0]
    ref = LayerOps().moe_experts(x.double(), w13.double(), w2.double(), ids, weights.double())
    rows = []
    for tiles in candidates(tokens):
        try:
            out = fused_experts(x, w13, w2, ids, weights, tiles)
        except Exception as e:      # noqa: BLE001  (a config over the shared memory: note it, go on)
            print(f"[moe] T={tokens} tiles={tiles}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            continue
        err = ((out.double() - ref).norm() / ref.norm()).item()
        ms = graph_ms([lambda a=a, t=tiles: fused_experts(*a, tiles=t) for a in inputs])
        rows.append(dict(tokens=tokens, tiles=list(dataclasses.astuple(tiles)), ms=ms, floor_ms=floor * 1e3, of_floor=floor * 1e3 / ms, experts_hit=hit,
                         weight_gb_per_s=hit * 3 * H * INTER * 2 / (ms / 1e3) / 1e9, rel_err=err))
        print(f"[moe] T={tokens:5d} tiles={rows[-1]['tiles']} {ms * 1e3:8.1f} us  floor {floor * 1e6:7.1f} us "
              f"({rows[-1]['of_floor']:.2f})  hit {hit:.1f}  err {err:.1e}", file=sys.stderr, flush=True)
    if tokens <= 64:                       # the base path, eager (host-synced), for scale
        ms = event_ms(lambda: LayerOps().moe_experts(x, w13, w2, ids, weights), 5)
        rows.append(dict(tokens=tokens, tiles="base-eager", ms=ms, floor_ms=floor * 1e3, of_floor=floor * 1e3 / ms))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    args = p.parse_args()
    copy_bw, rate = ceilings()
    print(f"[moe] copy {copy_bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s", file=sys.stderr)
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = [((torch.randn(E, 2 * INTER, H, device="cuda", generator=g) * 0.02).to(torch.bfloat16),
               (torch.randn(E, H, INTER, device="cuda", generator=g) * 0.02).to(torch.bfloat16)) for _ in range(LAYERS)]
    rows = []
    for t in map(int, args.tokens.split(",")):
        rows += bench_tokens(t, layers, copy_bw, rate)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "moe_kernel.json").write_text(json.dumps(
        dict(copy_bytes_per_s=copy_bw, matmul_flops_per_s=rate, shape=dict(E=E, k=K, H=H, INTER=INTER), rows=rows), indent=1))
    print(f"{'T':>5} {'tiles':<22} {'us':>9} {'floor us':>9} {'of floor':>8}")
    for r in rows:
        print(f"{r['tokens']:5d} {str(r['tiles']):<22} {r['ms'] * 1e3:9.1f} {r['floor_ms'] * 1e3:9.1f} "
              f"{r['of_floor']:8.2f}")


if __name__ == "__main__":
    main()
