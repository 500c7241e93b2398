"""MiniCPM's config (model_type "minicpm"): transformers has no class for it (its minicpm3 is
another architecture; the checkpoints ship theirs as remote code, which Baton never runs).
Torch-free, so model sources can read a MiniCPM directory without importing the model.
"""
from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig


class MiniCPMConfig(PretrainedConfig):
    """The fields of openbmb's configuration_minicpm.py that the dense model uses, with its
    defaults. muP scalings: embeddings times `scale_emb`, each residual branch times
    `scale_depth / sqrt(num_hidden_layers)`, the final hidden state divided by
    `hidden_size / dim_model_base` before the (tied) head."""

    model_type = "minicpm"

    def __init__(self, vocab_size: int = 32000, hidden_size: int = 4096, intermediate_size: int = 11008,
                 num_hidden_layers: int = 32, num_attention_heads: int = 32, num_key_value_heads: int | None = None,
                 hidden_act: str = "silu", max_position_embeddings: int = 2048, rms_norm_eps: float = 1e-6,
                 rope_theta: float = 10000.0, rope_parameters: dict | None = None, attention_bias: bool = False,
                 scale_emb: float = 1, dim_model_base: int = 1, scale_depth: float = 1,
                 sparse_config: dict | None = None, tie_word_embeddings: bool = True, **kwargs):
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.hidden_act, self.max_position_embeddings = hidden_act, max_position_embeddings
        # a checkpoint's "rope_scaling" stays in kwargs: the base class moves it into rope_parameters
        self.rms_norm_eps, self.rope_theta, self.rope_parameters = rms_norm_eps, rope_theta, rope_parameters
        self.attention_bias = attention_bias
        self.scale_emb, self.dim_model_base, self.scale_depth = scale_emb, dim_model_base, scale_depth
        self.sparse_config = sparse_config        # MiniCPM4-8B's InfLLM v2 sparse attention: refused by the model
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    def _validate_longrope_rope_parameters(self, rope_parameters: dict, ignore_keys: set | None = None) -> None:
        """transformers' LongRoPE check is Phi-3's: it asks for a `factor` field that MiniCPM's
        configs never have (MiniCPM derives it from original_max_position_embeddings). Baton's
        rotary.longrope_factors checks MiniCPM's fields when the model is built."""


def register() -> None:
    """Make AutoConfig read model_type "minicpm" (idempotent)."""
    AutoConfig.register("minicpm", MiniCPMConfig, exist_ok=True)
