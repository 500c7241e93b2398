"""Qwen3: the decoder with per-head RMSNorm on q and k, and an explicit head_dim."""
from baton.models.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    qk_norm = True

    def __init__(self, config, ops, dtype=None, tp=None):
        self.qkv_bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, ops, dtype, tp)
