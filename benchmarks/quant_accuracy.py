"""What quantization costs in accuracy: perplexity and greedy next-token agreement of each mode
against full precision on a fixed text, through Baton's engine (prompt logprobs: the prefill
path, paged KV and all), and the same through transformers as a reference.

    python -m baton.benchmarks.quant_accuracy --output quant_accuracy.json
    python -m baton.benchmarks.quant_accuracy --modes full,fp8 --dtype bfloat16 --tokens 2048

The text: the source of this Python's own `argparse` module, then `textwrap` and `string` as far
as needed (fixed for a Python version; its sha256 is recorded), cut into non-overlapping
windows of --window tokens; each window's first token has no prediction, every other one
counts. Perplexity = exp(mean negative log-likelihood). Agreement: the share of positions
whose most likely next token is the full-precision mode's.

Modes: full (--dtype, weights and KV as is: the reference), fp8 (--quantization fp8), fp8+kv8
(and --kv-cache-dtype fp8), kv8 (the cache alone); fp8+kv8 and kv8 scale K and V per layer and kv
head (--kv-cache-scales calibrate, the default), fp8+kv8-one and kv8-one do not (scale 1). --dtype is the activations' dtype throughout
(default: the platform's, float32 on the CPU, where bf16 matmuls are several times slower).
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import importlib
import inspect
import json
import math
import platform
import sys
import time

MODULES = ("argparse", "textwrap", "string")
MODES = {"full": {}, "fp8": {"quantization": "fp8"}, "fp8+kv8": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
         "kv8": {"kv_cache_dtype": "fp8"},
         # the float8 cache unscaled (--kv-cache-scales one), against the per-head scales the others use
         "fp8+kv8-one": {"quantization": "fp8", "kv_cache_dtype": "fp8", "kv_cache_scales": "one"},
         "kv8-one": {"kv_cache_dtype": "fp8", "kv_cache_scales": "one"},
         # FP8 weights rounded with GPTQ's error feedback at load (--fp8-rounding gptq, engine/runner/fp8_rounding.py;
         # calibrated on CPython's help topics and two stdlib modules other than MODULES)
         "gptq": {"quantization": "fp8", "fp8_rounding": "gptq"},
         "gptq+kv8": {"quantization": "fp8", "fp8_rounding": "gptq", "kv_cache_dtype": "fp8"},
         # CUDA's FP8 GEMMs summed by the tensor cores alone (--fp8-accumulation fast; the CPU sums in float32)
         "fp8-fast": {"quantization": "fp8", "fp8_accumulation": "fast"},
         "gptq+kv8-fast": {"quantization": "fp8", "fp8_rounding": "gptq", "kv_cache_dtype": "fp8",
                           "fp8_accumulation": "fast"}}
TOLERANCE = 0.03        # the acceptance: within 3 % of full precision's perplexity


def fixed_text() -> tuple[str, str]:
    """(the text, where it came from)."""
    text = "\n\n".join(inspect.getsource(importlib.import_module(m)) for m in MODULES)
    return text, f"Python {platform.python_version()} stdlib sources: {', '.join(m + '.py' for m in MODULES)}"


def windows(ids: list[int], size: int, limit: int) -> list[list[int]]:
    ids = ids[:limit]
    return [ids[i:i + size] for i in range(0, len(ids) - 1, size) if len(ids[i:i + size]) > 1]


def baton_scores(model: str, device: str, dtype: str, mode: dict, chunks: list[list[int]]) -> dict:
    """Per predicted position: (logprob of the actual token, the most likely token)."""
    import torch

    from baton.engine import LLM, SamplingParams
    from baton.engine.config import EngineConfig
    if any(k not in EngineConfig.__dataclass_fields__ for k in mode):
        return {"skipped": f"this build has no {', '.join(k for k in mode if k not in EngineConfig.__dataclass_fields__)}"}
    width = max(len(c) for c in chunks)
    # the KV the windows need, no more (one engine per mode in one process: each must leave room
    # for the next, and gives its memory back when done)
    block = EngineConfig.__dataclass_fields__["block_size"].default
    blocks = len(chunks) * -(-(width + 16) // block) + 16
    llm = LLM(model, device=device, dtype=dtype, max_model_len=width + 16, enable_prefix_caching=False,
              max_num_batched_tokens=max(4096, width), num_kv_blocks=blocks, **mode)
    t0 = time.perf_counter()
    outs = llm.generate(chunks, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    lps, top = [], []
    for out in outs:
        for entry in out.prompt_logprobs[1:]:
            lps.append(entry.logprob)
            top.append(entry.top[0][0])
    return {"logprobs": lps, "top": top, "seconds": time.perf_counter() - t0}


def transformers_scores(path: str, device: str, dtype: str, chunks: list[list[int]], fp8: bool) -> dict:
    """transformers' own forward (bf16), or its FP8 path (FineGrainedFP8Config) where it loads."""
    import torch
    from transformers import AutoModelForCausalLM
    kwargs = {"dtype": getattr(torch, dtype)}

    def score(model) -> dict:
        lps, top = [], []
        with torch.inference_mode():
            for c in chunks:
                logits = model(torch.tensor([c], device=device)).logits[0, :-1].float()
                logp = torch.log_softmax(logits, dim=-1)
                lps += logp.gather(1, torch.tensor(c[1:], device=device)[:, None])[:, 0].tolist()
                top += logits.argmax(-1).tolist()
        return {"logprobs": lps, "top": top}

    if not fp8:
        return score(AutoModelForCausalLM.from_pretrained(path, **kwargs).to(device).eval())
    try:        # (loading or running: its kernel comes from the `kernels` package, which fetches it from the Hub)
        from transformers import FineGrainedFP8Config
        kwargs["quantization_config"] = FineGrainedFP8Config()
        return score(AutoModelForCausalLM.from_pretrained(path, device_map=device, **kwargs).eval())
    except Exception as exc:        # noqa: BLE001 (recorded: the reference may not exist here)
        return {"skipped": f"transformers' FP8 path (FineGrainedFP8Config) does not run here: "
                           f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}


