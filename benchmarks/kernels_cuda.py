"""Device script for the CUDA platform's Triton kernels: correctness, then timings vs ceilings.

Runs tests/test_platform_cuda.py, measures the device's copy bandwidth and bf16 matmul rate,
then times paged decode (KV bytes read over time, as a fraction of the copy bandwidth), varlen
prefill (causal TFLOP/s vs the matmul rate, torch's flash SDPA beside it) and the fused layer
ops (vs plain torch), each with a small sweep of kernel configs. Needs a CUDA GPU and triton:

    PYTHONUNBUFFERED=1 python3 -m baton.benchmarks.kernels_cuda --out "$OUT"

Prints a table last and writes kernels_cuda.json (and pytest.log) under --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import math
import re
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

MODELS = {"qwen3-0.6b": (16, 8, 128), "qwen3-8b": (32, 8, 128)}     # q heads, kv heads, head_dim
DECODE_BATCHES = (1, 64, 256)
DECODE_CONTEXTS = (1024, 4096)
PREFILL_CASES = ((1, 4096), (16, 512))                               # sequences x tokens each
BLOCK_SIZE = 16
GRAPH_WIDTH = 40960       # block-table width (tokens) of a decode graph for Qwen3's max_model_len
ROTATE_BYTES = 1 << 30    # rotate decode inputs over >= 1 GiB so the 50-60 MB L2 cannot serve them


def log(msg: str) -> None:
    print(f"[kernels] {msg}", file=sys.stderr, flush=True)


# -- timing -----------------------------------------------------------------------------------
def graph_seconds_per_call(calls: list, reps: int = 15) -> float:
    """Median time of one call, from replays of a CUDA graph that runs all `calls` in turn."""
    for c in calls[:2]:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del graph
    return statistics.median(times) / len(calls)


def event_seconds(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


# -- decode -----------------------------------------------------------------------------------
def decode_configs():
    from baton.engine.platforms.triton_kernels.decode_attention import DecodeConfig
    base = DecodeConfig()
    return {
        "default": base,
        "n32": dataclasses.replace(base, block_n=32),
        "n128": dataclasses.replace(base, block_n=128),
        "w8": dataclasses.replace(base, num_warps=8),
        "s2": dataclasses.replace(base, num_stages=2),
        "s4": dataclasses.replace(base, num_stages=4),
        "split64": dataclasses.replace(base, min_split_tokens=64),
        "split256": dataclasses.replace(base, min_split_tokens=256),
        "pps1": dataclasses.replace(base, programs_per_sm=1),
        "pps4": dataclasses.replace(base, programs_per_sm=4),
        "pps8": dataclasses.replace(base, programs_per_sm=8),
        "pps4n32": dataclasses.replace(base, programs_per_sm=4, block_n=32),
        "pps8split64": dataclasses.replace(base, programs_per_sm=8, min_split_tokens=64),
        "pps4w8": dataclasses.replace(base, programs_per_sm=4, num_warps=8),
    }


def bench_decode(num_sms: int, copy_bw: float) -> list[dict]:
    rows = []
    for model, (hq, hkv, dim) in MODELS.items():
        for ctx in DECODE_CONTEXTS:
            for batch in DECODE_BATCHES:
                rows.append(decode_shape(model, hq, hkv, dim, batch, ctx, num_sms, copy_bw))
                torch.cuda.empty_cache()
    # as under the engine's decode graphs: block tables as wide as max_model_len (Qwen3's 40960)
    hq, hkv, dim = MODELS["qwen3-8b"]
    for ctx in DECODE_CONTEXTS:
        for batch in (1, 8, 64):
            rows.append(decode_shape("qwen3-8b", hq, hkv, dim, batch, ctx, num_sms, copy_bw, width_tokens=GRAPH_WIDTH))
            torch.cuda.empty_cache()
    return rows


def bench_decode_cases(cases: str, num_sms: int, copy_bw: float) -> list[dict]:
    """--decode-cases "HQ/HKV:BxL,...": every config on each, block tables as wide as a decode graph's."""
    rows = []
    for case in cases.split(","):
        heads, _, shape = case.partition(":")
        hq, hkv = (int(v) for v in heads.split("/"))
        batch, ctx = (int(v) for v in shape.split("x"))
        rows.append(decode_shape(f"{hq}/{hkv} heads", hq, hkv, 128, batch, ctx, num_sms, copy_bw,
                                 width_tokens=GRAPH_WIDTH, every_config=True))
        torch.cuda.empty_cache()
    return rows


