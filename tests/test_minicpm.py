"""MiniCPM (models/minicpm.py: muP scalings, LongRoPE) against llama.cpp, an implementation not
written here (tests/minicpm_reference.py says why it can be trusted): greedy tokens and logits of
two tiny random checkpoints, offline (batched, chunked prefill, prefix cache) and served by one
prefill + one decode worker.

BATON_TEST_DEVICE=cuda:0 runs Baton on that GPU (fp32) against the same llama.cpp tokens (llama.cpp
on the CPU); if the GPU image has no llama-cpp-python, the reference is Baton on the CPU (which this
file checks against llama.cpp in CI), and CUDA decode graphs are checked against enforce_eager.
"""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch
from minicpm_reference import llama_cpp_greedy, save_tiny_minicpm, tiny_minicpm_config, write_minicpm_gguf

from baton.engine import LLM, SamplingParams

DEVICE = os.environ.get("BATON_TEST_DEVICE", "cpu")
NEW_TOKENS = 12
CONFIGS = {
    # MiniCPM4-0.5B's case: max positions == original, so the short factors, magnitude 1; tied head
    "short-factors": tiny_minicpm_config(),
    # an extended context: the long factors and cos/sin times sqrt(1 + ln 8 / ln 256); head_dim 32,
    # one KV head, three layers, an untied head
    "long-factors": tiny_minicpm_config(
        num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=3, tie_word_embeddings=False,
        max_position_embeddings=2048,
        rope_scaling={"rope_type": "longrope", "long_factor": [1.0 + 0.5 * i for i in range(16)],
                      "short_factor": [1.0 + i / 16 for i in range(16)], "original_max_position_embeddings": 256}),
}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 23, 40, 70)]


@pytest.fixture(scope="module")
def minicpm(tmp_path_factory):
    """Per config: the HF directory Baton loads, and the reference's greedy tokens and logits."""
    from baton.models.source import resolve_model
    tokenizer_dir = os.environ.get("BATON_TOKENIZER") or resolve_model(None).tokenizer_path
    root, prompts, out = tmp_path_factory.mktemp("minicpm"), _prompts(), {}
    for name, config in CONFIGS.items():
        path = save_tiny_minicpm(root / name, tokenizer_dir, config, seed=3)
        out[name] = (path, *_reference(path, root / f"{name}.gguf", prompts, config["max_position_embeddings"]))
    return prompts, out