def summarize(name: str, scores: dict, ref: dict | None) -> dict:
    if "skipped" in scores:
        return {"mode": name, **scores}
    nll = -sum(scores["logprobs"]) / len(scores["logprobs"])
    row = {"mode": name, "tokens": len(scores["logprobs"]), "perplexity": math.exp(nll), "nll": nll}
    if "seconds" in scores:
        row["seconds"] = round(scores["seconds"], 1)
    if ref is not None:
        agree = sum(a == b for a, b in zip(scores["top"], ref["top"], strict=True))
        row["greedy_agreement"] = agree / len(ref["top"])
        row["perplexity_vs_full"] = math.exp(nll) / math.exp(-sum(ref["logprobs"]) / len(ref["logprobs"])) - 1
        row["within_tolerance"] = abs(row["perplexity_vs_full"]) <= TOLERANCE
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="baton.benchmarks.quant_accuracy", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="preset or HF directory (real weights)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                   help="activations (and full mode's weights); default float32 on cpu, else bfloat16")
    p.add_argument("--modes", default="full,fp8,fp8+kv8,kv8", help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--window", type=int, default=2048, help="tokens per window (within the model's context)")
    p.add_argument("--tokens", type=int, default=20480, help="tokens of the text to score (>= 20k)")
    p.add_argument("--transformers", action=argparse.BooleanOptionalAction, default=True,
                   help="also score through transformers (bf16, and its FP8 path where it loads)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--output", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    from baton.models.source import resolve_model
    source = resolve_model(args.model)
    from transformers import AutoTokenizer
    text, origin = fixed_text()
    ids = AutoTokenizer.from_pretrained(source.tokenizer_dir())(text)["input_ids"]
    chunks = windows(ids, args.window, args.tokens)
    rec = {"model": args.model, "device": args.device, "dtype": args.dtype, "text": origin,
           "text_sha256": hashlib.sha256(text.encode()).hexdigest(), "text_tokens": len(ids),
           "scored_windows": len(chunks), "window": args.window, "torch": torch.__version__, "rows": []}
    ref = None
    for name in args.modes.split(","):
        scores = baton_scores(args.model, args.device, args.dtype, MODES[name], chunks)
        row = summarize(f"baton {args.dtype if name == 'full' else name}", scores, ref)
        ref = ref or (scores if "skipped" not in scores else None)
        rec["rows"].append(row)
        print(json.dumps(row), file=sys.stderr)
    if args.transformers and source.weights_path:
        for fp8 in (False, True):
            scores = transformers_scores(source.weights_path, args.device, args.dtype, chunks, fp8)
            row = summarize("transformers " + ("fp8" if fp8 else args.dtype), scores, ref)
            rec["rows"].append(row)
            print(json.dumps(row), file=sys.stderr)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rec, f, indent=2)
    print(json.dumps(rec, indent=2))
    return 0 if all(r.get("within_tolerance", True) for r in rec["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