def decode_shape(model: str, hq: int, hkv: int, dim: int, batch: int, ctx: int, num_sms: int,
                 copy_bw: float, width_tokens: int | None = None, every_config: bool = False) -> dict:
    """Every decode config on one shape (only the default one with `width_tokens`, block tables
    that wide, unless every_config); inputs rotate over `sets` copies to defeat the L2."""
    from baton.engine.platforms.triton_kernels.decode_attention import num_splits, paged_decode
    kv_bytes = batch * ctx * hkv * dim * 2 * 2                 # K and V, bf16
    sets = max(1, min(64, math.ceil(ROTATE_BYTES / kv_bytes)))
    blocks_per_seq = ctx // BLOCK_SIZE
    total_blocks = sets * batch * blocks_per_seq
    kv = torch.randn(2, total_blocks, BLOCK_SIZE, hkv, dim, device="cuda", dtype=torch.bfloat16)
    width = (width_tokens or ctx) // BLOCK_SIZE
    tables = torch.full((sets, batch, width), -1, device="cuda", dtype=torch.int32)
    tables[:, :, :blocks_per_seq] = torch.randperm(total_blocks, device="cuda", dtype=torch.int32).view(
        sets, batch, blocks_per_seq)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    qs = torch.randn(sets, batch, hq, dim, device="cuda", dtype=torch.bfloat16)
    outs = torch.empty_like(qs)
    moved = kv_bytes + 2 * qs[0].numel() * 2 + batch * blocks_per_seq * 4   # KV + q + out + block tables
    row = {"model": model, "batch": batch, "context": ctx, "bytes": moved, "sets": sets,
           "table_tokens": width * BLOCK_SIZE}
    configs = decode_configs()
    if width_tokens and not every_config:
        configs = {"default": configs["default"]}
    for name, cfg in configs.items():
        def call(i, cfg=cfg):
            return lambda: paged_decode(qs[i], kv[0], kv[1], tables[i], seq_lens, dim ** -0.5, num_sms, cfg,
                                        out=outs[i])
        t = graph_seconds_per_call([call(i % sets) for i in range(max(sets, 8))])
        row[name] = {"us": t * 1e6, "bw_frac": moved / t / copy_bw,
                     "splits": num_splits(batch, hkv, width * BLOCK_SIZE, num_sms, cfg)}
    row["best"] = best = min(configs, key=lambda n: row[n]["us"])
    if every_config:
        log(f"decode {model} B={batch} ctx={ctx}: " + ", ".join(
            f"{n} {row[n]['us']:.1f} us/{row[n]['splits']}" for n in configs))
    log(f"decode {model} B={batch} ctx={ctx} table={width * BLOCK_SIZE}: default {row['default']['us']:.1f} us "
        f"({row['default']['bw_frac']:.0%} of copy bw, {row['default']['splits']} splits); "
        f"best {best} {row[best]['us']:.1f} us")
    return row


# -- prefill ----------------------------------------------------------------------------------
def prefill_configs():
    from baton.engine.platforms.triton_kernels.prefill_attention import PrefillConfig
    return {"default": None, "m128n128w8": PrefillConfig(128, 128, 8, 3), "m64n64w4": PrefillConfig(64, 64, 4, 3),
            "m128n64w8": PrefillConfig(128, 64, 8, 3), "m128n128w8s2": PrefillConfig(128, 128, 8, 2),
            "m64n128w4": PrefillConfig(64, 128, 4, 3), "m64n64w4s4": PrefillConfig(64, 64, 4, 4),
            "m128n32w4": PrefillConfig(128, 32, 4, 3)}


def bench_prefill(matmul_rate: float) -> list[dict]:
    rows = []
    for model, (hq, hkv, dim) in MODELS.items():
        for nseq, length in PREFILL_CASES:
            rows.append(prefill_shape(model, hq, hkv, dim, nseq, length, matmul_rate))
            torch.cuda.empty_cache()
    return rows


