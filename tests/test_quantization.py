"""FP8 weights (--quantization fp8, models/layers/quantization.py): close to full precision, the same
greedy tokens where the margin is clear, pre-quantized checkpoints of both Hub layouts load, and
the platforms that cannot run FP8 say so."""
from __future__ import annotations

import copy

import pytest
import torch

from baton.engine.platforms.cpu import CpuPlatform
from baton.models import loader
from baton.models.attention_metadata import AttnMetadata
from baton.models.forward_context import ForwardContext
from baton.models.layers import quantization

PROMPTS = [[5, 70, 80, 90, 100, 7, 300, 12], [3, 4, 200, 201, 202, 203, 50, 9, 9, 1000, 77],
           torch.randint(10, 40000, (40,), generator=torch.Generator().manual_seed(1)).tolist()]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, embedded_source):
    """A tiny random Qwen3 checkpoint (bf16 source of every variant) and its two FP8 re-writes."""
    from helpers import save_fp8_checkpoint, save_tiny_checkpoint
    root = tmp_path_factory.mktemp("quant")
    src = save_tiny_checkpoint("qwen3", root / "bf16", embedded_source.tokenizer_path, intermediate_size=192)
    return {"bf16": src,
            # 48-wide blocks: the 64-wide hidden and 192-wide MLP end in partial blocks, as real ones may
            "fp8-block": save_fp8_checkpoint(src, root / "fp8-block", "fp8-block", block=48),
            "compressed-tensors": save_fp8_checkpoint(src, root / "ct", "compressed-tensors")}


def _model(path):
    from transformers import AutoConfig
    platform = CpuPlatform(torch.device("cpu"))
    model = loader.build_model(AutoConfig.from_pretrained(path), torch.float32, "cpu", platform.ops)
    loader.load_weights(model, path)
    return model.eval(), platform


def _logits(model, platform, ids):
    n = len(ids)
    meta = AttnMetadata(is_decode=False, slot_mapping=torch.full((n,), -1), query_start_loc=torch.tensor([0, n]),
                        seq_lens=torch.tensor([n]), block_tables=torch.zeros(1, 1, dtype=torch.int32),
                        max_query_len=n, max_seq_len=n, has_context=False, query_start_loc_cpu=[0, n],
                        seq_lens_cpu=[n])
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n), ForwardContext(meta, None, platform,
                                                                                             model.head_dim ** -0.5)))


def _compare(ref: torch.Tensor, got: torch.Tensor) -> tuple[int, int]:
    """Logits within 15 % (RMS: random weights, e4m3 weights and activations each ~4 %) of full precision's; the same argmax at every position where full
    precision's top two are further apart than twice the largest error seen there (where it is
    decided). Returns (positions decided, argmax agreeing, positions)."""
    assert float((got - ref).norm() / ref.norm()) < 0.15
    err = (got - ref).abs().max(dim=-1).values
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * err
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])
    return int(clear.sum()), int((got.argmax(-1) == ref.argmax(-1)).sum()), ref.shape[0]


def test_rows_quantize_within_e4m3_rounding_and_scaled_mm_matches_dequantized():
    torch.manual_seed(0)
    x = torch.randn(5, 96) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 5.0])[:, None]
    q, s = quantization.quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 1)
    back = q.float() * s
    assert torch.all((back - x).abs() <= x.abs().amax(-1, keepdim=True) * 2 ** -4 + 1e-30)
    assert torch.all(back[3] == 0)                        # an all-zero row stays zero (no 0/0)
    w = torch.randn(48, 96)
    layer = torch.nn.Linear(96, 48, bias=False)
    layer.weight.data.copy_(w)
    wq, ws = quantization.quantize_rows(w)
    ops = CpuPlatform(torch.device("cpu")).ops
    fast = quantization.Fp8Matmul(ws.reshape(1, -1), ops, "scaled_mm")(x, wq)
    widened = torch.nn.functional.linear(back, wq.float() * ws)
    torch.testing.assert_close(fast, widened, rtol=1e-5, atol=1e-5)
    slow = quantization.Fp8Matmul(ws.reshape(1, -1), ops, "dequant")(x, wq)       # weights only: near, not equal
    torch.testing.assert_close(slow, x @ (wq.float() * ws).t(), rtol=1e-5, atol=1e-5)


