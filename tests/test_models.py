"""models/: where models come from and whether their weights mean what the checkpoint means."""
from __future__ import annotations

import time

import pytest
import torch

from baton.engine.platforms.cpu import CpuPlatform
from baton.models import loader, registry
from baton.models import source as model_source
from baton.models.attention_metadata import AttnMetadata
from baton.models.forward_context import ForwardContext


def _logits(model, ids: list[int]) -> torch.Tensor:
    n = len(ids)
    meta = AttnMetadata(is_decode=False, slot_mapping=torch.full((n,), -1), query_start_loc=torch.tensor([0, n]),
                        seq_lens=torch.tensor([n]), block_tables=torch.zeros(1, 1, dtype=torch.int32),
                        max_query_len=n, max_seq_len=n, has_context=False, query_start_loc_cpu=[0, n],
                        seq_lens_cpu=[n])
    ctx = ForwardContext(meta, None, CpuPlatform(torch.device("cpu")), model.head_dim ** -0.5)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n), ctx))


def test_embedded_gguf_import_matches_transformers_own_gguf_loader(embedded_source):
    """Our GGUF conversion (incl. undoing llama.cpp's q/k row permutation) gives the logits
    transformers computes when it loads the same GGUF file itself."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from baton.models.source import _embedded_gguf
    gguf = _embedded_gguf()
    ref = AutoModelForCausalLM.from_pretrained(str(Path(gguf).parent), gguf_file=Path(gguf).name,
                                               dtype=torch.float32).eval()
    ours = loader.build_model(embedded_source.hf_config, torch.float32, "cpu", CpuPlatform(torch.device("cpu")).ops)
    loader.load_weights(ours, embedded_source.weights_path)
    ids = [1, 9690, 198, 2683, 314, 253, 3575, 282, 4649, 47, 2, 198]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    got = _logits(ours, ids)
    assert torch.allclose(got, want, atol=2e-3, rtol=1e-3), (got - want).abs().max()


def test_embedded_tokenizer_keeps_the_chat_template(embedded_source):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(embedded_source.tokenizer_path)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.decode(tok("Grüße, 世界!")["input_ids"]) == "Grüße, 世界!"


def test_second_resolve_reuses_the_converted_cache(embedded_source):
    t0 = time.perf_counter()
    again = model_source.resolve_model("smollm2-135m-instruct")
    assert again.weights_path == embedded_source.weights_path
    assert time.perf_counter() - t0 < 10


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3-8b", "llama-3.2-1b"])
def test_presets_have_real_checkpoint_shapes(name):
    from baton.models.loader import checkpoint_shapes
    src = model_source.resolve_model(name)
    params = sum(torch.Size(s).numel() for _, s in checkpoint_shapes(src.hf_config))
    expected = {"qwen3-0.6b": 0.596e9, "qwen3-8b": 8.19e9, "llama-3.2-1b": 1.236e9}[name]
    assert abs(params - expected) / expected < 0.02, params
    assert src.weights_path is None and src.architecture in registry.SUPPORTED_ARCHITECTURES


def test_random_preset_weights_are_deterministic_by_seed():
    src = model_source.resolve_model("tiny-qwen3")
    ops = CpuPlatform(torch.device("cpu")).ops
    a, b = (loader.build_model(src.hf_config, torch.float32, "cpu", ops) for _ in range(2))
    loader.init_random_weights(a, 7)
    loader.init_random_weights(b, 7)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_unknown_model_and_architecture_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="qwen3-0.6b"):          # lists what is accepted
        model_source.resolve_model("gpt-17")
    (tmp_path / "config.json").write_text('{"architectures": ["MambaForCausalLM"], "model_type": "mamba"}')
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        model_source.resolve_model(str(tmp_path))
