"""Model classes by `config.architectures[0]`.

Classes are named by module path and imported on first use, so code that only needs to know
whether an architecture is supported (the router, model sources) never imports torch.
"""
from __future__ import annotations

import importlib

MODELS = {
    "LlamaForCausalLM": "baton.models.llama",
    "MiniCPMForCausalLM": "baton.models.minicpm",
    "Qwen2ForCausalLM": "baton.models.qwen2",
    "Qwen2AudioForConditionalGeneration": "baton.models.qwen2_audio",
    "Qwen3ForCausalLM": "baton.models.qwen3",
    "Qwen3MoeForCausalLM": "baton.models.qwen3_moe",
    "Qwen3VLForConditionalGeneration": "baton.models.qwen3_vl",
}
SUPPORTED_ARCHITECTURES = tuple(MODELS)


def model_class(architecture: str):
    if architecture not in MODELS:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return getattr(importlib.import_module(MODELS[architecture]), architecture)

