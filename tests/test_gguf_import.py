"""A GGUF converts into safetensors of the dtype its weights are stored in: bf16 stays bf16 and
f16 stays f16 (half the disk and memory of float32), float32 stays float32, and the values are the
file's, bit for bit."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from tiny_gguf import write_tiny_gguf

from baton.models.gguf_import import convert, source_dtype


def _stored(gguf_path, name: str) -> torch.Tensor:
    from gguf import GGMLQuantizationType, GGUFReader
    t = next(t for t in GGUFReader(str(gguf_path)).tensors if t.name == name)
    shape = [int(n) for n in reversed(t.shape)]                  # GGUF lists dims innermost first
    raw = np.asarray(t.data)
    if t.tensor_type == GGMLQuantizationType.BF16:
        return torch.from_numpy(raw.view(np.uint16).astype(np.int16).copy()).view(torch.bfloat16).reshape(shape)
    return torch.from_numpy(raw.copy()).reshape(shape)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_a_gguf_converts_in_the_dtype_it_stores(tmp_path, dtype):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", dtype=dtype)
    assert source_dtype(gguf) == dtype
    out = tmp_path / "hf"
    convert(gguf, out)
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == dtype
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        weights = {k: f.get_tensor(k) for k in f.keys()}
    assert {w.dtype for w in weights.values()} == {getattr(torch, dtype)}
    # the embedding is stored as is (no rope permutation): the converted values are the file's own
    assert torch.equal(weights["model.embed_tokens.weight"], _stored(gguf, "token_embd.weight"))


def test_a_bf16_conversion_is_served(tmp_path):
    from baton import LLM, SamplingParams
    gguf = write_tiny_gguf(tmp_path / "tiny-bf16.gguf", "llama", dtype="bfloat16")
    llm = LLM(str(gguf), cache_dir=str(tmp_path / "cache"), num_kv_blocks=16, max_num_seqs=2)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
