"""Device script for the fused MoE experts (engine/platforms/triton_kernels/moe.py): times the
whole expert step (alignment + both grouped GEMMs + the k-sum) on Qwen3-30B-A3B's shapes against
its floor, for the default tiles and a few alternatives. Needs a CUDA GPU and triton:

    PYTHONUNBUFFERED=1 python3 -m baton.benchmarks.moe_kernel --out "$OUT"
    PYTHONUNBUFFERED=1 python3 -m baton.benchmarks.moe_kernel --fp8 --out "$OUT"    # bf16 vs e4m3 experts

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
TOKENS = (1, 8, 64, 256, 2048, 8192, 16384)
LAYERS = 4                               # 4 x 1.2 GB of experts: far past the L2


# pick_tiles before the w2 tiles (2026-11-25, commit 79f9583): the "before" of a before/after
PREVIOUS = ((4, (16, 32, 128, 4, 5)), (24, (32, 64, 128, 4, 3)), (96, (64, 64, 64, 4, 3)), (None, (128, 128, 64, 8, 3)))


def previous_tiles(tokens: int):
    from baton.engine.platforms.triton_kernels.moe import MoeTiles
    per_expert = tokens * K / E
    return next(MoeTiles(*t) for bound, t in PREVIOUS if bound is None or per_expert <= bound)


def candidates(tokens: int) -> list[tuple]:
    """(label, tiles, alignment) per config: "now" is moe.align as it is; "previous" is the previous
    code's alignment (one Triton program up to 1024 pairs, moe_align.align_by_expert above)."""
    from baton.engine.platforms.triton_kernels.moe import MoeTiles, pick_tiles
    default = pick_tiles(tokens * K, E, H, INTER, torch.bfloat16)
    prev = previous_tiles(tokens)
    out = [("default", default, "now"), ("previous", prev, "previous"), ("prev-tiles", prev, "now")]
    extra = {1: [MoeTiles(16, 64, 128, 4, 4)],
             8: [MoeTiles(16, 64, 128, 4, 4)],
             64: [MoeTiles(16, 64, 128, 4, 4)],
             8192: [MoeTiles(128, 128, 64, 8, 3, 256, 64, 8, 4)],
             16384: [MoeTiles(128, 128, 64, 8, 3, 256, 64, 8, 4)]}
    out += [("alt", t, "now") for t in extra.get(tokens, [])]
    return [c for i, c in enumerate(out) if c[1:] not in [d[1:] for d in out[:i]]]


def previous_align(ids, num_experts: int, block_m: int):
    """The alignment of the previous code (commit 79f9583)."""
    from baton.engine.platforms.triton_kernels.moe import _align_one_program
    from baton.engine.platforms.triton_kernels.moe_align import align_by_expert
    if ids.numel() > 1024:
        return align_by_expert(ids, num_experts, block_m)
    return _align_one_program(ids, num_experts, block_m)


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
    from baton.benchmarks.kernels_cuda import graph_seconds_per_call
    return graph_seconds_per_call(calls, reps) * 1e3


def make_inputs(tokens: int, layers, copy_bw: float, rate: float):
    """One routed batch per layer (x, w13, w2, ids, weights), the experts hit and the floor (s)."""
    from baton.engine.platforms.base import LayerOps
    g = torch.Generator(device="cuda").manual_seed(tokens)
    inputs = []
    for w13, w2 in layers:
        x = torch.randn(tokens, H, device="cuda", generator=g).to(torch.bfloat16)
        ids, weights = LayerOps().moe_route(torch.randn(tokens, E, device="cuda", generator=g), K, True)
        inputs.append((x, w13, w2, ids, weights.to(torch.bfloat16)))
    hit = statistics.mean(len(torch.unique(ids)) for _, _, _, ids, _ in inputs)
    bytes_ = hit * 3 * H * INTER * 2 + 2 * tokens * H * 2
    return inputs, hit, max(bytes_ / copy_bw, 2 * tokens * K * 3 * H * INTER / rate)


def _step(args, tiles, alignment: str):
    from baton.engine.platforms.triton_kernels import moe
    if alignment == "now":
        return moe.fused_experts(*args, tiles=tiles)
    now, moe.align = moe.align, previous_align
    try:
        return moe.fused_experts(*args, tiles=tiles)
    finally:
        moe.align = now


