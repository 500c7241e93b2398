"""INT4 weight-only decode (issue 54): qwen3-8b's shapes with random AWQ weights (group 128) against bf16.

    python -m baton.benchmarks.int4_decode --out DIR [--device cuda:0] [--batches 1,4,8,16]
    python -m baton.benchmarks.int4_decode --out DIR --device cpu --tiny      # the CPU smoke (tests run it)
    python -m baton.benchmarks.int4_decode --out DIR --sweep --skip decode    # the kernels' configs, timed

1. The GEMMs: per projection of qwen3-8b (qkv 6144x4096, o 4096x4096, gate_up 24576x4096, down 4096x12288) and
   per M, the bf16 GEMM against the platform's W4A16 matmul (CUDA: triton_kernels/w4a16.py's GEMM up to
   MAX_GEMM_M rows, dequantize + cuBLAS above), timed with triton's do_bench (L2 flushed), the error against
   the float32 product of the dequantized weight.
   --sweep first times each candidate config (kernel, tile, split-K, warps, stages) of the W4A16 kernels at
   each shape and M bucket (rows kind "sweep"), and prints the best per shape as w4a16.TABLE's entries.
2. The decode step: an AWQ checkpoint of qwen3-8b's config with random 4-bit weights, zero points and
   scales (0.5 GB a billion weights) written to DIR/int4-ckpt and served through the loader as any AWQ
   checkpoint is; bf16 the qwen3-8b preset's random weights. Median step time at each batch, context 512,
   decode graphs (the engine's default). Each engine runs in a process of its own (bf16 first), so the first
   one's memory is given back before the second starts. --reduce kernel,separate decodes INT4 twice: split-K's
   partials added in the kernels' last program (the default) and by a second kernel; --profile-batches 1 adds
   each engine's device time per kernel at batch 1.
One JSON line per measurement on stdout, all of them in DIR/int4_decode.jsonl.

The ceiling (predicted, not measured): a decode step at small batch streams the weights once. qwen3-8b's
projections are 6.9 G weights (13.9 GB in bf16); AWQ group 128 reads 4 bits a weight plus a fp16 scale and a
byte of zero point per 128 (4.19 bits; 4.5 counting the packing's worst case), 3.6-3.8 GB: the projections
up to 16/4.5 = ~3.5x faster at memory-bound batch sizes (1-16), the step less (the embedding / LM head's 1.2 GB
of bf16, attention and the launches stay): at 4.8 TB/s, bf16's ~15.1 GB is ~3.1 ms a step, INT4's ~5 GB ~1.05 ms
(2.9x). The GEMM's own overhead (unpacking in registers, the zero points and the scales) is what
the measurement shows on top.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from baton import environment
from baton.models.layers import int4

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32)
GROUP = 128


def random_int4(n: int, k: int, device, gen: torch.Generator, group: int = GROUP) -> int4.Int4Weight:
    """A random INT4 weight [N, K] in the packed layout (models/layers/int4.py), |w| ~ 0.02."""
    qweight = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // 8, n), dtype=torch.int32, generator=gen)
    zeros = torch.randint(6, 10, (k // group, n), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(k // group, n, generator=gen) * 0.002 + 0.002).half()
    return int4.Int4Weight(qweight.to(device), scales.to(device), zeros.to(device), None, group, k, n)


def _timer(device: torch.device):
    if device.type == "cuda":
        from triton.testing import do_bench
        return lambda fn: 1000 * do_bench(fn)                      # microseconds
    def cpu(fn, reps: int = 3) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return 1e6 * (time.perf_counter() - t0) / reps
    return cpu


def gemms(platform, shapes: dict, ms: list[int], dtype: torch.dtype, emit) -> None:
    """bf16 (the model dtype) GEMM vs the platform's W4A16 matmul, per shape and M."""
    device, timer = platform.device, _timer(platform.device)
    gen = torch.Generator().manual_seed(0)
    for name, (n, k) in shapes.items():
        canonical = random_int4(n, k, device, gen)
        wide = int4.dequantize(canonical, torch.float32)           # [N, K]
        dense = wide.to(dtype)
        w = platform.w4a16_layout(canonical, dtype)                # as the loader lays it out
        for m in ms:
            x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
            ref = x.float() @ wide.t()
            got = platform.w4a16_matmul(x, w)
            err = float((got.float() - ref).norm() / ref.norm())
            t_bf16 = timer(lambda x=x, d=dense: torch.nn.functional.linear(x, d))
            t_int4 = timer(lambda x=x, w=w: platform.w4a16_matmul(x, w))
            row = {"kind": "gemm", "proj": name, "n": n, "k": k, "m": m, "dtype": str(dtype).split(".")[-1],
                   "bf16_us": round(t_bf16, 2), "w4a16_us": round(t_int4, 2), "speedup": round(t_bf16 / t_int4, 3),
                   "rel_err": err}
            if device.type == "cuda":           # split-K added by a second kernel, as before: time, same sums?
                _set_reduce("cuda", "separate")
                row["w4a16_separate_reduce_us"] = round(timer(lambda x=x, w=w: platform.w4a16_matmul(x, w)), 2)
                row["same_as_separate_reduce"] = bool(torch.equal(platform.w4a16_matmul(x, w), got))
                _set_reduce("cuda", "kernel")
            emit(row)
        del w, canonical, wide, dense


