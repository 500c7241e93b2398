"""GGUF (llama architecture) -> an HF-layout directory: config.json, model.safetensors,
tokenizer files. Our own mapping on top of the `gguf` package's reader and dequantizer.

llama.cpp's converter permutes the rows of q and k so its rotary kernel can rotate adjacent
pairs; HF rotates halves, so those rows are permuted back here.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

CONVERTER_VERSION = "1"

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    return value


def hf_config_dict(reader, has_output: bool) -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported for import (supported: llama)")
    p = "llama."
    heads = int(_field(reader, p + "attention.head_count"))
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": int(_field(reader, p + "embedding_length")),
        "intermediate_size": int(_field(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv", heads)),
        "rms_norm_eps": float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, p + "context_length", 2048)),
        "vocab_size": len(_field(reader, "tokenizer.ggml.tokens")),
        "tie_word_embeddings": not has_output,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id", 2)),
        "hidden_act": "silu", "attention_bias": False, "torch_dtype": "float32",
    }
    return cfg


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (pairs -> halves within each head)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, n, part = base.split(".", 2)
        return f"model.layers.{n}.{_LAYER_NAMES[part]}.{suffix}"
    return f"{_GLOBAL_NAMES[base]}.{suffix}"


def convert(gguf_path: Path, out_dir: Path) -> None:
    """Write an HF directory for gguf_path into out_dir (which must not exist yet)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    print(f"[baton] converting {gguf_path.name} to an HF checkpoint (once; cached) ...", file=sys.stderr)
    reader = GGUFReader(str(gguf_path))
    names = {t.name for t in reader.tensors}
    cfg = hf_config_dict(reader, "output.weight" in names)
    tensors = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32).reshape([int(x) for x in reversed(t.shape)])
        if t.name.endswith("attn_q.weight"):
            w = _unpermute(w, cfg["num_attention_heads"])
        elif t.name.endswith("attn_k.weight"):
            w = _unpermute(w, cfg["num_key_value_heads"])
        tensors[_hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(w))
    out_dir.mkdir(parents=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}, indent=2))
    _save_tokenizer(gguf_path, out_dir)
    print(f"[baton] converted in {time.perf_counter() - t0:.1f}s -> {out_dir}", file=sys.stderr)


def _save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out_dir))
