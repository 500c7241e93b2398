"""MiniCPM4 and Qwen3-VL on the NPU platform: through the emulation of the documented torch_npu
ops (engine/platforms/npu_emulation/) in CI, and on the real ops wherever torch_npu imports
(never here). bf16 with NPU attention's block size 128, decode steps captured as graphs, layer
ops plain torch (as the platform contract's parity case): the emulated platform must give the
CPU platform's greedy tokens; a device's bf16 kernels round differently, so there the first
tokens must agree, not all. Nothing here ran on an Ascend device."""
from __future__ import annotations

import os

import pytest
import torch
from minicpm_reference import save_tiny_minicpm, tiny_minicpm_config
from test_npu_moe import BACKENDS
from vl_helpers import png, save_tiny_vl_checkpoint

from baton.engine import LLM, SamplingParams

ENGINE = dict(dtype="bfloat16", block_size=128, num_kv_blocks=16, max_num_seqs=4, max_num_batched_tokens=128)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture(scope="module")
def tokenizer_dir():
    from baton.models.source import resolve_model
    return os.environ.get("BATON_TOKENIZER") or resolve_model(None).tokenizer_path


def _on_both(path, run, backend):
    """(CPU platform's tokens, NPU platform's tokens, how many decode steps replayed a graph)."""
    want = run(LLM(str(path), device="cpu", **ENGINE))
    llm = LLM(str(path), device="npu:0", npu_emulation=backend == "emulation", fused_ops=False, **ENGINE)
    graphs = llm.engine.runner.graphs
    assert graphs is not None, "decode was kept eager on the NPU platform"
    replays, replay = [], graphs.run
    graphs.run = lambda *a: replays.append(a) or replay(*a)
    try:
        got = run(llm)
    finally:
        graphs.run = replay
    return want, got, len(replays)


def _agree(backend, got, want) -> None:
    if backend == "torch_npu":
        assert all(a[:3] == b[:3] for a, b in zip(got, want, strict=True))
    else:
        assert got == want


def test_tiny_minicpm4_on_the_npu_platform_gives_the_cpu_greedy_tokens(backend, tokenizer_dir, tmp_path):
    path = save_tiny_minicpm(tmp_path / "minicpm", tokenizer_dir, tiny_minicpm_config(), seed=7)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 23, 40)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want, got, replays = _on_both(path, lambda llm: [o.token_ids for o in llm.generate(prompts, params)], backend)
    assert replays
    _agree(backend, got, want)


def test_tiny_qwen3_vl_with_an_image_on_the_npu_platform_gives_the_cpu_greedy_tokens(backend, tokenizer_dir,
                                                                                      tmp_path):
    """The vision tower and MRoPE prefill on the NPU platform; decode (text-only, offset rotary)
    replayed from graphs."""
    path = save_tiny_vl_checkpoint(tmp_path / "vl", tokenizer_dir, seed=9)
    chats = [[{"role": "user", "content": [{"type": "image", "image": png(40, 30, 3)},
                                           {"type": "text", "text": "What is in this picture?"}]}],
             [{"role": "user", "content": "What is the capital of France?"}]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want, got, replays = _on_both(path, lambda llm: [o.token_ids for o in llm.chat(chats, params)], backend)
    assert replays
    _agree(backend, got, want)