def time_steps(tokens: int, inputs, configs, rounds: int = 2) -> list[tuple]:
    """(label, tiles, alignment, [ms per round], rel_err) of the whole step per config, rounds
    interleaved."""
    from baton.engine.platforms.base import LayerOps
    x, w13, w2, ids, weights = inputs[0]
    ref = LayerOps().moe_experts(x.double(), w13.double(), w2.double(), ids, weights.double())
    ok = []
    for label, tiles, alignment in configs:
        try:
            out = _step(inputs[0], tiles, alignment)
            torch.cuda.synchronize()
        except Exception as e:      # noqa: BLE001  (a config over the shared memory: note it, go on)
            print(f"[moe] T={tokens} tiles={tiles}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr, flush=True)
            continue
        ok.append([label, tiles, alignment, [], ((out.double() - ref).norm() / ref.norm()).item()])
    for _ in range(rounds):
        for row in ok:
            row[3].append(graph_ms([lambda a=a, r=row: _step(a, r[1], r[2]) for a in inputs]))
    return [tuple(r) for r in ok]


def bench_tokens(tokens: int, layers, copy_bw: float, rate: float) -> list[dict]:
    from baton.engine.platforms.base import LayerOps
    from baton.engine.platforms.triton_kernels import moe, moe_routing
    from baton.engine.platforms.triton_kernels.moe_align import align_by_expert
    inputs, hit, floor = make_inputs(tokens, layers, copy_bw, rate)
    rows = []
    for label, tiles, alignment, times, err in time_steps(tokens, inputs, candidates(tokens)):
        ms = statistics.median(times)
        rows.append(dict(tokens=tokens, label=label, tiles=list(dataclasses.astuple(tiles)), alignment=alignment,
                         ms=ms, ms_rounds=times, floor_ms=floor * 1e3, of_floor=floor * 1e3 / ms, experts_hit=hit,
                         weight_gb_per_s=hit * 3 * H * INTER * 2 / (ms / 1e3) / 1e9, rel_err=err))
        print(f"[moe] T={tokens:5d} {label} {alignment} tiles={rows[-1]['tiles']} "
              f"{' / '.join(f'{t * 1e3:.1f}' for t in times)} us  floor {floor * 1e6:7.1f} us "
              f"({rows[-1]['of_floor']:.2f})  hit {hit:.1f}  err {err:.1e}", file=sys.stderr, flush=True)
    bm = moe.pick_tiles(tokens * K, E, H, INTER, torch.bfloat16).block_m
    aligns = [("align", moe.align), ("one_program", moe_routing._align_one_program), ("chunked", moe_routing._align_chunked),
              ("torch", align_by_expert)]
    times = {name: graph_ms([lambda i=i, f=f: f(i[3], E, bm) for i in inputs]) * 1e3
             for name, f in aligns if name != "one_program" or tokens * K <= 4096}
    rows.append(dict(tokens=tokens, label="alignment alone (us)", block_m=bm, **times))
    print(f"[moe] T={tokens:5d} alignment alone, block_m {bm}: " + ", ".join(f"{k} {v:.1f} us" for k, v in times.items()),
          file=sys.stderr, flush=True)
    if tokens <= 64:                       # the base path, eager (host-synced), for scale
        x, w13, w2, ids, weights = inputs[0]
        ms = event_ms(lambda: LayerOps().moe_experts(x, w13, w2, ids, weights), 5)
        rows.append(dict(tokens=tokens, label="base-eager", tiles="", ms=ms, floor_ms=floor * 1e3,
                         of_floor=floor * 1e3 / ms))
    return rows


# --fp8: the same step with e4m3 experts (--quantization fp8) beside bf16's, both ways: weight-only
# ("fp8": bf16 activations, the weights widened) and FP8 x FP8 ("dots": activations quantized per
# token), default tiles and a few alternatives per token count, rounds interleaved; floor = the hit
# experts' e4m3 bytes (+ scales) / copy bandwidth, or the FLOPs at the bf16 rate (weight-only) or
# twice it (dots: FP8 tensor cores)
FP8_TOKENS = (1, 8, 64, 256, 512, 1024, 2048, 8192)


def fp8_alternatives(tokens: int) -> list:
    """Tiles to time beside the default per token count (decode shapes). (Swapping the dots'
    operands so the widened e4m3 tile is wgmma's register A operand was timed too, at 562bb99:
    slower at every size, 0.74x of bf16 at 2,048 tokens where the default gives 0.79x; not kept.)"""
    from baton.engine.platforms.triton_kernels.moe import MoeTiles
    if tokens <= 64:
        return [MoeTiles(16, 32, 256, 4, 4)]
    return [MoeTiles(32, 64, 256, 4, 3)] if tokens == 256 else []


def dots_alternatives(tokens: int) -> list:
    """FP8 x FP8 tiles to time beside pick_tiles(..., FP8): at decode sizes (up to 24 pairs an expert)
    other swapped tiles and the unswapped ones (mma.sync below 64 rows); at prefill sizes others."""
    from baton.engine.platforms.triton_kernels.moe import MoeTiles
    if tokens * K <= 24 * E:
        bm = 16 if tokens * K <= 4 * E else 32
        return [MoeTiles(bm, 64, 128, 4, 4, swap=True), MoeTiles(bm, 128, 128, 4, 3, swap=True),
                MoeTiles(bm, 128, 256, 8, 3, swap=True), MoeTiles(bm, 64, 256, 4, 4, swap=True),
                MoeTiles(bm, 32, 128, 4, 5)]
    if 256 < tokens <= 1024:
        return [MoeTiles(64, 128, 128, 4, 3), MoeTiles(64, 64, 256, 4, 3), MoeTiles(128, 128, 128, 8, 3, 256, 128, 8, 3)]
    if tokens > 1024:
        return [MoeTiles(128, 128, 64, 8, 4, 256, 64, 8, 4), MoeTiles(128, 128, 128, 8, 4, 256, 128, 8, 4),
                MoeTiles(64, 128, 128, 4, 3), MoeTiles(128, 64, 128, 4, 4, 128, 128, 8, 3)]
    return []


def bench_fp8_tokens(tokens: int, layers, fp8_layers, copy_bw: float, rate: float) -> list[dict]:
    from baton.engine.platforms.base import LayerOps
    from baton.engine.platforms.triton_kernels.moe import fused_experts, pick_tiles
    from baton.models.layers.quantization import FP8
    inputs, hit, floor_bf16 = make_inputs(tokens, layers, copy_bw, rate)
    fp8_inputs = [(x, q13, q2, ids, w, scales) for (x, _, _, ids, w), (q13, q2, scales) in zip(inputs, fp8_layers, strict=True)]
    expert_bytes = hit * (3 * H * INTER + 4 * (2 * INTER + H))     # e4m3 weights + their float32 scales
    floor_fp8 = max((expert_bytes + 2 * tokens * H * 2) / copy_bw, 2 * tokens * K * 3 * H * INTER / rate)
    floor_dots = max((expert_bytes + 2 * tokens * H * 2) / copy_bw, 2 * tokens * K * 3 * H * INTER / (2 * rate))
    default = pick_tiles(tokens * K, E, H, INTER, torch.bfloat16)
    configs = [("bf16", default, "bf16"), ("fp8", default, "fp8")]
    configs += [("fp8-alt", t, "fp8") for t in fp8_alternatives(tokens)]
    configs += [("dots", pick_tiles(tokens * K, E, H, INTER, FP8), "dots")]
    configs += [("dots-alt", t, "dots") for t in dots_alternatives(tokens)]
    x, w13, w2, ids, weights = inputs[0]
    _, q13, q2, _, _, scales = fp8_inputs[0]
    d = torch.float64
    ref_bf16 = LayerOps().moe_experts(x.to(d), w13.to(d), w2.to(d), ids, weights.to(d))
    refs = {"bf16": ref_bf16,
            "fp8": LayerOps().moe_experts(x.to(d), q13, q2, ids, weights.to(d), scales=scales, fp8_dots=False),
            "dots": LayerOps().moe_experts(x.to(d), q13, q2, ids, weights.to(d), scales=scales, fp8_dots=True)}

    def call(args, tiles, mode):
        if mode == "bf16":
            return fused_experts(*args, tiles=tiles)
        return fused_experts(*args[:5], tiles=tiles, scales=args[5], fp8_dots=mode == "dots")
    ok = []
    for label, tiles, mode in configs:
        try:
            out = call((inputs if mode == "bf16" else fp8_inputs)[0], tiles, mode).double()
            torch.cuda.synchronize()
        except Exception as e:      # noqa: BLE001  (a config over the shared memory: note it, go on)
            print(f"[moe-fp8] T={tokens} {label} {tiles}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr, flush=True)
            continue
        ref = refs[mode]
        ok.append((tiles, dict(tokens=tokens, label=label, mode=mode, tiles=list(dataclasses.astuple(tiles)),
                               ms_rounds=[], rel_err=((out - ref).norm() / ref.norm()).item(),
                               vs_bf16_weights=((out - ref_bf16).norm() / ref_bf16.norm()).item(),
                               fp8=mode != "bf16")))
    for _ in range(3):
        for tiles, row in ok:
            src = inputs if row["mode"] == "bf16" else fp8_inputs
            row["ms_rounds"].append(graph_ms([lambda a=a, t=tiles, m=row["mode"]: call(a, t, m) for a in src]))
    ok = [row for _, row in ok]
    base_ms = {}
    for row in ok:
        row["ms"] = statistics.median(row["ms_rounds"])
        floor = {"bf16": floor_bf16, "fp8": floor_fp8, "dots": floor_dots}[row["mode"]]
        row.update(floor_ms=floor * 1e3, of_floor=floor * 1e3 / row["ms"], experts_hit=hit)
        base_ms.setdefault(row["label"], row["ms"])
        row["speedup_vs_bf16"] = base_ms["bf16"] / row["ms"] if "bf16" in base_ms else None
        row["speedup_vs_weight_only"] = base_ms["fp8"] / row["ms"] if "fp8" in base_ms else None
        print(f"[moe-fp8] T={tokens:5d} {row['label']:<8} tiles={row['tiles']} "
              f"{' / '.join(f'{t * 1e3:.1f}' for t in row['ms_rounds'])} us  floor {floor * 1e6:7.1f} us "
              f"({row['of_floor']:.2f})  x{row['speedup_vs_bf16'] or 0:.2f} vs bf16, "
              f"x{row['speedup_vs_weight_only'] or 0:.2f} vs weight-only  hit {hit:.1f}  "
              f"err {row['rel_err']:.1e} (vs bf16 weights {row['vs_bf16_weights']:.1e})", file=sys.stderr, flush=True)
    return ok


# --sweep: each GEMM alone per tile config (w13 as (block_n, block_k, warps, stages) per half, w2 likewise
# over H), per block_m, then the best pair per block_m as a whole step against the previous tiles
SWEEP_BM = {256: (16, 32), 2048: (64, 128), 8192: (64, 128), 16384: (128,)}
SWEEP_W13 = {16: [(32, 128, 4, 5), (64, 128, 4, 4), (64, 256, 4, 3), (32, 256, 4, 4)],
             32: [(64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 4, 3), (128, 64, 4, 4), (64, 64, 4, 4), (32, 128, 4, 4),
                  (64, 256, 4, 2)],
             64: [(64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 64, 4, 4), (64, 128, 4, 3), (64, 64, 4, 5),
                  (128, 128, 8, 2)],
             128: [(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3), (64, 64, 8, 4), (64, 128, 8, 3), (128, 128, 8, 2),
                   (128, 32, 8, 5)]}
SWEEP_W2 = {16: [(32, 128, 4, 5), (64, 128, 4, 4), (128, 128, 4, 3), (128, 64, 4, 4), (256, 64, 4, 3)],
            32: [(64, 128, 4, 3), (128, 128, 4, 3), (128, 64, 4, 4), (256, 64, 4, 3), (64, 256, 4, 2), (32, 128, 4, 4),
                 (256, 128, 8, 2)],
            64: [(64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 4, 4), (256, 64, 8, 3), (128, 128, 4, 3), (256, 64, 4, 3),
                 (64, 128, 4, 4)],
            128: [(128, 64, 8, 3), (256, 64, 8, 3), (256, 64, 8, 4), (128, 64, 8, 4), (128, 128, 8, 3), (64, 64, 4, 4),
                  (128, 64, 4, 3)]}


def sweep_tokens(tokens: int, layers, copy_bw: float, rate: float) -> list[dict]:
    from baton.engine.platforms.triton_kernels.moe import (
        MoeTiles,
        _align_one_program,
        align,
        launch_sum,
        launch_w2,
        launch_w13,
        pick_tiles,
    )
    from baton.engine.platforms.triton_kernels.moe_align import align_by_expert
    inputs, hit, floor = make_inputs(tokens, layers, copy_bw, rate)
    n = len(inputs)
    rows, best = [], {}

    def log(row):
        rows.append(dict(tokens=tokens, **row))
        print(f"[sweep] T={tokens} " + " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                                for k, v in row.items()), file=sys.stderr, flush=True)

    def sweep_block_m(bm: int) -> None:
        blocks = [align(ids, E, bm) for _, _, _, ids, _ in inputs]
        acts = [torch.empty(tokens * K, INTER, dtype=torch.bfloat16, device="cuda") for _ in range(n)]
        pairs = [torch.empty(tokens * K, H, dtype=torch.float32, device="cuda") for _ in range(n)]
        outs = [torch.empty(tokens, H, dtype=torch.bfloat16, device="cuda") for _ in range(n)]
        routes = [w.reshape(-1).contiguous() for *_, w in inputs]
        log(dict(stage="align", block_m=bm, us=graph_ms([lambda i=i: align(i[3], E, bm) for i in inputs]) * 1e3))
        log(dict(stage="align_torch", block_m=bm,
                 us=graph_ms([lambda i=i: align_by_expert(i[3], E, bm) for i in inputs]) * 1e3))
        if tokens * K <= 4096:
            log(dict(stage="align_one_program", block_m=bm,
                     us=graph_ms([lambda i=i: _align_one_program(i[3], E, bm) for i in inputs]) * 1e3))
        log(dict(stage="sum", block_m=bm, us=graph_ms([lambda i=i: launch_sum(pairs[i], outs[i], K)
                                                       for i in range(n)]) * 1e3))
        for stage, configs in (("w13", SWEEP_W13[bm]), ("w2", SWEEP_W2[bm])):
            timed = []
            for cfg in configs:
                tiles = MoeTiles(bm, *cfg)
                if stage == "w13":
                    calls = [lambda i=i, t=tiles: launch_w13(inputs[i][0], inputs[i][1], acts[i], blocks[i], K, t)
                             for i in range(n)]
                else:
                    calls = [lambda i=i, t=tiles: launch_w2(acts[i], inputs[i][2], pairs[i], blocks[i], routes[i], t)
                             for i in range(n)]
                try:
                    for c in calls:
                        c()
                    torch.cuda.synchronize()
                except Exception as e:      # noqa: BLE001
                    print(f"[sweep] T={tokens} {stage} {cfg}: {type(e).__name__}: {str(e)[:160]}", file=sys.stderr,
                          flush=True)
                    continue
                us = [graph_ms(calls) * 1e3, graph_ms(calls) * 1e3]
                timed.append((min(us), cfg))
                log(dict(stage=stage, block_m=bm, cfg=list(cfg), us=min(us), us2=max(us)))
            if timed:
                best[(bm, stage)] = min(timed)[1]
    for bm in SWEEP_BM[tokens]:
        sweep_block_m(bm)
    tiles_list = [previous_tiles(tokens), pick_tiles(tokens * K, E, H, INTER, torch.bfloat16)]
    for bm in SWEEP_BM[tokens]:
        if (bm, "w13") in best and (bm, "w2") in best:
            tiles_list.append(MoeTiles(bm, *best[(bm, "w13")], *best[(bm, "w2")]))
    tiles_list = [t for i, t in enumerate(tiles_list) if t not in tiles_list[:i]]
    for _, tiles, _, times, err in time_steps(tokens, inputs, [("", t, "chunked") for t in tiles_list]):
        ms = statistics.median(times)
        log(dict(stage="step", tiles=list(dataclasses.astuple(tiles)), us=ms * 1e3,
                 rounds=" / ".join(f"{t * 1e3:.1f}" for t in times), floor_us=floor * 1e6, of_floor=floor / (ms / 1e3),
                 err=err))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--sweep", action="store_true", help="time each GEMM alone per tile config (SWEEP_*)")
    p.add_argument("--fp8", action="store_true", help="bf16 vs e4m3 experts (--quantization fp8), FP8_TOKENS")
    args = p.parse_args()
    if args.fp8:
        return main_fp8(args)
    copy_bw, rate = ceilings()
    print(f"[moe] copy {copy_bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s", file=sys.stderr)
    layers = random_layers()
    rows = []
    Path(args.out).mkdir(parents=True, exist_ok=True)
    for t in map(int, args.tokens.split(",")):
        rows += (sweep_tokens if args.sweep else bench_tokens)(t, layers, copy_bw, rate)
        (Path(args.out) / ("moe_sweep.json" if args.sweep else "moe_kernel.json")).write_text(json.dumps(
            dict(copy_bytes_per_s=copy_bw, matmul_flops_per_s=rate, shape=dict(E=E, k=K, H=H, INTER=INTER), rows=rows),
            indent=1))
    if args.sweep:
        for r in rows:
            if r["stage"] == "step":
                print(f"{r['tokens']:5d} {str(r['tiles']):<40} {r['us']:9.1f} ({r['rounds']}) {r['floor_us']:9.1f} "
                      f"{r['of_floor']:8.2f}")
        return
    print(f"{'T':>5} {'config':<11} {'align':<7} {'tiles':<38} {'us':>8} {'rounds':>15} {'floor us':>8} "
          f"{'of floor':>8} {'err':>7}")
    for r in rows:
        if "ms" not in r:
            continue
        print(f"{r['tokens']:5d} {r['label']:<11} {r.get('alignment', ''):<7} {str(r['tiles']):<38} "
              f"{r['ms'] * 1e3:8.1f} {' / '.join(f'{t * 1e3:.1f}' for t in r.get('ms_rounds', [])):>15} "
              f"{r['floor_ms'] * 1e3:8.1f} {r['of_floor']:8.2f} {r.get('rel_err', 0):7.1e}")
    for r in rows:
        if "align" in r:
            print(f"{r['tokens']:5d} alignment alone, block_m {r['block_m']}: " + ", ".join(
                f"{k} {r[k]:.1f} us" for k in ("align", "one_program", "chunked", "torch") if k in r))


def random_layers() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """LAYERS layers of bf16 expert stacks (w13 [E, 2I, H], w2 [E, H, I]), seeded: rotated past the L2."""
    g = torch.Generator(device="cuda").manual_seed(0)
    return [((torch.randn(E, 2 * INTER, H, device="cuda", generator=g) * 0.02).to(torch.bfloat16),
             (torch.randn(E, H, INTER, device="cuda", generator=g) * 0.02).to(torch.bfloat16)) for _ in range(LAYERS)]


def main_fp8(args) -> None:
    from baton.models.layers.quantization import ExpertScales, quantize_stacked
    copy_bw, rate = ceilings()
    print(f"[moe-fp8] copy {copy_bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s", file=sys.stderr)
    layers = random_layers()
    fp8_layers = []
    for w13, w2 in layers:
        (q13, s13), (q2, s2) = quantize_stacked(w13), quantize_stacked(w2)
        fp8_layers.append((q13, q2, ExpertScales(s13, s2)))
    tokens = FP8_TOKENS if args.tokens == ",".join(map(str, TOKENS)) else tuple(map(int, args.tokens.split(",")))
    rows = []
    Path(args.out).mkdir(parents=True, exist_ok=True)
    for t in tokens:
        rows += bench_fp8_tokens(t, layers, fp8_layers, copy_bw, rate)
        (Path(args.out) / "moe_kernel_fp8.json").write_text(json.dumps(
            dict(copy_bytes_per_s=copy_bw, matmul_flops_per_s=rate, shape=dict(E=E, k=K, H=H, INTER=INTER), rows=rows),
            indent=1))
    print(f"{'T':>5} {'config':<8} {'tiles':<36} {'us':>8} {'rounds':>22} {'floor us':>8} {'of floor':>8} "
          f"{'vs bf16':>7} {'vs w-only':>9} {'err':>7}")
    for r in rows:
        print(f"{r['tokens']:5d} {r['label']:<8} {str(r['tiles']):<36} {r['ms'] * 1e3:8.1f} "
              f"{' / '.join(f'{t * 1e3:.1f}' for t in r['ms_rounds']):>22} {r['floor_ms'] * 1e3:8.1f} "
              f"{r['of_floor']:8.2f} {r['speedup_vs_bf16'] or 0:7.2f} {r['speedup_vs_weight_only'] or 0:9.2f} "
              f"{r['rel_err']:7.1e}")


if __name__ == "__main__":
    main()
