"""Session-wide fixtures: the embedded model (converted once) and its HF reference."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def embedded_source():
    import models
    return models.resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def embedded_llm():
    from engine import LLM
    return LLM()


@pytest.fixture(scope="session")
def hf_embedded(embedded_source):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(embedded_source.weights_path, torch_dtype=torch.float32)
    return model.eval()