def prefill_shape(model: str, hq: int, hkv: int, dim: int, nseq: int, length: int, matmul_rate: float) -> dict:
    """Every prefill config on one shape, keys from k/v ("fresh") and from the paged cache."""
    import torch.nn.functional as F

    from baton.engine.platforms.triton_kernels.kv_store import store_kv
    from baton.engine.platforms.triton_kernels.prefill_attention import varlen_prefill
    t = nseq * length
    q = torch.randn(t, hq, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, hkv, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(t, hkv, dim, device="cuda", dtype=torch.bfloat16)
    starts = torch.arange(0, t + 1, length, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((nseq,), length, dtype=torch.int32, device="cuda")
    nblocks = t // BLOCK_SIZE
    kv = torch.randn(2, nblocks, BLOCK_SIZE, hkv, dim, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(nblocks, device="cuda", dtype=torch.int32).view(nseq, -1)
    slots = (tables.long()[:, :, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device="cuda")).view(-1)
    store_kv(k, v, kv[0], kv[1], slots)
    flops = nseq * 4 * dim * hq * length * (length + 1) / 2          # causal QK^T and PV
    row = {"model": model, "seqs": nseq, "tokens": length, "flops": flops}
    out = torch.empty_like(q)
    paged = dict(seq_lens=seq_lens, k_cache=kv[0], v_cache=kv[1], block_tables=tables)
    for name, cfg in prefill_configs().items():
        for mode, extra in (("fresh", {}), ("paged", paged)):
            s = event_seconds(lambda cfg=cfg, extra=extra: varlen_prefill(q, k, v, starts, length, dim ** -0.5,
                                                                        cfg=cfg, out=out, **extra))
            row[f"{mode}:{name}"] = {"ms": s * 1e3, "tflops": flops / s / 1e12, "frac": flops / s / matmul_rate}
    group = hq // hkv
    qb = q.view(nseq, length, hq, dim).transpose(1, 2)
    kb = k.view(nseq, length, hkv, dim).transpose(1, 2).repeat_interleave(group, 1)
    vb = v.view(nseq, length, hkv, dim).transpose(1, 2).repeat_interleave(group, 1)
    s = event_seconds(lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True))
    row["torch_sdpa"] = {"ms": s * 1e3, "tflops": flops / s / 1e12, "frac": flops / s / matmul_rate}
    for mode in ("fresh", "paged"):
        row[f"best_{mode}"] = max((n for n in row if n.startswith(mode + ":")), key=lambda n: row[n]["tflops"])
    log(f"prefill {model} {nseq}x{length}: fresh {row['fresh:default']['tflops']:.0f} TFLOP/s, "
        f"paged {row['paged:default']['tflops']:.0f}, torch sdpa {row['torch_sdpa']['tflops']:.0f}; "
        f"best {row['best_fresh']} {row[row['best_fresh']]['tflops']:.0f} / "
        f"{row['best_paged']} {row[row['best_paged']]['tflops']:.0f}")
    return row


# -- layer ops --------------------------------------------------------------------------------
def bench_layer_ops(copy_bw: float) -> list[dict]:
    rows = []
    for tokens in (64, 4096):
        rows += layer_ops_shape(tokens, 4096, 12288, copy_bw)
    return rows


def layer_ops_shape(tokens: int, hidden: int, inter: int, copy_bw: float) -> list[dict]:
    from baton.engine.platforms.base import LayerOps
    from baton.engine.platforms.cuda import TritonLayerOps
    fused, plain = TritonLayerOps(), LayerOps()
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    res = torch.randn_like(x)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(tokens, 2 * inter, device="cuda", dtype=torch.bfloat16)
    cases = {   # (call, fewest bytes moved)
        "rms_norm": (lambda ops: ops.rms_norm(x, w, 1e-6), 2 * x.numel() * 2),
        "add_rms_norm": (lambda ops: ops.add_rms_norm(x, res, w, 1e-6), 4 * x.numel() * 2),
        "silu_and_mul": (lambda ops: ops.silu_and_mul(gate_up), 1.5 * gate_up.numel() * 2),
    }
    rows = []
    for name, (fn, moved) in cases.items():
        t_fused = graph_seconds_per_call([lambda fn=fn: fn(fused)] * 20)
        t_plain = graph_seconds_per_call([lambda fn=fn: fn(plain)] * 20)
        rows.append({"op": name, "tokens": tokens, "fused_us": t_fused * 1e6, "plain_us": t_plain * 1e6,
                     "speedup": t_plain / t_fused, "fused_bw_frac": moved / t_fused / copy_bw})
        log(f"{name} T={tokens}: fused {t_fused * 1e6:.1f} us, plain {t_plain * 1e6:.1f} us")
    return rows


# -- driver -----------------------------------------------------------------------------------
def run_tests(out_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:benchmark",
           "tests/test_platform_cuda.py"]
    if importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", "8"]
    log("running " + " ".join(cmd[2:]))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=360)
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        text, rc = f"{exc.stdout or ''}{exc.stderr or ''}\nTIMED OUT", -1
    (out_dir / "pytest.log").write_text(text)
    tail = [line for line in text.splitlines() if line.strip()][-40:]
    print("\n".join(tail), file=sys.stderr, flush=True)
    counts = [line for line in tail if re.search(r"\d+ (passed|failed|error)", line)]
    return {"rc": rc, "seconds": time.perf_counter() - t0, "summary": counts[-1] if counts else f"rc {rc}"}


def environment() -> dict:
    import triton
    props = torch.cuda.get_device_properties(0)
    env = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
           "triton": triton.__version__, "cuda": torch.version.cuda}
    try:
        env["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw", "--format=csv"],
            capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        env["nvidia_smi"] = f"unavailable: {exc}"
    return env