def _candidates(m: int) -> list:
    """The configs --sweep times at M rows (triton_kernels/w4a16.py's W4a16Config). At M = 2-16 (the decode
    batches): the multi-row GEMV (gemvm: 2, 4 or 8 rows a program, the tiles without spills in ptxas's sm_90
    code) and the dots' tiles that won the last sweep, split-K 2-16, 17-20 configs a shape."""
    from baton.engine.platforms.triton_kernels.w4a16 import W4a16Config as C
    splits = (1, 2, 4, 8, 16, 32)
    out = []
    if 2 <= m <= 16:
        rows = {2: ((2, 128, 4), (2, 256, 4)), 4: ((4, 128, 8), (4, 256, 4), (2, 256, 4)),
                8: ((8, 128, 8), (4, 128, 8), (4, 256, 4)), 16: ((8, 128, 8), (4, 256, 4))}[_bucket(m)]
        out += [C("gemvm", bn, sp, r, warps) for r, bn, warps in rows for sp in (4, 8, 16)]
        if m == 2:
            out += [C("gemv", 256, sp, num_warps=4) for sp in (4, 8, 16)]
        out += [C("dotshift", 128, sp, 16, warps, 3) for warps in (4, 8) for sp in (2, 4, 8, 16)]
        out += [C("dot", 128, sp, 16, 4, 3) for sp in (4, 8, 16)]
        return out
    if m == 1:
        for bn, warps in ((256, 4), (128, 4), (64, 2), (256, 8), (512, 8)):
            out += [C("gemv", bn, sp, num_warps=warps) for sp in splits]
        out += [C("dot", 128, sp, 16, 4, 3) for sp in (2, 4, 8, 16)]
        return out
    tiles = ((128, 8, 3), (128, 8, 4), (128, 4, 3), (64, 4, 3))
    for bn, warps, stages in tiles:
        out += [C("dot", bn, sp, m, warps, stages) for sp in splits[:5]]
    out += [C("dotshift", bn, sp, m, warps, stages) for bn, warps, stages in tiles[:3] for sp in splits[:5]]
    out.append(C("cublas", 0))
    return out


def _bucket(m: int) -> int:
    return 1 << (m - 1).bit_length()


GRAPH_BYTES = 256 << 20       # the weight copies a graph-timed call cycles through (5x the H200's L2)


def _graph_us(calls: list) -> float:
    """Microseconds a call with `calls` captured back to back in one CUDA graph, as the decode step's graph runs
    its projections: no host launch cost (which do_bench of the Python op adds: 20-40 us), each call reading its
    own copy of the weight so L2 does not keep it between calls."""
    from triton.testing import do_bench
    for call in calls:
        call()                                   # compiled, the split-K tickets made, before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    us = 1000 * do_bench(graph.replay, warmup=3, rep=20) / len(calls)
    del graph
    return us