def _reference(path, gguf, prompts, n_ctx):
    """(tokens, logits after each prompt or None): llama.cpp's; on a GPU without
    llama-cpp-python, Baton's on the CPU."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        if DEVICE == "cpu":
            raise                 # the CPU run is the llama.cpp-verified one: the binding must be there
        llm = LLM(str(path), num_kv_blocks=64, dtype="float32", device="cpu")
        return [o.token_ids for o in llm.generate(prompts, _greedy())], None
    return llama_cpp_greedy(write_minicpm_gguf(path, gguf), prompts, NEW_TOKENS, n_ctx)


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_minicpm_greedy_matches_llama_cpp_batched_chunked_and_from_the_prefix_cache(minicpm, name):
    prompts, refs = minicpm
    path, want, _ = refs[name]
    # a 16-token step budget: the 40- and 70-token prompts prefill in chunks, beside decodes
    llm = LLM(str(path), block_size=8, num_kv_blocks=96, max_num_batched_tokens=16, device=DEVICE, dtype="float32")
    got = llm.generate(prompts, _greedy())
    assert [o.token_ids for o in got] == want
    again = llm.generate(prompts, _greedy())              # full blocks of every prompt are cached now
    assert [o.token_ids for o in again] == want
    assert [o.cached_tokens for o in again] == [(len(p) - 1) // 8 * 8 for p in prompts]   # the last token reruns


# the model runs on the CPU here whatever the device: without the binding (a GPU image) there is
# no reference for it, and CI's CPU run, where the binding must be installed, checks it
@pytest.mark.skipif(DEVICE != "cpu" and importlib.util.find_spec("llama_cpp") is None,
                    reason="llama-cpp-python is not installed on this GPU image; the CPU run compares logits")
@pytest.mark.parametrize("name", list(CONFIGS))
def test_minicpm_logits_match_llama_cpp(minicpm, name):
    """Logits, not only their argmax: the final division by hidden_size / dim_model_base leaves
    the argmax alone, so only the values can show it."""
    from test_models import _logits

    from baton.engine.platforms.cpu import CpuPlatform
    from baton.models import loader
    from baton.models.source import resolve_model
    prompts, refs = minicpm
    path, _, ref_logits = refs[name]
    source = resolve_model(str(path))
    model = loader.build_model(source.hf_config, torch.float32, "cpu", CpuPlatform(torch.device("cpu")).ops)
    loader.load_weights(model, path)
    for ids, ref in zip(prompts, ref_logits, strict=True):
        got = _logits(model, ids)[-1].numpy()
        assert np.abs(got - ref).max() < 1e-4 * max(1.0, float(np.abs(ref).max()))


@pytest.mark.device
@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="CUDA decode graphs: set BATON_TEST_DEVICE=cuda:N")
def test_minicpm_cuda_decode_graphs_give_the_eager_tokens(minicpm):
    prompts, refs = minicpm
    path, want, _ = refs["long-factors"]
    eager = LLM(str(path), num_kv_blocks=96, device=DEVICE, dtype="float32", enforce_eager=True)
    graphs = LLM(str(path), num_kv_blocks=96, device=DEVICE, dtype="float32")
    assert [o.token_ids for o in eager.generate(prompts, _greedy())] == want
    assert [o.token_ids for o in graphs.generate(prompts, _greedy())] == want


@pytest.mark.slow
def test_minicpm_served_by_one_prefill_and_one_decode_worker_matches_llama_cpp(minicpm, tmp_path):
    from cluster import Cluster
    from test_services import collect

    from baton.v1 import router_pb2
    prompts, refs = minicpm
    path, want, _ = refs["long-factors"]
    common = ["--model", str(path), "--dtype", "float32", "--num-kv-blocks", "64", "--block-size", "16",
              "--max-num-batched-tokens", "32", "--device", DEVICE]       # 40, 70 tokens: chunked prefills
    c = Cluster.launch(tmp_path / "logs", prefill=1, decode=1, worker_args=common, router_args=["--model", str(path)])
    try:
        stub = c.stub()
        sampling = router_pb2.SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        for prompt, tokens in zip(prompts, want, strict=True):
            ids, _, _ = collect(stub, router_pb2.GenerateRequest(tokens=router_pb2.TokenIds(ids=prompt),
                                                                 sampling=sampling))
            assert ids == tokens
        again, _, last = collect(stub, router_pb2.GenerateRequest(tokens=router_pb2.TokenIds(ids=prompts[3]),
                                                                  sampling=sampling))
        assert again == want[3] and last.usage.cached_prompt_tokens >= 64     # the prefix cache, disaggregated
    finally:
        c.stop()


def test_a_minicpm_gguf_is_refused_with_the_way_out(minicpm, tmp_path):
    """transformers' GGUF loader (Baton's GGUF import) has no MiniCPM: a clear error, before any work."""
    from baton.models.source import resolve_model
    pytest.importorskip("gguf", reason="the GPU image lacks the gguf package; CI's CPU run has it")
    _, refs = minicpm
    gguf = write_minicpm_gguf(refs["short-factors"][0], tmp_path / "short-factors.gguf")
    with pytest.raises(ValueError, match=r"MiniCPM GGUF cannot be imported.*HF directory"):
        resolve_model(str(gguf), cache_dir=str(tmp_path / "cache"))


@pytest.mark.parametrize("change,match", [
    ({"sparse_config": {"kernel_size": 32}}, "sparse attention"),
    ({"num_experts": 8}, "MiniCPM-MoE"),
    ({"scale_emb": 0}, "positive scale_emb"),
    ({"rope_scaling": {"rope_type": "longrope", "long_factor": [1.0] * 8, "short_factor": [1.0] * 7,
                       "original_max_position_embeddings": 512}}, "head_dim / 2 = 8"),
])
def test_minicpm_configs_baton_cannot_serve_are_clear_errors(change, match):
    from baton.engine.platforms.cpu import CpuPlatform
    from baton.models import loader
    from baton.models.minicpm_config import MiniCPMConfig
    config = MiniCPMConfig(**dict(tiny_minicpm_config(), **change))
    with pytest.raises(ValueError, match=match):
        loader.build_model(config, torch.float32, "meta", CpuPlatform(torch.device("cpu")).ops)
