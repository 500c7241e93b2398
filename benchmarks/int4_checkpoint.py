"""A real INT4 checkpoint, made here, and what it costs in perplexity (issue 54).

    python -m baton.benchmarks.int4_checkpoint --out-dir DIR --output int4_checkpoint.json
    python -m baton.benchmarks.int4_checkpoint --out-dir DIR --groups 64 --roundings gptq --no-measure

No INT4 checkpoint can be downloaded here, so one is made from the only real weights at hand (default: the
embedded SmolLM2-135M-Instruct): every decoder projection quantized to 4 bits a weight, asymmetric, one fp16
scale and one 4-bit zero point per group of input rows and output column (the scale and zero from the group's
min and max, widened to hold 0, as AutoGPTQ's quantizer sets them with sym false), and written in AutoGPTQ's
on-disk format (quant_method gptq, checkpoint_format gptq_v2, with g_idx), which Baton loads as any GPTQ
checkpoint (models/layers/int4.py). The embedding, the norms and the (tied) LM head stay as they are.

Roundings:
  rtn   each weight to the nearest step of its group's grid;
  gptq  the same grid, the columns rounded in turn and each one's error spread over the columns not rounded
        yet as the inverse of the layer's input Hessian weighs them (Frantar et al., 2022), a group's scale and
        zero set from its weights as they stand when its first column is reached (AutoGPTQ without static
        groups); calibrated layer by layer on --calibration-tokens (2k: the first 1,024 of each) of
        engine/runner/fp8_rounding.py's texts (CPython's help topics and two stdlib modules), through the layers
        already rounded;
  gptq-act  GPTQ with act-order (desc_act): the rows rounded, and grouped, in order of the Hessian's diagonal,
        largest first (g_idx unsorted; the loader sorts the groups back).
Then each checkpoint's perplexity and greedy next-token agreement against the full-precision model, through
Baton's engine, on benchmarks/quant_accuracy.py's text (three other stdlib modules: no overlap with the
calibration). The issue's bar: within 5 % of full precision's perplexity.

Groups: SmolLM2-135M's hidden size, 576, is not a multiple of 128; 64 and 32 tile every projection. Its
weights are themselves dequantized from the GGUF's Q4_1 (4-bit, blocks of 32 along the input, a float minimum
a block): groups of 32 sit on those blocks, but a 4-bit integer zero point cannot hold Q4_1's minimum, so every
weight is rounded a second time (docs/benchmarks.md has what that costs).
"""
from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
from pathlib import Path

import torch

TOLERANCE = 0.05            # the bar: perplexity within 5 % of full precision's
LEVELS = 15                 # 4 bits: q in 0..15
CALIBRATION_TOKENS = 2048   # GPTQ's Hessians from this many tokens (its paper: 128 windows of 2,048). Each layer's
                            # calibration re-runs the layers before it, so the cost is tokens x layers^2: ~1 min
                            # for the 135M model on two cores, ~4 at 8k (which scored no better: docs/benchmarks.md)


