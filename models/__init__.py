"""Model definitions (Llama, Qwen2, Qwen3), their layers, weight loading and model sources."""
from __future__ import annotations

import torch

from models.loader import init_random_weights, load_weights
from models.registry import SUPPORTED_ARCHITECTURES, model_class
from models.source import PRESETS, ModelSource, resolve_model


def build_model(hf_config, dtype: torch.dtype, device, ops, tp_rank: int = 0, tp_size: int = 1,
                tp_group=None) -> torch.nn.Module:
    """An empty (uninitialised) model for this config; load or init weights next."""
    from models.layers.linear import TPInfo
    cls = model_class((getattr(hf_config, "architectures", None) or ["?"])[0])
    with torch.device(device):
        return cls(hf_config, ops, dtype=dtype, tp=TPInfo(tp_rank, tp_size, tp_group))


__all__ = ["PRESETS", "SUPPORTED_ARCHITECTURES", "ModelSource", "build_model", "init_random_weights",
           "load_weights", "resolve_model"]
