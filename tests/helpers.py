"""Shared test helpers: tiny random HF checkpoints and Hugging Face greedy references."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from baton.engine.kv_handoff import KVHandoff, KVPiece, KVTicket

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=49152, max_position_embeddings=512, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2)


def tiny_hf_config(arch: str, **overrides):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig}[arch]
    kw = dict(TINY)
    if arch in ("qwen3", "qwen3_moe"):
        kw["head_dim"] = 32
    if arch == "qwen3_moe":            # 8 experts, top 2; layer 1 dense, as mlp_only_layers allows
        kw.update(num_hidden_layers=3, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                  norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1)
    kw.update(overrides)
    return cls(**kw)


def save_tiny_checkpoint(arch: str, path: Path, tokenizer_dir: str, seed: int = 0, **overrides) -> Path:
    """A random-weight HF checkpoint of `arch`, with the embedded model's tokenizer."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    config = tiny_hf_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():                       # larger-than-default weights: sharper, less tie-prone logits
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    for name in TOKENIZER_FILES:
        src = Path(tokenizer_dir) / name
        if src.exists():
            shutil.copy(src, path / name)
    return path


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy tokens from the transformers model itself, one prompt at a time, with its own
    KV cache; EOS is just another token (like ignore_eos), nothing is suppressed."""
    outs = []
    for ids in prompts:
        device = next(model.parameters()).device
        x, past, out = torch.tensor([ids], device=device), None, []
        with torch.no_grad():
            for _ in range(max_new_tokens):
                r = model(input_ids=x, past_key_values=past, use_cache=True)
                past = r.past_key_values
                out.append(int(r.logits[0, -1].argmax()))
                x = torch.tensor([[out[-1]]], device=device)
        outs.append(out)
    return outs


def save_fp8_checkpoint(src: Path, dst: Path, fmt: str, block: int = 128) -> Path:
    """A pre-quantized copy of HF checkpoint `src`, as the Hub's FP8 releases lay them out: every
    projection weight (attention, MLP, experts; not the embedding, LM head, norms or router) in
    float8 e4m3 with its scales beside it, and a quantization_config in config.json.
    fmt "fp8-block": the `fp8` method's block-wise `weight_scale_inv` (Qwen3-FP8, DeepSeek-V3);
    fmt "compressed-tensors": per-output-channel `weight_scale` [N, 1] (llm-compressor's FP8_DYNAMIC)."""
    import json

    from safetensors.torch import load_file, save_file
    fp8, top = torch.float8_e4m3fn, torch.finfo(torch.float8_e4m3fn).max
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for f in sorted(Path(src).glob("*.safetensors")):
        for name, w in load_file(f).items():
            if w.dim() != 2 or not name.endswith("proj.weight"):
                tensors[name] = w
                continue
            w = w.float()
            if fmt == "fp8-block":
                n, k = w.shape
                rows, cols = -(-n // block), -(-k // block)
                pad = torch.zeros(rows * block, cols * block)
                pad[:n, :k] = w
                tiles = pad.reshape(rows, block, cols, block).abs().amax(dim=(1, 3)) / top      # [rows, cols]
                scale = tiles.clamp(min=1e-12)
                full = scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
                tensors[name], tensors[name + "_scale_inv"] = (w / full).to(fp8), scale
            else:
                scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / top                # [N, 1]
                tensors[name], tensors[name + "_scale"] = (w / scale).to(fp8), scale
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((Path(src) / "config.json").read_text())
    if fmt == "fp8-block":
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [block, block]}
    else:
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                                      "symmetric": True, "dynamic": False},
                                          "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                                "symmetric": True, "dynamic": True}}}}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for p in Path(src).iterdir():
        if p.suffix != ".safetensors" and p.name != "config.json" and p.is_file():
            shutil.copy(p, dst / p.name)
    return dst


