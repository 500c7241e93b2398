"""Llama (Llama 2/3.x, SmolLM2): the plain decoder."""
from baton.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    qkv_bias = False          # Llama configs may set attention_bias; read per instance below

    def __init__(self, config, ops, dtype=None, tp=None):
        self.qkv_bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, ops, dtype, tp)
