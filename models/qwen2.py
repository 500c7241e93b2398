"""Qwen2 / Qwen2.5: the decoder with biases on q, k and v."""
from baton.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    qkv_bias = True
