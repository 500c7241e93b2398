"""MiniCPM's parity reference: llama.cpp, an implementation not written here (llama-cpp-python
0.3.36, pinned in the test extra, which builds the llama.cpp it vendors: libllama 0.5.0).

A tiny random MiniCPM checkpoint is written twice: as an HF directory (config.json,
model.safetensors, the embedded tokenizer) that Baton loads, and as an F32 GGUF of llama.cpp's
"minicpm" architecture (its keys and tensor names, from its convert_hf_to_gguf.py MiniCPMModel and
src/models/minicpm.cpp) that llama.cpp runs through llama-cpp-python's low-level binding. llama.cpp
implements MiniCPM from the published modeling code on its own: the scalings are its generic
embedding_scale / residual_scale / logit_scale (the Granite graph) and LongRoPE is its
rope_factors_long / rope_factors_short tensors with ggml's per-dimension frequency factors.

Two GGUF keys go beyond what llama.cpp's MiniCPM converter writes, both read by llama.cpp for every
architecture (its Phi-3 converter writes them for the same LongRoPE): rope.scaling.original_context_length
and rope.scaling.attn_factor. With them, a context longer than the original (llama.cpp picks the factors
by context size) uses the long factors and MiniCPM's magnitude sqrt(1 + ln(max / original) / ln(original)),
as the published code does when max_position_embeddings exceeds original_max_position_embeddings.
Both choose once per model, not per sequence (MiniCPM's code builds one table for
max_position_embeddings; llama.cpp keys on the context size, which is given as that).
"""
from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import numpy as np
import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
# MiniCPM4-0.5B's shape family, tiny: vocab covers the embedded tokenizer's ids
TINY_MINICPM = dict(architectures=["MiniCPMForCausalLM"], model_type="minicpm", hidden_size=64,
                    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    vocab_size=49152, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                    scale_emb=12, dim_model_base=16, scale_depth=0.8, tie_word_embeddings=True,
                    bos_token_id=1, eos_token_id=2, hidden_act="silu",
                    rope_scaling={"rope_type": "longrope", "long_factor": [1.0 + 0.5 * i for i in range(8)],
                                  "short_factor": [1.0 + i / 8 for i in range(8)],
                                  "original_max_position_embeddings": 512})


def tiny_minicpm_config(**overrides) -> dict:
    config = json.loads(json.dumps(TINY_MINICPM))
    config.update(overrides)
    return config


def save_tiny_minicpm(path: Path, tokenizer_dir: str, config: dict, seed: int = 0) -> Path:
    """An HF-style MiniCPM directory with random float32 weights (HF tensor names)."""
    from safetensors.torch import save_file

    from baton.models.loader import checkpoint_shapes
    from baton.models.minicpm_config import MiniCPMConfig
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in checkpoint_shapes(MiniCPMConfig(**config)):
        if name.endswith("norm.weight"):        # not all ones: the norms' weights must be applied too
            weights[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:                                   # small embeddings: with tied ones times scale_emb, the
            std = 0.02 if "embed" in name else 0.2      # input token would win every step
            weights[name] = torch.randn(shape, generator=g) * std
    path.mkdir(parents=True)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(dict(config, torch_dtype="float32"), indent=2))
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, path / name)
    return path


def write_minicpm_gguf(checkpoint: Path, gguf_path: Path) -> Path:
    """The checkpoint as llama.cpp's "minicpm" GGUF, every tensor F32, no tokenizer (Baton and
    llama.cpp are both fed token ids)."""
    from gguf import GGUFWriter
    from safetensors.torch import load_file
    c = json.loads((checkpoint / "config.json").read_text())
    sd = {k: v.float().numpy() for k, v in load_file(str(checkpoint / "model.safetensors")).items()}
    heads, kv_heads, layers = c["num_attention_heads"], c["num_key_value_heads"], c["num_hidden_layers"]
    head_dim = c["hidden_size"] // heads
    w = GGUFWriter(str(gguf_path), "minicpm")
    _write_hparams(w, c, head_dim)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if "lm_head.weight" in sd:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    rope = c["rope_scaling"]
    w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
    w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    for i in range(layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(b + "attn_q.weight", _pairs_interleaved(sd[p + "self_attn.q_proj.weight"], heads))
        w.add_tensor(b + "attn_k.weight", _pairs_interleaved(sd[p + "self_attn.k_proj.weight"], kv_heads))
        w.add_tensor(b + "attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(b + "ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(b + "ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(b + "ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf_path


def _write_hparams(w, c: dict, head_dim: int) -> None:
    rope = c["rope_scaling"]
    original = rope["original_max_position_embeddings"]
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_vocab_size(c["vocab_size"])
    w.add_tokenizer_model("none")                     # llama.cpp: dummy tokens, ids only
    # what llama.cpp's MiniCPMModel converter writes, from the same config fields
    w.add_embedding_scale(float(c["scale_emb"]))
    w.add_residual_scale(c["scale_depth"] / math.sqrt(c["num_hidden_layers"]))
    w.add_logit_scale(c["hidden_size"] / c["dim_model_base"])
    from gguf import RopeScalingType
    w.add_rope_scaling_type(RopeScalingType.LONGROPE)
    w.add_rope_scaling_orig_ctx_len(original)
    scale = c["max_position_embeddings"] / original
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))   # cos/sin times this


def _pairs_interleaved(weight: np.ndarray, heads: int) -> np.ndarray:
    """HF's q/k rows rotate halves (i, i + d/2); llama.cpp's "minicpm" rotates neighbours
    (2i, 2i + 1), so its converter reorders each head's rows: [h, 2, d/2, in] -> [h, d/2, 2, in]."""
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def llama_cpp_greedy(gguf_path: Path, prompts: list[list[int]], max_new_tokens: int,
                     n_ctx: int) -> tuple[list[list[int]], list[np.ndarray]]:
    """Greedy tokens from llama.cpp, and the logits after each prompt: one context per prompt,
    the prompt in one batch, then one token per step; argmax of each step's full logits (EOS is
    just another token)."""
    import llama_cpp as lc
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)     # its log callback: errors only
    lc.llama_backend_init()
    mparams = lc.llama_model_default_params()
    mparams.n_gpu_layers = 0
    model = lc.llama_model_load_from_file(str(gguf_path).encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf_path}")
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    try:
        runs = [_greedy_one(lc, model, ids, max_new_tokens, n_ctx, n_vocab) for ids in prompts]
    finally:
        lc.llama_model_free(model)
    return [tokens for tokens, _ in runs], [logits for _, logits in runs]


def _greedy_one(lc, model, ids: list[int], max_new_tokens: int, n_ctx: int,
                n_vocab: int) -> tuple[list[int], np.ndarray]:
    cparams = lc.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = n_ctx, n_ctx, n_ctx
    cparams.n_threads = cparams.n_threads_batch = 2
    cparams.type_k = cparams.type_v = lc.GGML_TYPE_F32            # the KV cache in F32 too, not F16
    cparams.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = lc.llama_init_from_model(model, cparams)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context")
    out, step, first = [], list(ids), None
    try:
        for _ in range(max_new_tokens):
            tokens = (lc.llama_token * len(step))(*step)
            if lc.llama_decode(ctx, lc.llama_batch_get_one(tokens, len(step))) != 0:
                raise RuntimeError("llama_decode failed")
            logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
            first = logits.copy() if first is None else first
            out.append(int(logits.argmax()))
            step = [out[-1]]
    finally:
        lc.llama_free(ctx)
    return out, first