def table(results: dict) -> str:
    c = results["ceilings"]
    lines = [f"device {results['env']['device']} ({results['env']['sms']} SMs), {results['env']['date']}",
             f"tests: {results['tests']['summary']}",
             f"ceilings: copy {c['copy']['bytes_per_s'] / 1e12:.2f} TB/s (read+write), "
             f"bf16 matmul {c['matmul']['flops_per_s'] / 1e12:.0f} TFLOP/s",
             "", "decode (bf16, block 16)   default: us  %copyBW splits |  best config: us  %copyBW"]
    for r in results["decode"]:
        d, b = r["default"], r[r["best"]]
        wide = "*" if r.get("table_tokens", r["context"]) > r["context"] else " "
        lines.append(f"  {r['model']:<11} B={r['batch']:<4} ctx={r['context']:<5}{wide}{d['us']:8.1f} {d['bw_frac']:7.0%} "
                     f"{d['splits']:6d} | {r['best']:>9} {b['us']:8.1f} {b['bw_frac']:7.0%}")
    lines += ["  (* block tables 40960 tokens wide, as in a decode graph)"]
    lines += ["", "prefill (bf16, causal)     TFLOP/s (%matmul): fresh  paged | best fresh / paged | torch sdpa"]
    for r in results.get("prefill", []):
        f, p, s = r["fresh:default"], r["paged:default"], r["torch_sdpa"]
        bf, bp = r[r["best_fresh"]], r[r["best_paged"]]
        lines.append(f"  {r['model']:<11} {r['seqs']}x{r['tokens']:<5} {f['tflops']:6.0f} ({f['frac']:.0%}) "
                     f"{p['tflops']:6.0f} ({p['frac']:.0%}) | {r['best_fresh']}:{bf['tflops']:.0f} / "
                     f"{r['best_paged']}:{bp['tflops']:.0f} | {s['tflops']:.0f} ({s['frac']:.0%})")
    lines += ["", "layer ops (bf16, hidden 4096 / inter 12288)   fused us   plain us   speedup  fused %copyBW"]
    for r in results.get("layer_ops", []):
        lines.append(f"  {r['op']:<13} T={r['tokens']:<5} {r['fused_us']:9.1f} {r['plain_us']:10.1f} "
                     f"{r['speedup']:8.1f}x {r['fused_bw_frac']:9.0%}")
    lines += [f"ERROR in {name}: {tb.strip().splitlines()[-1]}" for name, tb in results.get("errors", {}).items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-results", help="folder for kernels_cuda.json and pytest.log")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--decode-cases", default=None, metavar="HQ/HKV:BxL,...",
                        help="only paged decode, every config on these cases (e.g. 32/4:128x512), block tables "
                             "as wide as a decode graph's")
    args = parser.parse_args()
    if not torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        raise SystemExit("baton.benchmarks.kernels_cuda needs a CUDA GPU and triton")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"command": "PYTHONUNBUFFERED=1 python3 -m baton.benchmarks.kernels_cuda --out $OUT",
                     "env": environment()}
    results["tests"] = {"summary": "skipped"} if args.skip_tests else run_tests(out_dir)
    from baton.benchmarks.ceilings import copy_bandwidth, matmul_rate
    log("measuring ceilings")
    results["ceilings"] = {"copy": copy_bandwidth("cuda", 1 << 30), "matmul": matmul_rate("cuda", 8192, torch.bfloat16)}
    copy_bw = results["ceilings"]["copy"]["bytes_per_s"]
    num_sms = results["env"]["sms"]
    sections = (("decode", lambda: bench_decode(num_sms, copy_bw)),
                ("prefill", lambda: bench_prefill(results["ceilings"]["matmul"]["flops_per_s"])),
                ("layer_ops", lambda: bench_layer_ops(copy_bw)))
    if args.decode_cases:
        sections = (("decode", lambda: bench_decode_cases(args.decode_cases, num_sms, copy_bw)),)
    for name, fn in sections:
        t0 = time.perf_counter()
        try:
            results[name] = fn()
        except Exception:     # keep the other sections' numbers; the traceback goes into the JSON
            results[name] = []
            results.setdefault("errors", {})[name] = traceback.format_exc()
            log(f"{name} FAILED:\n{results['errors'][name]}")
        log(f"{name} done in {time.perf_counter() - t0:.0f}s")
        (out_dir / "kernels_cuda.json").write_text(json.dumps(results, indent=1))
    print(table(results), flush=True)


if __name__ == "__main__":
    main()
