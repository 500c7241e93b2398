"""Tiny GGUF files written here (random weights, float32 or, as real exports store them, bf16 /
f16 matrices with float32 norms; a byte-level BPE vocabulary of 263 tokens) so GGUF import is
tested on architectures beyond the embedded Llama in seconds."""
from __future__ import annotations

from pathlib import Path

import numpy as np

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character map: the byte-level BPE's base tokens."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + n))
            n += 1
    return chars


def write_tiny_gguf(path: Path, arch: str = "qwen3", layers: int = 2, hidden: int = 64, heads: int = 4,
                    kv_heads: int = 2, ffn: int = 128, seed: int = 0, dtype: str = "float32") -> Path:
    """`dtype`: how the weight matrices are stored, float32, float16 or bfloat16."""
    from gguf import GGMLQuantizationType, GGUFWriter, TokenType, quants
    # transformers' GGUF reader takes Qwen3's head_dim from its config default (128, as in every
    # real Qwen3), the others' from hidden / heads
    head_dim = 128 if arch == "qwen3" else hidden // heads
    rng = np.random.default_rng(seed)
    merges = ["Ġ t", "h e", "Ġt he", "i n"]
    tokens = SPECIAL + _byte_alphabet() + [m.replace(" ", "") for m in merges]
    vocab = len(tokens)
    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([TokenType.CONTROL] * len(SPECIAL) + [TokenType.NORMAL] * (vocab - len(SPECIAL)))
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)

    def t(name: str, *shape: int, scale: float = 0.08) -> None:
        values = (rng.standard_normal(shape) * scale).astype(np.float32)
        if dtype == "float16" and len(shape) > 1:
            w.add_tensor(name, values.astype(np.float16))
        elif dtype == "bfloat16" and len(shape) > 1:
            w.add_tensor(name, quants.quantize(values, GGMLQuantizationType.BF16),   # bytes: their shape says
                         raw_dtype=GGMLQuantizationType.BF16)
        else:
            w.add_tensor(name, values)

    def ones(name: str, n: int) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    t("token_embd.weight", vocab, hidden, scale=0.5)
    for i in range(layers):
        b = f"blk.{i}."
        ones(b + "attn_norm.weight", hidden)
        t(b + "attn_q.weight", heads * head_dim, hidden)
        t(b + "attn_k.weight", kv_heads * head_dim, hidden)
        t(b + "attn_v.weight", kv_heads * head_dim, hidden)
        t(b + "attn_output.weight", hidden, heads * head_dim)
        if arch == "qwen3":
            ones(b + "attn_q_norm.weight", head_dim)
            ones(b + "attn_k_norm.weight", head_dim)
        if arch == "qwen2":
            t(b + "attn_q.bias", heads * head_dim)
            t(b + "attn_k.bias", kv_heads * head_dim)
            t(b + "attn_v.bias", kv_heads * head_dim)
        ones(b + "ffn_norm.weight", hidden)
        t(b + "ffn_gate.weight", ffn, hidden)
        t(b + "ffn_up.weight", ffn, hidden)
        t(b + "ffn_down.weight", hidden, ffn)
    ones("output_norm.weight", hidden)
    t("output.weight", vocab, hidden, scale=0.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
