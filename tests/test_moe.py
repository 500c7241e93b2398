"""Qwen3-MoE (models/qwen3_moe.py, models/layers/moe.py) served disaggregated: 1 prefill + 1
decode worker give transformers' greedy tokens. Offline parity per config and TP=2 are in
test_engine.py; the preset's shapes in test_models.py."""
from __future__ import annotations

import os

import pytest
import torch
from cluster import Cluster
from helpers import hf_greedy, save_tiny_checkpoint
from test_services import collect

from baton.v1 import router_pb2


@pytest.mark.slow
def test_moe_model_served_by_one_prefill_and_one_decode_worker_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from baton.models.source import resolve_model
    tokenizer_dir = os.environ.get("BATON_TOKENIZER") or resolve_model(None).tokenizer_path
    path = save_tiny_checkpoint("qwen3_moe", tmp_path / "moe", tokenizer_dir, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (6, 37, 70)]
    want = hf_greedy(hf, prompts, 12)
    common = ["--model", str(path), "--dtype", "float32", "--num-kv-blocks", "64", "--block-size", "16",
              "--max-num-batched-tokens", "32"]                          # 70 tokens: a chunked prefill
    c = Cluster.launch(tmp_path / "logs", prefill=1, decode=1, worker_args=common, router_args=["--model", str(path)])
    try:
        stub = c.stub()
        for prompt, tokens in zip(prompts, want, strict=True):
            req = router_pb2.GenerateRequest(tokens=router_pb2.TokenIds(ids=prompt), sampling=router_pb2.SamplingParams(
                temperature=0, max_tokens=12, ignore_eos=True))
            ids, _, _ = collect(stub, req)
            assert ids == tokens
        again, _, last = collect(stub, router_pb2.GenerateRequest(            # prefix cache hit, same tokens
            tokens=router_pb2.TokenIds(ids=prompts[2]),
            sampling=router_pb2.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)))
        assert again == want[2] and last.usage.cached_prompt_tokens >= 64
    finally:
        c.stop()