def group_grid(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale [N], zero [N]) of the asymmetric 4-bit grid of a group's weights w [N, g]: the range widened to
    hold 0, the scale rounded to fp16 as the checkpoint stores it."""
    hi, lo = w.amax(1).clamp(min=0), w.amin(1).clamp(max=0)
    scale = ((hi - lo).clamp(min=1e-5) / LEVELS).half().float()
    return scale, torch.round(-lo / scale).clamp(0, LEVELS)


def quantize_int4(w: torch.Tensor, group: int, hessian: torch.Tensor | None = None, damp: float = 0.01,
                  block: int = 128, act_order: bool = False) -> tuple[torch.Tensor, ...]:
    """w [N, K] to 4 bits per group of `group` input rows: (q uint8 [K, N], scales fp16 [G, N],
    zeros uint8 [G, N], g_idx int32 [K]: each input row's group), w ~ (q - zero[g_idx]) * scale[g_idx].
    Without a Hessian, to nearest; with one ([K, K], the sum of x^T x over the layer's inputs), GPTQ's error
    feedback (the module's docstring); `act_order` (GPTQ's desc_act): the rows rounded, and grouped, in order of
    their Hessian diagonal, largest first, so g_idx is not sorted. float32 on w's device."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"group {group} does not divide the {k} input features")
    perm = torch.arange(k, device=w.device)
    if act_order and hessian is not None:
        perm = torch.argsort(torch.diagonal(hessian), descending=True)
        w, hessian = w[:, perm], hessian[perm][:, perm]
    q, scales, zeros = _round(w, group, hessian, damp, block)
    rows = torch.empty_like(perm)
    rows[perm] = torch.arange(k, device=w.device)            # row r was rounded as the rows[r]-th
    return q[rows], scales, zeros, (rows // group).to(torch.int32)


def _round(w: torch.Tensor, group: int, hessian: torch.Tensor | None, damp: float,
           block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_int4 on the rows as they are ordered: (q [K, N], scales, zeros)."""
    n, k = w.shape
    w = w.float().clone()
    u = None
    if hessian is not None:
        h = hessian.float().clone()
        dead = torch.diagonal(h) == 0                 # inputs always zero: their weights do not matter
        h[dead, dead] = 1
        w[:, dead] = 0
        torch.diagonal(h).add_(damp * torch.diagonal(h).mean())
        u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.empty(n, k, dtype=torch.uint8, device=w.device)
    scales = torch.empty(k // group, n, device=w.device)
    zeros = torch.empty(k // group, n, device=w.device)
    block = max(1, block // group) * group            # blocks of whole groups
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        wb, err = w[:, b0:b1].clone(), torch.zeros(n, b1 - b0, device=w.device)
        for j in range(b1 - b0):
            col = b0 + j
            if col % group == 0:
                scale, zero = group_grid(wb[:, j:j + group])
                scales[col // group], zeros[col // group] = scale, zero
            qj = torch.round(wb[:, j] / scale + zero).clamp(0, LEVELS)
            q[:, col] = qj.to(torch.uint8)
            if u is not None:
                err[:, j] = (wb[:, j] - (qj - zero) * scale) / u[col, col]
                wb[:, j:] -= err[:, j:j + 1] * u[col:col + 1, col:b1]
        if u is not None:
            w[:, b1:] -= err @ u[b0:b1, b1:]
    return q.t().contiguous(), scales.half(), zeros.to(torch.uint8)


def _split(name: str, q, scales, zeros, g_idx, hf) -> dict[str, tuple]:
    """Baton's fused projections (qkv_proj, gate_up_proj) back into the checkpoint's (q/k/v, gate/up), by
    output columns; GPTQ rounds each output row alone, so the split changes nothing."""
    base, proj = name.rsplit(".", 1)
    if proj == "qkv_proj":
        head = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        sizes = {"q_proj": hf.num_attention_heads * head, "k_proj": hf.num_key_value_heads * head,
                 "v_proj": hf.num_key_value_heads * head}
    elif proj == "gate_up_proj":
        sizes = {"gate_proj": hf.intermediate_size, "up_proj": hf.intermediate_size}
    else:
        return {name: (q, scales, zeros, g_idx)}
    out, start = {}, 0
    for part, size in sizes.items():
        cols = slice(start, start + size)
        out[f"{base}.{part}"] = (q[:, cols], scales[:, cols], zeros[:, cols], g_idx)
        start += size
    return out


@torch.no_grad()
def make_checkpoint(model: str, out: Path, group: int, rounding: str, act_order: bool = False,
                    calibration_tokens: int = CALIBRATION_TOKENS) -> dict:
    """`model`'s INT4 GPTQ checkpoint in `out` (the module's docstring); returns what was done."""
    from safetensors.torch import load_file, save_file

    from baton.engine import LLM
    from baton.engine.runner import fp8_rounding
    from baton.models.layers import int4
    from baton.models.source import resolve_model
    source = resolve_model(model)
    if source.weights_path is None:
        raise ValueError(f"{model} has random weights (a preset): give a model with real weights")
    hf = source.hf_config
    llm = LLM(model, device="cpu", dtype="float32", num_kv_blocks=16, max_model_len=256)
    runner = llm.engine.runner
    packed: dict[str, tuple] = {}
    t0 = time.perf_counter()

    def round_layer(name: str, module: torch.nn.Module, hessian: torch.Tensor | None) -> None:
        q, scales, zeros, g_idx = quantize_int4(module.weight.data, group, hessian, act_order=act_order)
        g = g_idx.long()
        module.weight.data.copy_(((q.float() - zeros.float()[g]) * scales.float()[g]).t())
        packed.update(_split(name, q, scales, zeros, g_idx, hf))

    if act_order and rounding != "gptq":
        raise ValueError("act-order orders the rows by GPTQ's Hessian: it goes with --roundings gptq")
    if rounding == "gptq":        # the next layer calibrates on what the rounded ones give it, as GPTQ does
        windows = fp8_rounding.calibration_windows(source.tokenizer_dir(), getattr(hf, "max_position_embeddings", 2048),
                                                   calibration_tokens)
        fp8_rounding.calibrate_layers(runner.model, runner.platform, runner.model.head_dim ** -0.5, windows,
                                      runner.device, round_layer, "INT4 weights")
    elif rounding == "rtn":
        for name, module in int4.int4_layers(runner.model):
            round_layer(name, module, None)
    else:
        raise ValueError(f"rounding must be rtn or gptq, not {rounding!r}")
    seconds = time.perf_counter() - t0
    del llm
    tensors = {}
    for f in sorted(Path(source.weights_path).glob("*.safetensors")):
        for key, t in load_file(f).items():
            stem = key[: -len(".weight")]
            if stem in packed:
                q, scales, zeros, g_idx = packed.pop(stem)
                tensors[f"{stem}.qweight"] = int4.pack_rows(q.contiguous())
                tensors[f"{stem}.qzeros"] = int4.pack_columns(zeros.contiguous())
                tensors[f"{stem}.scales"] = scales.contiguous()
                tensors[f"{stem}.g_idx"] = g_idx.clone()          # (one per projection: q, k, v share theirs)
            else:
                tensors[key] = t
    if packed:
        raise RuntimeError(f"projections not found in the checkpoint: {sorted(packed)[:4]}")
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((Path(source.weights_path) / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order,
                                     "sym": False, "checkpoint_format": "gptq_v2"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in Path(source.weights_path).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
            shutil.copyfile(f, out / f.name)
    return {"checkpoint": str(out), "group": group, "rounding": rounding, "act_order": act_order,
            "calibration_tokens": calibration_tokens if rounding == "gptq" else 0, "seconds": round(seconds, 1),
            "bytes": (out / "model.safetensors").stat().st_size}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="baton.benchmarks.int4_checkpoint", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="a model with real weights (HF directory)")
    p.add_argument("--out-dir", required=True, help="where the checkpoints go (one directory each)")
    p.add_argument("--groups", default="64,32", help="group sizes (input rows sharing a scale), comma-separated")
    p.add_argument("--roundings", default="rtn,gptq,gptq-act", help="rtn, gptq and/or gptq-act (GPTQ with "
                   "act-order: desc_act, g_idx unsorted)")
    p.add_argument("--calibration-tokens", type=int, default=CALIBRATION_TOKENS,
                   help="GPTQ's calibration tokens (windows of 1,024 from CPython's help topics and two modules; "
                        "the time grows with them: ~1 min for the 135M model on two cores at the default)")
    p.add_argument("--measure", action=argparse.BooleanOptionalAction, default=True,
                   help="score each checkpoint's perplexity against the full-precision model")
    p.add_argument("--tokens", type=int, default=20480, help="tokens of the text to score")
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--output", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    from baton.benchmarks import quant_accuracy, record
    rec = {"model": args.model, "tolerance": TOLERANCE, "git": record.git_info(),
           "command_line": shlex.join(["python", "-m", "baton.benchmarks.int4_checkpoint",
                                       *(sys.argv[1:] if argv is None else argv)]),
           "started_at": record.now_iso(), "checkpoints": [], "rows": []}
    for group in (int(g) for g in args.groups.split(",")):
        for rounding in args.roundings.split(","):
            made = make_checkpoint(args.model, Path(args.out_dir) / f"{rounding}-g{group}", group,
                                   rounding.removesuffix("-act"), act_order=rounding.endswith("-act"),
                                   calibration_tokens=args.calibration_tokens)
            rec["checkpoints"].append(made)
            print(f"[int4] wrote {made['checkpoint']} ({made['bytes'] / 2 ** 20:.0f} MiB; {rounding} in "
                  f"{made['seconds']} s)", file=sys.stderr, flush=True)
    if args.measure:
        from transformers import AutoTokenizer

        from baton.models.source import resolve_model
        text, origin = quant_accuracy.fixed_text()
        ids = AutoTokenizer.from_pretrained(resolve_model(args.model).tokenizer_dir())(text)["input_ids"]
        chunks = quant_accuracy.windows(ids, args.window, args.tokens)
        rec.update(text=origin, scored_windows=len(chunks), window=args.window)
        ref = quant_accuracy.baton_scores(args.model, "cpu", "float32", {}, chunks)
        rec["rows"].append(quant_accuracy.summarize("full precision (float32)", ref, None))
        for made in rec["checkpoints"]:
            scores = quant_accuracy.baton_scores(made["checkpoint"], "cpu", "float32", {}, chunks)
            name = f"INT4 {made['rounding']}{' act-order' if made['act_order'] else ''} g{made['group']}"
            row = quant_accuracy.summarize(name, scores, ref)
            row["within_tolerance"] = abs(row["perplexity_vs_full"]) <= TOLERANCE
            rec["rows"].append(row)
        for row in rec["rows"]:
            print(json.dumps(row), file=sys.stderr, flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps(rec, indent=2))
    print(json.dumps(rec, indent=2))
    return 0 if all(r.get("within_tolerance", True) for r in rec["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
