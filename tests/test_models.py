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


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_gguf_of_each_architecture_serves_what_transformers_loads(arch, tmp_path):
    """A GGUF of Qwen3, Qwen2 or Llama (converted through transformers' own loader) gives the
    greedy tokens transformers generates from the same file."""
    from helpers import hf_greedy
    from tiny_gguf import write_tiny_gguf
    from transformers import AutoModelForCausalLM

    from baton.engine import LLM, SamplingParams
    gguf = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch)
    llm = LLM(str(gguf), cache_dir=str(tmp_path / "cache"), max_model_len=256, num_kv_blocks=64)
    assert llm.engine.source.architecture.lower().startswith(arch)
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=gguf.name, dtype=torch.float32).eval()
    prompts = [[5, 70, 80, 90, 100], [3, 4, 200, 201, 202, 203, 50, 9, 9]]
    got = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))]
    assert got == hf_greedy(ref, prompts, 12)


def test_a_gguf_is_converted_once_per_machine_by_one_process(tmp_path):
    """Two processes starting on a new GGUF at once: one converts (with progress), the other
    waits for it; a copy of the same file elsewhere (another clone, another venv) reuses it."""
    import subprocess
    import sys

    from tiny_gguf import write_tiny_gguf
    gguf = write_tiny_gguf(tmp_path / "tiny-qwen3.gguf", "qwen3")
    code = ("import sys; from baton.models.source import resolve_model; "
            f"print(resolve_model(sys.argv[1], cache_dir={str(tmp_path / 'cache')!r}).weights_path)")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(gguf)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    logs = "".join(err for _, err in outs)
    assert logs.count("[baton] converting tiny-qwen3.gguf") == 1, logs
    assert outs[0][0] == outs[1][0]
    if "waiting for it" not in logs:        # the second came after the first finished: it must have reused it
        assert logs.count("converted in") == 1
    copy = tmp_path / "elsewhere" / "tiny-qwen3.gguf"
    copy.parent.mkdir()
    copy.write_bytes(gguf.read_bytes())
    again = subprocess.run([sys.executable, "-c", code, str(copy)], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and again.stdout == outs[0][0] and "converting" not in again.stderr


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


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3-8b", "llama-3.2-1b", "qwen3-30b-a3b", "minicpm4-0.5b"])
def test_presets_have_real_checkpoint_shapes(name):
    from baton.models.loader import checkpoint_shapes
    src = model_source.resolve_model(name)
    params = sum(torch.Size(s).numel() for _, s in checkpoint_shapes(src.hf_config))
    expected = {"qwen3-0.6b": 0.596e9, "qwen3-8b": 8.19e9, "llama-3.2-1b": 1.236e9,
                "qwen3-30b-a3b": 30.5e9,                # Qwen3-30B-A3B: 30.5B in all, 3.3B active
                "minicpm4-0.5b": 0.434e9}[name]         # MiniCPM4-0.5B: tied 73448-token vocabulary
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
