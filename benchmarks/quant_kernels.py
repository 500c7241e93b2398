"""FP8 kernels at decode sizes (issue 33's speed): a model's projections (qwen3-8b's unless --model)
and decode attention.

    python -m baton.benchmarks.quant_kernels --out DIR [--model qwen3-30b-a3b]

Per projection shape and batch M: the bf16 GEMM, `torch._scaled_mm` row-wise with float32 and
with fast accumulation (time and error against the float64 product), and the engine's Triton FP8
GEMM (engine/platforms/triton_kernels/fp8_gemm.py) over a sweep of tiles and split-K (M <= 256),
each call on its own copy of the weights so they stream from HBM as in a decode step, timed as
one CUDA graph (a decode step's launches); at the end, fp8_gemm.TABLE's text from the winners
(--fast-accum: both sides in the fast mode, the engine's default). Decode attention over a bf16
and a float8 cache, per tile config and split setting, contexts equal or drawn uniformly
(triton.testing.do_bench, the L2 flushed between runs; it times Python's launches too, so a
case under ~100 us measures the launch, not the kernel). Prints one JSON line per measurement and writes them to
DIR/quant_kernels.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from baton.engine.platforms.triton_kernels import decode_attention, fp8_gemm, quant


def _us(fn, *args, **kwargs) -> float:
    return 1000 * do_bench(lambda: fn(*args, **kwargs))


# the projections swept, (N, K) by name: qwen3-8b's unless --model, split-K's candidates (4096 outputs) first
SHAPES = {"o": (4096, 4096), "down": (4096, 12288), "gate_up": (24576, 4096), "qkv": (6144, 4096)}


def model_shapes(model: str) -> dict[str, tuple[int, int]]:
    """A preset's FP8 projections: attention's qkv and o, and the dense MLP's where a layer has one
    (a mixture-of-experts model's routed experts run the fused expert kernels, not this GEMM)."""
    from baton.benchmarks.model_shape import shape_of
    s = shape_of(model)
    q = s.heads * s.head_dim
    shapes = {"o": (s.hidden, q), "qkv": (q + 2 * s.kv_heads * s.head_dim, s.hidden)}
    if s.moe_layers < s.layers:
        shapes = {"o": shapes["o"], "down": (s.hidden, s.intermediate),
                  "gate_up": (2 * s.intermediate, s.hidden), "qkv": shapes["qkv"]}
    return shapes


def _candidates(m: int, k: int) -> list[fp8_gemm.Fp8GemmConfig]:
    """The Triton FP8 GEMM's tiles tried at M: tokens on the MMA's narrow side (swap_ab) with 64- or
    128-wide weight tiles, split-K where K's blocks divide, and two plain tiles from M = 64."""
    out = []
    for bm in sorted({max(16, min(triton.next_power_of_2(m), cap)) for cap in (64, 128)}):
        for bn in (64, 128):
            for bk in (128, 256):
                for split in (1, 2, 4, 8):
                    if (k // bk) % split == 0 and not (bm == 128 and bn == 128 and bk == 256):
                        out.append(fp8_gemm.Fp8GemmConfig(bm, bn, bk, split, True, 4, 4 if bk == 128 else 3))
    if m >= 64:
        for split in (1, 2, 4):
            out.append(fp8_gemm.Fp8GemmConfig(64, 128, 128, split, False, 4, 4))
            out.append(fp8_gemm.Fp8GemmConfig(128, 128, 128, split, False, 8, 4))
    return out


def _graph_us(calls: list, reps: int = 3) -> float:
    """Microseconds per call, the calls captured back to back in one CUDA graph (as a decode step
    runs them: no launch overhead), each on its own copy of the weights (together > 4x the L2, so
    they stream from HBM)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for c in calls:
                c()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, 1000 * start.elapsed_time(end) / (reps * len(calls)))
    del graph
    return best


FAST_ACCUM = False      # --fast-accum: the Triton tiles sum as --fp8-accumulation fast, against _scaled_mm's fast
MODEL_NOTE = ""          # --model: " --model NAME" in the table's note


def _gemm_row(name: str, n: int, k: int, m: int, wq_: list, ws_: list, wb_: list) -> dict:
    dev = wq_[0].device
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    xq, xs = quant.quantize_fp8_rows(x)
    pairs = list(zip(wq_, ws_, strict=True))
    row = {"shape": name, "m": m, "n": n, "k": k, "copies": len(wq_)}
    row["bf16_us"] = _graph_us([lambda w=w: torch.nn.functional.linear(x, w) for w in wb_])
    row["scaled_mm_us"] = _graph_us([lambda w=w, s=s: torch._scaled_mm(
        xq, w.t(), scale_a=xs, scale_b=s, out_dtype=torch.bfloat16) for w, s in pairs])
    ref = torch._scaled_mm(xq, wq_[0].t(), scale_a=xs, scale_b=ws_[0], out_dtype=torch.bfloat16).float()
    exact = (xq.double() * xs.double()) @ (wq_[0].double() * ws_[0].double().t()).t()
    row["scaled_mm_err"] = ((ref.double() - exact).norm() / exact.norm()).item()
    # --fp8-accumulation fast: the tensor cores' own sums, never promoted to float32
    row["fast_accum_us"] = _graph_us([lambda w=w, s=s: torch._scaled_mm(
        xq, w.t(), scale_a=xs, scale_b=s, out_dtype=torch.bfloat16, use_fast_accum=True) for w, s in pairs])
    fast = torch._scaled_mm(xq, wq_[0].t(), scale_a=xs, scale_b=ws_[0], out_dtype=torch.bfloat16, use_fast_accum=True)
    row["fast_accum_err"] = ((fast.double() - exact).norm() / exact.norm()).item()
    row["fast_accum_max_err"] = ((fast.double() - exact).abs().max() / exact.abs().max()).item()
    best = None
    candidates = _candidates(m, k) if m <= 256 else []      # prefill sizes: cuBLAS only
    fp8_gemm.TABLE = {(n, k): tuple((m, c) for c in candidates)}      # sizes the split-K workspace
    for cfg in candidates:
        try:
            y = fp8_gemm.fp8_gemm(xq, xs, wq_[0], ws_[0], cfg, fast_accum=FAST_ACCUM)
            err = ((y.double() - exact).norm() / exact.norm()).item()
            if not err < 2 * row["fast_accum_err" if FAST_ACCUM else "scaled_mm_err"] + 1e-4:
                print(json.dumps({"skip": str(cfg), "why": f"error {err:.2e}"}), flush=True)
                continue
            t = _graph_us([lambda w=w, s=s, cfg=cfg: fp8_gemm.fp8_gemm(xq, xs, w, s, cfg, fast_accum=FAST_ACCUM)
                           for w, s in pairs])
        except Exception as e:  # noqa: BLE001 -- out of shared memory etc.: skip that tile
            print(json.dumps({"skip": str(cfg), "why": repr(e)[:100]}), flush=True)
            continue
        if best is None or t < best[0]:
            best = (t, cfg, err)
    if best is not None:
        c = best[1]
        row.update(triton_us=best[0], triton_err=best[2],
                   triton_cfg=[c.block_m, c.block_n, c.block_k, c.split_k, c.swap_ab, c.num_warps, c.num_stages])
    row["fp8_floor_us"] = max(n * k / 2.96e6, 2 * m * n * k / 1.979e9)   # bytes at 2.96 TB/s, FLOPs at FP8 peak
    row["bf16_floor_us"] = 2 * n * k / 2.96e6
    row = {k2: (round(v, 2) if v > 0.01 else float(f"{v:.3g}")) if isinstance(v, float) else v for k2, v in row.items()}
    return row


def _table(rows: list[dict], margin: float) -> dict:
    """A fp8_gemm_tables.json entry from the sweep: per shape and M, the best Triton tile where it
    beats `_scaled_mm` by more than `margin`, else null (`_scaled_mm`)."""
    shapes = {}
    for name, (n, k) in SHAPES.items():
        picked = []
        for r in sorted((r for r in rows if r["shape"] == name), key=lambda r: r["m"]):
            if r["m"] > 256:                      # prefill sizes: _scaled_mm, not in the table
                continue
            cublas = r["fast_accum_us" if FAST_ACCUM else "scaled_mm_us"]
            win = "triton_us" in r and r["triton_us"] < (1 - margin) * cublas
            picked.append([r["m"], r["triton_cfg"] if win else None])
        if picked:
            shapes[f"{n}x{k}"] = picked
    return {"measured": f"benchmarks/quant_kernels.py{MODEL_NOTE}, {time.strftime('%Y-%m-%d')}, a win: {margin:.0%} under "
                        "_scaled_mm, both timed in a CUDA graph", "accumulation": "fast" if FAST_ACCUM else "fp32",
            "shapes": shapes}


OTHER_SHAPES = "; the other shapes: "


def _write_table(path: str, entry: dict) -> None:
    """Merge this GPU's entry into the tables file: other GPUs' entries kept, and this GPU's shapes
    that this sweep did not cover (another model's) kept where they were measured in the same
    accumulation mode."""
    tables = json.loads(Path(path).read_text()) if Path(path).exists() else {}
    gpu = torch.cuda.get_device_name()
    old = tables.get(gpu, {})
    if old.get("accumulation") == entry["accumulation"] and set(old.get("shapes", {})) - set(entry["shapes"]):
        # (a sweep writes after each shape: its own note, already in the old one, is not repeated)
        notes = dict.fromkeys(n for n in old["measured"].split(OTHER_SHAPES) if n != entry["measured"])
        entry = {**entry, "measured": OTHER_SHAPES.join([entry["measured"], *notes]),
                 "shapes": {**old["shapes"], **entry["shapes"]}}
    tables[gpu] = entry
    Path(path).write_text(json.dumps(tables, indent=1) + "\n")


def _gemms(ms: list[int], out, table_path: str | None) -> None:
    dev = torch.device("cuda")
    rows = []
    for name, (n, k) in SHAPES.items():
        copies = max(2, -(-4 * 50 * 2 ** 20 // (n * k)))        # fp8 copies over 4x an H100's 50 MiB L2
        ws_, wq_, wb_ = [], [], []
        for _ in range(copies):
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
            s = (w.float().abs().amax(1, keepdim=True) / 448).clamp(min=1e-12)
            wq_.append((w.float() / s).to(torch.float8_e4m3fn))
            ws_.append(s.reshape(1, -1).contiguous())
            wb_.append(w)
        for m in ms:
            row = _gemm_row(name, n, k, m, wq_, ws_, wb_)
            rows.append(row)
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")
            out.flush()
        del ws_, wq_, wb_
        torch.cuda.empty_cache()
        entry = _table(rows, 0.03)            # after each shape: a cut-short sweep still leaves its table
        if table_path:
            _write_table(table_path, entry)
    print(json.dumps({"table": entry}), flush=True)
    out.write(json.dumps({"table": entry}) + "\n")


ALL_CONFIGS = False     # --attention-all: a line per config, not only the best


def _attention(cases: list[tuple[int, int, int]], out) -> None:
    """Per case (batch, shortest, longest context: each sequence's length uniform between them), every
    tile config and programs per SM (how far contexts are split to fill the GPU)."""
    dev = torch.device("cuda")
    hq, hkv, d, bs = 32, 8, 128, 16
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    cfgs = [decode_attention.DecodeConfig(block_n=bn, num_warps=w, num_stages=s, programs_per_sm=p)
            for bn in (64, 128) for w in (4, 8) for s in (2, 3) for p in (2, 4, 8)]
    g = torch.Generator().manual_seed(0)
    for batch, lo, hi in cases:
        blocks_per = -(-hi // bs)
        nblocks = batch * blocks_per + 1
        tables = torch.randperm(nblocks - 1, device=dev, dtype=torch.int32)[: batch * blocks_per].view(batch, -1)
        lens = torch.randint(lo, hi + 1, (batch,), generator=g)
        seq_lens = lens.to(device=dev, dtype=torch.int32)
        q = torch.randn(batch, hq, d, device=dev, dtype=torch.bfloat16)
        kb = torch.randn(nblocks, bs, hkv, d, device=dev, dtype=torch.bfloat16)
        vb = torch.randn(nblocks, bs, hkv, d, device=dev, dtype=torch.bfloat16)
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            k, v = kb.to(dtype), vb.to(dtype)
            floor_us = 2 * int(lens.sum()) * hkv * d * k.element_size() / 2.96e6
            ref = decode_attention.paged_decode(q, k, v, tables, seq_lens, d ** -0.5, sms)
            default_us = _us(decode_attention.paged_decode, q, k, v, tables, seq_lens, d ** -0.5, sms)
            best = None
            for cfg in cfgs:
                try:
                    y = decode_attention.paged_decode(q, k, v, tables, seq_lens, d ** -0.5, sms, cfg=cfg)
                    assert (y.float() - ref.float()).abs().max().item() < 0.05
                    t = _us(decode_attention.paged_decode, q, k, v, tables, seq_lens, d ** -0.5, sms, cfg=cfg)
                except Exception as e:  # noqa: BLE001
                    print(json.dumps({"skip": str(cfg), "why": repr(e)[:100]}), flush=True)
                    continue
                if ALL_CONFIGS:
                    print(json.dumps({"attention": str(dtype).split(".")[-1], "batch": batch, "context": [lo, hi],
                                      "cfg": (cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.programs_per_sm),
                                      "us": round(t, 1), "fraction": round(floor_us / t, 3)}), flush=True)
                if best is None or t < best[0]:
                    best = (t, (cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.programs_per_sm))
            row = {"attention": str(dtype).split(".")[-1], "batch": batch, "context": [lo, hi],
                   "default_us": round(default_us, 1), "best_us": round(best[0], 1), "best_cfg": best[1],
                   "floor_us": round(floor_us, 1), "default_fraction": round(floor_us / default_us, 3),
                   "best_fraction": round(floor_us / best[0], 3)}
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")


def _case(text: str) -> tuple[int, int, int]:
    """BxL (every context L) or BxLO-HI (each uniform in [LO, HI])."""
    batch, ctx = text.split("x")
    lo, _, hi = ctx.partition("-")
    return int(batch), int(lo), int(hi or lo)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=".")
    p.add_argument("--model", default=None, help="sweep this preset's projections (unset: qwen3-8b's)")
    p.add_argument("--m", default="16,32,64,128,256")
    p.add_argument("--skip", default="", help="gemm,attention")
    p.add_argument("--attention-cases", default="256x1024,64x2048,128x100-2048,32x100-2048",
                   help="decode attention's cases: BxL (batch x context) or BxLO-HI (contexts uniform in [LO, HI])")
    p.add_argument("--write-table", default=None, metavar="JSON",
                   help="merge the GEMM winners into this tables file (the engine's: "
                        "engine/platforms/triton_kernels/fp8_gemm_tables.json)")
    p.add_argument("--fast-accum", action="store_true",
                   help="the Triton tiles sum without float32 promotion, and win against _scaled_mm's fast "
                        "accumulation (the table for --fp8-accumulation fast)")
    p.add_argument("--attention-all", action="store_true", help="print every attention config's time")
    args = p.parse_args(argv)
    global FAST_ACCUM, ALL_CONFIGS, SHAPES, MODEL_NOTE
    FAST_ACCUM, ALL_CONFIGS = args.fast_accum, args.attention_all
    if args.model:
        SHAPES, MODEL_NOTE = model_shapes(args.model), f" --model {args.model}"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "quant_kernels.jsonl"), "w") as out:
        if "attention" not in args.skip:
            _attention([_case(c) for c in args.attention_cases.split(",")], out)
        if "gemm" not in args.skip:
            _gemms([int(m) for m in args.m.split(",")], out, args.write_table)


if __name__ == "__main__":
    main()