def sweep(platform, shapes: dict, ms: list[int], dtype: torch.dtype, emit, budget_s: float = 1e9,
          graphs: bool = True) -> None:
    """Each candidate config of the W4A16 kernels timed at each M (in the order given) and shape, the best per
    shape printed as w4a16.TABLE entries. `graphs`: each config's calls (one a weight copy: GRAPH_BYTES in all)
    replayed in a CUDA graph (_graph_us); else do_bench of one Python call, L2 flushed (host-bound for the small
    shapes). A config that fails is reported and skipped; past `budget_s` the sweep stops (what it measured is
    printed)."""
    from triton.testing import do_bench

    from baton.engine.platforms.triton_kernels import w4a16
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for name, (n, k) in shapes.items():
        canonical = random_int4(n, k, platform.device, gen)
        wide = int4.dequantize(canonical, torch.float32)
        packed = w4a16.relayout(canonical)
        copies = -(-GRAPH_BYTES // (packed.qweight.numel() * 4)) if graphs else 1
        packs = [packed] + [packed._replace(qweight=packed.qweight.clone(), scales=packed.scales.clone(),
                                            zeros=packed.zeros.clone()) for _ in range(copies - 1)]
        denses = [wide.to(dtype) for _ in range(copies)]
        weights[name] = (wide, denses, packs)
    best, t0 = {}, time.perf_counter()
    for m in ms:
        for name, (n, k) in shapes.items():
            if time.perf_counter() - t0 > budget_s:
                print(f"[sweep] past the {budget_s:.0f} s budget: stopped before m={m} {name}", file=sys.stderr, flush=True)
                break
            print(f"[sweep] m={m} {name} at {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            wide, denses, packs = weights[name]
            x = torch.randn(m, k, generator=gen).to(device=platform.device, dtype=dtype)
            ref = x.float() @ wide.t()
            linears = [functools.partial(torch.nn.functional.linear, x, d) for d in denses]
            t_bf16 = _graph_us(linears) if graphs else 1000 * do_bench(linears[0], warmup=5, rep=25)
            rows = []
            for cfg in _candidates(m):
                if cfg.kernel != "cublas" and k % (cfg.split_k * w4a16.BLOCK_ROWS):
                    continue
                calls = [(lambda x=x, w=w: x @ w4a16.w4a16_dequantize(w, dtype)) if cfg.kernel == "cublas"
                         else functools.partial(w4a16.w4a16_gemm, x, w, cfg) for w in packs]
                try:
                    err = float((calls[0]().float() - ref).norm() / ref.norm())
                    t = _graph_us(calls) if graphs else 1000 * do_bench(calls[0], warmup=3, rep=15)
                except Exception as e:                        # noqa: BLE001 (a tile the GPU refuses)
                    print(f"[sweep] {name} m={m} {cfg}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr, flush=True)
                    continue
                if err < 1e-2:
                    rows.append((t, cfg))
                emit({"kind": "sweep", "proj": name, "n": n, "k": k, "m": m, "config": list(_fields(cfg)),
                      "w4a16_us": round(t, 2), "bf16_us": round(t_bf16, 2), "speedup": round(t_bf16 / t, 3),
                      "rel_err": round(err, 5), "timing": "graph" if graphs else "call"})
            if rows:
                t, cfg = min(rows, key=lambda r: r[0])
                best[(n, k, m)] = cfg
                emit({"kind": "sweep-best", "proj": name, "n": n, "k": k, "m": m, "config": list(_fields(cfg)),
                      "w4a16_us": round(t, 2), "bf16_us": round(t_bf16, 2), "speedup": round(t_bf16 / t, 3)})
            print("TABLE = {" + "".join(f"\n    ({n}, {k}, {m}): W4a16Config{_fields(c)}," for (n, k, m), c in best.items())
                  + "\n}", file=sys.stderr, flush=True)
    del weights


def _fields(cfg) -> tuple:
    return (cfg.kernel, cfg.block_n, cfg.split_k, cfg.block_m, cfg.num_warps, cfg.num_stages)


def write_awq_checkpoint(hf_config, path: Path, tokenizer: str | None, seed: int = 0) -> Path:
    """An AWQ (GEMM, group 128) checkpoint of `hf_config`'s shapes with random weights, one file a layer."""
    from safetensors.torch import save_file

    from baton.models.loader import checkpoint_shapes
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    files, current = {}, None
    for name, shape in checkpoint_shapes(hf_config):
        layer = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        files.setdefault(layer, {})
        if current is not None and current != layer and current in files:
            save_file(files.pop(current), str(path / f"model-{current}.safetensors"))
        current = layer
        if name.endswith("proj.weight") and name.startswith("model.layers."):
            n, k = shape                 # random words are random nibbles in AWQ's order as in any other
            w = random_int4(n, k, "cpu", gen)
            base = name[: -len("weight")]
            files[layer].update({base + "qweight": w.qweight.reshape(k, n // 8), base + "qzeros": int4.pack_columns(w.zeros, awq=True),
                                 base + "scales": w.scales})
        elif len(shape) == 1:
            files[layer][name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            files[layer][name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
    for layer, tensors in files.items():
        save_file(tensors, str(path / f"model-{layer}.safetensors"))
    config = hf_config.to_dict()
    if len(config.get("layer_types") or ()) != config["num_hidden_layers"]:
        config.pop("layer_types", None)            # (--tiny: the preset's list is the full model's)
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                                     "version": "gemm"}
    config["torch_dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(config))
    if tokenizer:
        for f in Path(tokenizer).iterdir():
            if f.name.startswith(("tokenizer", "special_tokens")):
                (path / f.name).write_bytes(f.read_bytes())
    return path


def _set_reduce(device: str, reduce: str) -> None:
    """Where the W4A16 kernels' split-K partials are added (CUDA): in the kernel's last program, or by a second
    kernel (w4a16.FOLD_SPLIT_K), for this process."""
    if device.startswith("cuda"):
        from baton.engine.platforms.triton_kernels import w4a16
        w4a16.FOLD_SPLIT_K = reduce == "kernel"


def _profiled_kernels(engine, batch: int, context: int, steps: int, top: int) -> dict:
    """Device time per kernel over `steps` decode steps at `batch` (graph replays: CUPTI sees each node)."""
    from torch.profiler import ProfilerActivity, profile

    from baton.benchmarks.decode_graphs import step_times
    from baton.benchmarks.profile_steps import kernel_times
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step_times(engine, batch, context, steps)
    torch.cuda.synchronize()
    # (the profile spans the prompts' prefill too: its kernels are the big GEMMs, listed apart by name)
    total_ms, rows = kernel_times(prof, steps, top)
    return {"kernel_ms_per_step": round(total_ms, 3), "top": rows}


def decode(model: str, device: str, batches: list[int], context: int, steps: int, tokenizer: str | None,
           eager: bool, tag: str, emit, profile_batches: tuple[int, ...] = ()) -> None:
    from baton.benchmarks.decode_graphs import step_times
    from baton.engine import LLMEngine
    from baton.engine.config import EngineConfig
    cfg = EngineConfig(model=model, tokenizer=tokenizer, device=device, enforce_eager=eager, max_num_seqs=max(batches),
                       max_model_len=context + steps + 64, max_num_batched_tokens=8192,
                       gpu_memory_utilization=0.85)       # (each engine in a process of its own: main's _decode_in_process)
    engine = LLMEngine(cfg)
    for b in batches:
        step_times(engine, b, context, 3)                            # warm-up
        t = step_times(engine, b, context, steps)
        emit({"kind": "decode", "weights": tag, "quantization": engine.runner.quantization, "batch": b,
              "context": context, "median_step_ms": round(1000 * statistics.median(t), 3),
              "p90_step_ms": round(1000 * sorted(t)[int(0.9 * len(t))], 3)})
        if b in profile_batches and engine.platform.device.type == "cuda":
            emit({"kind": "profile", "weights": tag, "batch": b, "context": context,
                  **_profiled_kernels(engine, b, context, steps, 16)})
    del engine


def _decode_in_process(args, model: str, tag: str, tokenizer: str | None, reduce: str = "kernel") -> None:
    """decode() in a child process (this module with --decode-only), so its engine's memory is the process's
    and is given back when it exits; its rows go to the same stdout and jsonl."""
    cmd = [sys.executable, "-m", "baton.benchmarks.int4_decode", "--out", args.out, "--device", args.device,
           "--model", args.model, "--batches", args.batches, "--context", str(args.context), "--steps",
           str(args.steps), "--decode-only", model, "--decode-tag", tag, "--reduce", reduce,
           "--profile-batches", args.profile_batches] + (["--tiny"] if args.tiny else [])
    if tokenizer:
        cmd += ["--tokenizer", tokenizer]
    run = subprocess.run(cmd, stdout=sys.stdout, stderr=sys.stderr)
    if run.returncode:
        print(f"[int4] the {tag} decode process exited {run.returncode}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for int4_decode.jsonl (and the written checkpoint)")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--model", default="qwen3-8b", help="the preset whose shapes are measured")
    p.add_argument("--batches", default="1,4,8,16")
    p.add_argument("--gemm-ms", default="1,4,8,16,64,256", help="M of the GEMM comparison")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (unset: the preset's)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer, 128-wide config of the preset (a smoke run)")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: gemm, decode")
    p.add_argument("--sweep", action="store_true", help="time the W4A16 kernels' candidate configs first (CUDA)")
    p.add_argument("--sweep-ms", default="2,4,8,16", help="M of the sweep, in this order (1, 32, 64: the others)")
    p.add_argument("--sweep-budget-s", type=float, default=270, help="the sweep stops after this many seconds")
    p.add_argument("--sweep-timing", default="graph", choices=("graph", "call"),
                   help="graph: each config's calls replayed in a CUDA graph, one weight copy a call (as in the "
                        "decode step); call: do_bench of one Python call (adds its host launch cost)")
    p.add_argument("--reduce", default="kernel",
                   help="where split-K's partials are added, comma-separated to decode INT4 once each: kernel (the "
                        "last program, the default) | separate (a second kernel, as before)")
    p.add_argument("--profile-batches", default="", help="batches whose decode steps are also profiled (CUDA): "
                   "device time per kernel")
    p.add_argument("--decode-only", default=None, help=argparse.SUPPRESS)     # (the child process: this model)
    p.add_argument("--decode-tag", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sink = (out / "int4_decode.jsonl").open("a")

    def emit(row: dict) -> None:
        row = {"model": args.model + ("-tiny" if args.tiny else ""), "device": args.device, **row}
        print(json.dumps(row), flush=True)
        sink.write(json.dumps(row) + "\n")
        sink.flush()

    from baton.engine.config import PlatformOptions
    from baton.engine.platforms import get_platform
    from baton.models import source as model_source
    platform = get_platform(args.device, PlatformOptions())
    dtype = platform.default_dtype()
    source = model_source.resolve_model(args.model)
    hf_config = source.hf_config
    for key, value in (TINY.items() if args.tiny else ()):
        setattr(hf_config, key, value)
    reduces = args.reduce.split(",")
    if not set(reduces) <= {"kernel", "separate"}:
        p.error(f"--reduce takes kernel and/or separate, not {args.reduce!r}")
    profile_batches = tuple(int(b) for b in args.profile_batches.split(",") if b)
    if args.decode_only:
        eager = platform.device.type == "cpu"
        _set_reduce(args.device, reduces[0])
        decode(args.decode_only, args.device, [int(b) for b in args.batches.split(",")], args.context, args.steps,
               args.tokenizer, eager, args.decode_tag, emit, profile_batches)
        sink.close()
        return
    skip = set(filter(None, args.skip.split(",")))
    if args.sweep:
        sweep(platform, SHAPES, [int(m) for m in args.sweep_ms.split(",")], dtype, emit, args.sweep_budget_s,
              args.sweep_timing == "graph")
    if "gemm" not in skip:
        shapes = SHAPES if not args.tiny else {"o": (128, 128), "down": (128, 256)}
        gemms(platform, shapes, [int(m) for m in args.gemm_ms.split(",")], dtype, emit)
    if "decode" not in skip:
        tokenizer = args.tokenizer or environment.get(environment.twin("--tokenizer")) or source.tokenizer_dir()
        t0 = time.perf_counter()
        ckpt = write_awq_checkpoint(hf_config, out / "int4-ckpt", tokenizer)
        print(f"[int4] wrote {ckpt} in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
        if args.tiny:                 # the bf16 side of the same tiny config: the int4 checkpoint's shapes
            bf16 = out / "bf16-ckpt"
            _bf16_checkpoint(ckpt, bf16)
        sink.flush()
        _decode_in_process(args, str(bf16) if args.tiny else args.model, "bf16", tokenizer)
        for reduce in reduces:
            tag = "int4-awq-g128" + ("" if reduce == "kernel" else "-separate-reduce")
            _decode_in_process(args, str(ckpt), tag, tokenizer, reduce)
    sink.close()
    print("done", file=sys.stderr)


def _bf16_checkpoint(src: Path, dst: Path) -> None:
    """The dequantized copy of an AWQ checkpoint written here (the tiny smoke's bf16 side)."""
    from safetensors.torch import load_file, save_file
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.glob("*.safetensors"):
        tensors = load_file(f)
        plain = {}
        for name, t in tensors.items():
            if name.endswith("qweight"):
                base = name[: -len("qweight")]
                q = int4.unpack_columns(t, awq=True)
                z = int4.unpack_columns(tensors[base + "qzeros"], awq=True)
                w = int4.Int4Weight(int4.pack_rows(q), tensors[base + "scales"], z, None, GROUP, q.shape[0], q.shape[1])
                plain[base + "weight"] = int4.dequantize(w, torch.bfloat16).contiguous()
            elif not name.endswith(("qzeros", "scales")):
                plain[name] = t
        save_file(plain, str(dst / f.name))
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(config))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (dst / f.name).write_bytes(f.read_bytes())


if __name__ == "__main__":
    main()