def test_fp8_weights_stay_close_to_full_precision(tiny):
    """Quantized at load (--quantization fp8): the projections become e4m3 with per-row scales,
    the embedding, LM head and norms do not, and the logits stay close."""
    model, platform = _model(tiny["bf16"])
    fp8 = copy.deepcopy(model)
    n = quantization.quantize_fp8(fp8, platform.ops, platform.fp8_linear())
    assert n == 2 * 4                                     # qkv, o, gate_up, down per layer
    layer = fp8.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert fp8.model.embed_tokens.weight.dtype == torch.float32 and fp8.lm_head.weight.dtype == torch.float32
    decided = [_compare(_logits(model, platform, ids), _logits(fp8, platform, ids)) for ids in PROMPTS]
    decided, agree, total = (sum(c) for c in zip(*decided, strict=True))
    assert decided >= 2 and agree >= 0.75 * total, (decided, agree, total)    # random weights: small margins


@pytest.mark.parametrize("fmt", ["fp8-block", "compressed-tensors"])
def test_prequantized_checkpoints_load_and_serve_fp8(tiny, fmt):
    """A checkpoint with a quantization_config (the `fp8` method's 128x128-style blocks of
    weight_scale_inv, or compressed-tensors' per-channel weight_scale) is read without a flag:
    its weights widened by their scales match the source, and the engine serves it in FP8."""
    from baton.engine import LLM, SamplingParams
    model, platform = _model(tiny["bf16"])
    widened, _ = _model(tiny[fmt])
    for name, p in widened.named_parameters():
        ref = dict(model.named_parameters())[name]
        torch.testing.assert_close(p, ref, rtol=0.07, atol=1e-6)     # e4m3 keeps 3 mantissa bits
    llm = LLM(str(tiny[fmt]), num_kv_blocks=32, max_model_len=128)
    assert llm.engine.runner.quantization == "fp8"
    assert llm.engine.runner.model.model.layers[1].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert all(len(o.token_ids) == 6 for o in outs)


def test_fp8_serving_keeps_prefix_cache_and_speculation_exact(tiny):
    """With FP8 weights, a prefix-cache hit and ngram speculation give the tokens plain decoding
    gives (the matmul changes, the engine around it does not)."""
    from baton.engine import LLM, SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = [PROMPTS[0] * 4]
    plain = LLM(str(tiny["bf16"]), quantization="fp8", num_kv_blocks=64, max_model_len=256)
    first = plain.generate(prompt, sp)[0].token_ids
    again = plain.generate(prompt, sp)[0]
    assert again.cached_tokens >= 16 and again.token_ids == first          # a prefix-cache hit, same tokens
    spec = LLM(str(tiny["bf16"]), quantization="fp8", num_kv_blocks=64, max_model_len=256,
               speculative_method="ngram", num_speculative_tokens=3)
    assert spec.generate(prompt, sp)[0].token_ids == first


def test_what_cannot_run_fp8_is_refused_clearly(tiny, tmp_path):
    import json

    from baton.engine.config import EngineConfig, PlatformOptions
    from baton.engine.platforms import get_platform
    with pytest.raises(ValueError, match="not supported on Ascend"):
        get_platform("npu:0", PlatformOptions(npu_emulation=True)).fp8_linear()
    with pytest.raises(ValueError, match="--deterministic does not cover quantized"):
        EngineConfig(quantization="fp8", deterministic=True).validate()
    with pytest.raises(ValueError, match="quantization must be one of fp8"):
        EngineConfig(quantization="int4").validate()
    config = json.loads((tiny["bf16"] / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    with pytest.raises(ValueError, match="checkpoint quantization 'awq' is not supported"):
        quantization.checkpoint_method(type("C", (), config)())