def save_tiny_eagle3_head(path: Path, target, draft_tokens: list[int] | None = None, seed: int = 0,
                          std: float = 0.08, mimic: torch.Tensor | None = None) -> Path:
    """A random-weight EAGLE-3 head for `target` (models/eagle3.save_random_head). `mimic`: the target's
    LM head weight; then fc passes the target's last hidden state through, the layer adds next to
    nothing and the head's LM head is the target's, so it guesses "the token the target drew at this
    position again": right where the target repeats itself, wrong elsewhere (a mix of both outcomes)."""
    from baton.models.eagle3 import random_head, save_head
    tensors, config = random_head(target, draft_tokens, seed, std)
    if mimic is not None:
        h = config["hidden_size"]
        for name in tensors:
            if name.startswith("midlayer.") and not name.endswith("norm.weight"):
                tensors[name] *= 1e-3
        tensors["fc.weight"] = torch.cat([torch.zeros(h, 2 * h), torch.eye(h)], dim=1)
        draft = tensors["d2t"] + torch.arange(len(tensors["d2t"]))
        tensors["lm_head.weight"] = mimic.detach().float().cpu()[draft].clone()
    return save_head(path, tensors, config)


def fp8_expert_dots_mirror(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                           weights: torch.Tensor, scales) -> torch.Tensor:
    """FP8 x FP8 experts (e4m3 stacks, `scales` per (expert, output channel)) in float64, rounding
    where the fused kernels round: x's rows to e4m3 per token, the SiLU product to x's dtype (the
    w13 kernel stores it so) and then to e4m3 per row; everything else exact. Returns float64 [T, H]."""
    from baton.models.layers.quantization import quantize_rows
    d = torch.float64
    k = ids.shape[1]
    xq, xs = quantize_rows(x)
    flat, route = ids.reshape(-1), weights.reshape(-1).to(d)
    out = torch.zeros(x.shape, dtype=d, device=x.device)
    for expert in flat.unique().tolist():
        slots = (flat == expert).nonzero()[:, 0]
        tokens = slots // k
        gate, up = ((xq[tokens].to(d) @ w13[expert].to(d).T) * xs[tokens].to(d) * scales.w13[expert].to(d)).chunk(2, -1)
        aq, a_scale = quantize_rows((gate * torch.sigmoid(gate) * up).to(x.dtype))
        y = (aq.to(d) @ w2[expert].to(d).T) * a_scale.to(d) * scales.w2[expert].to(d)
        out.index_add_(0, tokens, y * route[slots, None])
    return out


class Hook(KVHandoff):
    """A test double of the services' side of the KV seam: collects a prefill engine's pieces,
    lands what the test says on a decode engine."""

    def __init__(self):
        self.pieces: list[KVPiece] = []
        self.landed: list[KVTicket] = []
        self.fail_pieces = False

    def on_prompt_kv(self, piece: KVPiece) -> None:
        if self.fail_pieces:
            raise RuntimeError("the transfer is gone")
        self.pieces.append(piece)

    def land(self, ticket: KVTicket, payload, first_token: int, meta=None) -> None:
        assert ticket.land(payload, first_token, meta or {})
        self.landed.append(ticket)

    def take_landed(self) -> list[KVTicket]:
        taken, self.landed = self.landed, []
        return taken

    def has_landed(self) -> bool:
        return bool(self.landed)


def in_triton_interpreter(code: str, done: str, what: str, timeout: float = 300) -> None:
    """Run `code` (importing a test module from tests/) in a process under TRITON_INTERPRET=1 and check
    it printed `done`; skip, saying how to enable it, where triton is absent: neither in the venv nor
    in BATON_TRITON_PATH (`pip install --target DIR triton`: beside the venv, not in it)."""
    import importlib.util
    import os
    import subprocess
    import sys

    import pytest
    where = "" if importlib.util.find_spec("triton") is not None else os.environ.get("BATON_TRITON_PATH") or None
    if where is None:
        pytest.skip("triton is absent: install it beside the venv (pip install --target DIR triton) and set "
                    f"BATON_TRITON_PATH=DIR to check {what} through TRITON_INTERPRET=1")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(p for p in (where, str(Path(__file__).parent), os.environ.get("PYTHONPATH"))
                                          if p))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0 and done in run.stdout, run.stdout[-2000:] + run.stderr[-4000:]
