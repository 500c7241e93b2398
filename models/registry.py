"""Model classes by `config.architectures[0]`."""
from __future__ import annotations

from models.llama import LlamaForCausalLM
from models.qwen2 import Qwen2ForCausalLM
from models.qwen3 import Qwen3ForCausalLM

MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}
SUPPORTED_ARCHITECTURES = tuple(MODELS)


def model_class(architecture: str):
    try:
        return MODELS[architecture]
    except KeyError:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}") from None
