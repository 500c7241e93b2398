"""INT4 weight-only decode (issue 54): qwen3-8b's shapes with random AWQ weights (group 128) against bf16.

    python -m baton.benchmarks.int4_decode --out DIR [--device cuda:0] [--batches 1,4,8,16]
    python -m baton.benchmarks.int4_decode --out DIR --device cpu --tiny      # the CPU smoke (tests run it)

1. The GEMMs: per projection of qwen3-8b (qkv 6144x4096, o 4096x4096, gate_up 24576x4096, down 4096x12288) and
   per M, the bf16 GEMM against the platform's W4A16 matmul (CUDA: triton_kernels/w4a16.py's GEMM up to
   MAX_GEMM_M rows, dequantize + cuBLAS above), timed with triton's do_bench (L2 flushed), the error against
   the float32 product of the dequantized weight.
2. The decode step: an AWQ checkpoint of qwen3-8b's config with random 4-bit weights, zero points and
   scales (0.5 GB a billion weights) written to DIR/int4-ckpt and served through the loader as any AWQ
   checkpoint is; bf16 the qwen3-8b preset's random weights. Median step time at each batch, context 512,
   decode graphs (the engine's default).
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
import json
import statistics
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
        w = random_int4(n, k, device, gen)
        wide = int4.dequantize(w, torch.float32)                   # [N, K]
        dense = wide.to(dtype)
        for m in ms:
            x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
            ref = x.float() @ wide.t()
            got = platform.w4a16_matmul(x, w)
            err = float((got.float() - ref).norm() / ref.norm())
            t_bf16 = timer(lambda x=x, d=dense: torch.nn.functional.linear(x, d))
            t_int4 = timer(lambda x=x, w=w: platform.w4a16_matmul(x, w))
            emit({"kind": "gemm", "proj": name, "n": n, "k": k, "m": m, "dtype": str(dtype).split(".")[-1],
                  "bf16_us": round(t_bf16, 2), "w4a16_us": round(t_int4, 2), "speedup": round(t_bf16 / t_int4, 3),
                  "rel_err": err})
        del w, wide, dense


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
            files[layer].update({base + "qweight": w.qweight.reshape(k, n // 8), base + "qzeros": _awq_pack(w.zeros),
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


def _awq_pack(q: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C] -> AutoAWQ's int32 [R, C/8] (nibble i of a word: column AWQ_ORDER[i] of its eight)."""
    q = q.long().reshape(q.shape[0], -1, 8)[..., list(int4.AWQ_ORDER)]
    words = (q << torch.arange(0, 32, 4)).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def decode(model: str, device: str, batches: list[int], context: int, steps: int, tokenizer: str | None,
           eager: bool, tag: str, emit) -> None:
    from baton.benchmarks.decode_graphs import step_times
    from baton.engine import LLMEngine
    from baton.engine.config import EngineConfig
    cfg = EngineConfig(model=model, tokenizer=tokenizer, device=device, enforce_eager=eager, max_num_seqs=max(batches),
                       max_model_len=context + steps + 64, max_num_batched_tokens=8192,
                       gpu_memory_utilization=0.4)        # (both engines of the run fit one GPU: memory is not freed between)
    engine = LLMEngine(cfg)
    for b in batches:
        step_times(engine, b, context, 3)                            # warm-up
        t = step_times(engine, b, context, steps)
        emit({"kind": "decode", "weights": tag, "quantization": engine.runner.quantization, "batch": b,
              "context": context, "median_step_ms": round(1000 * statistics.median(t), 3),
              "p90_step_ms": round(1000 * sorted(t)[int(0.9 * len(t))], 3)})
    del engine


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
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sink = (out / "int4_decode.jsonl").open("a")

    def emit(row: dict) -> None:
        row = {"model": args.model + ("-tiny" if args.tiny else ""), "device": args.device, **row}
        print(json.dumps(row), flush=True)
        sink.write(json.dumps(row) + "\n")

    from baton.engine.config import PlatformOptions
    from baton.engine.platforms import get_platform
    from baton.models import source as model_source
    platform = get_platform(args.device, PlatformOptions())
    dtype = platform.default_dtype()
    source = model_source.resolve_model(args.model)
    hf_config = source.hf_config
    for key, value in (TINY.items() if args.tiny else ()):
        setattr(hf_config, key, value)
    skip = set(filter(None, args.skip.split(",")))
    if "gemm" not in skip:
        shapes = SHAPES if not args.tiny else {"o": (128, 128), "down": (128, 256)}
        gemms(platform, shapes, [int(m) for m in args.gemm_ms.split(",")], dtype, emit)
    if "decode" not in skip:
        batches = [int(b) for b in args.batches.split(",")]
        eager = platform.device.type == "cpu"
        tokenizer = args.tokenizer or environment.get(environment.twin("--tokenizer")) or source.tokenizer_dir()
        t0 = time.perf_counter()
        ckpt = write_awq_checkpoint(hf_config, out / "int4-ckpt", tokenizer)
        print(f"[int4] wrote {ckpt} in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
        decode(str(ckpt), args.device, batches, args.context, args.steps, tokenizer, eager, "int4-awq-g128", emit)
        if args.tiny:                 # the bf16 side of the same tiny config: the int4 checkpoint's shapes
            bf16 = out / "bf16-ckpt"
            _bf16_checkpoint(ckpt, bf16)
            decode(str(bf16), args.device, batches, args.context, args.steps, tokenizer, eager, "bf16", emit)
        else:
            decode(args.model, args.device, batches, args.context, args.steps, tokenizer, eager, "bf16", emit)
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
