"""Where an FP8 KV cache's error comes from, layer by layer: each layer's attention output with its
K and V rounded to e4m3 as the cache holds them, at scale 1 and at the per-head scales Baton
calibrates at load (engine/runner/kv_scales.py), against the same attention on the unrounded K and V;
and K alone, V alone; and how much of K and V sits outside e4m3's normal range (|x| < 2^-6, or
beyond 448), the only place a scale can help: inside it, e4m3's step is relative (3 mantissa
bits), whatever the scale.

    python -m baton.benchmarks.kv_fp8_error --tokens 1024 --output kv-fp8-error.json

One forward without a cache over the first --tokens of quant_accuracy's fixed text; attention in
float64 (causal, the model's GQA), so the only difference between the rows is the rounding.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from baton.engine.platforms.base import as_cached
from baton.models.forward_context import ForwardContext

FP8 = torch.float8_e4m3fn
NORMAL_MIN = 2.0 ** -6


class _Capture(ForwardContext):
    """A cache-free forward that keeps every layer's q, k, v."""

    __slots__ = ("seen",)

    def attend(self, layer_idx, q, k, v):
        self.seen[layer_idx] = (q.double(), k.double(), v.double())
        return super().attend(layer_idx, q, k, v)


def _attention(q, k, v, scale):
    n, group = q.shape[0], q.shape[1] // k.shape[1]
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(group, 0),
                                         v.transpose(0, 1).repeat_interleave(group, 0), attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="baton.benchmarks.kv_fp8_error", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from baton.benchmarks.quant_accuracy import fixed_text
    from baton.engine import LLM
    from baton.models.attention_metadata import AttnMetadata
    llm = LLM(args.model, dtype="float32", kv_cache_dtype="fp8", max_model_len=args.tokens + 16,
              max_num_batched_tokens=max(2048, args.tokens))
    runner = llm.engine.runner
    ids = llm.engine.tokenizer.encode(fixed_text()[0])[:args.tokens]
    n = len(ids)
    meta = AttnMetadata(is_decode=False, slot_mapping=torch.full((n,), -1), query_start_loc=torch.tensor([0, n]),
                        seq_lens=torch.tensor([n]), block_tables=torch.zeros(1, 1, dtype=torch.int32),
                        max_query_len=n, max_seq_len=n, has_context=False, query_start_loc_cpu=[0, n],
                        seq_lens_cpu=[n])
    ctx = _Capture(meta, None, runner.attention, runner.scale)
    ctx.seen = {}
    with torch.inference_mode():
        runner.model(torch.tensor(ids), torch.arange(n), ctx)
    rows = []
    for layer in sorted(ctx.seen):
        q, k, v = ctx.seen[layer]
        ks, vs = runner.kv_scales[layer, 0].double(), runner.kv_scales[layer, 1].double()
        ref = _attention(q, k, v, runner.scale)
        k1, v1 = as_cached(k, FP8), as_cached(v, FP8)
        kh, vh = as_cached(k, FP8, ks), as_cached(v, FP8, vs)
        rows.append({
            "layer": layer,
            "attention_error_scale_one": _rel(_attention(q, k1, v1, runner.scale), ref),
            "attention_error_per_head_scales": _rel(_attention(q, kh, vh, runner.scale), ref),
            "attention_error_k_only": _rel(_attention(q, k1, v, runner.scale), ref),
            "attention_error_v_only": _rel(_attention(q, k, v1, runner.scale), ref),
            "k_amax": k.abs().amax().item(), "v_amax": v.abs().amax().item(),
            "k_below_normal": float((k.abs() < NORMAL_MIN).double().mean()),
            "v_below_normal": float((v.abs() < NORMAL_MIN).double().mean()),
            "k_scales": ks.tolist(), "v_scales": vs.tolist()})
        print(json.dumps({key: round(val, 4) if isinstance(val, float) else val for key, val in rows[-1].items()}),
              file=sys.stderr)
    mean = {key: sum(r[key] for r in rows) / len(rows) for key in rows[0] if key.startswith(("attention", "k_b", "v_b"))}
    rec = {"model": args.model, "tokens": n, "mean_over_layers": mean, "layers": rows}
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rec, f, indent=2)
    print(json.dumps({"tokens": n, "mean_over_layers": mean}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
