"""FP8 weights (--quantization fp8, models/layers/quantization.py): close to full precision, the same
greedy tokens where the margin is clear, pre-quantized checkpoints of both Hub layouts load, and
the platforms that cannot run FP8 say so."""
from __future__ import annotations

import copy

import pytest
import torch

from baton.engine.platforms.base import LayerOps
from baton.engine.platforms.cpu import CpuPlatform
from baton.models import loader
from baton.models.attention_metadata import AttnMetadata
from baton.models.forward_context import ForwardContext
from baton.models.layers import quantization

PROMPTS = [[5, 70, 80, 90, 100, 7, 300, 12], [3, 4, 200, 201, 202, 203, 50, 9, 9, 1000, 77],
           torch.randint(10, 40000, (40,), generator=torch.Generator().manual_seed(1)).tolist()]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, request):
    """A tiny random Qwen3 checkpoint (bf16 source of every variant) and its two FP8 re-writes."""
    import os

    from helpers import save_fp8_checkpoint, save_tiny_checkpoint
    # the GPU machine carries the embedded tokenizer (BATON_TOKENIZER), not the model
    tokenizer = os.environ.get("BATON_TOKENIZER") or request.getfixturevalue("embedded_source").tokenizer_path
    root = tmp_path_factory.mktemp("quant")
    src = save_tiny_checkpoint("qwen3", root / "bf16", tokenizer, intermediate_size=192)
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


def test_fp8_inputs_quantized_by_the_op_before_change_no_number(tiny):
    """decoder.fuse_fp8_inputs (the engine's, after quantize_fp8): the RMSNorms before qkv_proj and gate_up_proj and the SiLU-and-mul before
    down_proj hand their projection its e4m3 input (Fp8Rows) instead of a tensor it quantizes;
    the final norm does not, and the logits are the unfused ones bit for bit."""
    from baton.models.decoder import fuse_fp8_inputs
    model, platform = _model(tiny["bf16"])
    quantization.quantize_fp8(model, platform.ops, platform.fp8_linear())
    assert fuse_fp8_inputs(model) == 3 * 2
    layer = model.model.layers[1]
    assert layer.input_layernorm.fp8_out and layer.post_attention_layernorm.fp8_out and layer.mlp.fp8_act
    assert not model.model.norm.fp8_out
    fused = [_logits(model, platform, ids) for ids in PROMPTS[:2]]
    for m in model.modules():
        m.__dict__.pop("fp8_out", None), m.__dict__.pop("fp8_act", None)
    assert not layer.input_layernorm.fp8_out
    for ids, got in zip(PROMPTS[:2], fused, strict=True):
        assert torch.equal(got, _logits(model, platform, ids))


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
    # --fp8-accumulation reaches the platform's GEMMs (CUDA's two modes: test_triton_fp8_gemm_sums_...
    # below); the CPU sums in float32 either way, so the tokens stay
    assert plain.engine.runner.platform.ops.fp8_fast_accum            # the default: fast
    exact = LLM(str(tiny["bf16"]), quantization="fp8", num_kv_blocks=64, max_model_len=256, fp8_accumulation="fp32")
    assert not exact.engine.runner.platform.ops.fp8_fast_accum
    assert exact.generate(prompt, sp)[0].token_ids == first


def test_gptq_rows_keep_the_grid_and_scales_and_lower_the_output_error():
    """gptq_rows (--fp8-rounding gptq): the same per-row scales and e4m3 grid as rounding to nearest,
    a weight whose input is always zero rounds to 0, and x @ w^T lands closer to the unrounded one than
    nearest's does, on the inputs the rounding was calibrated with and on fresh ones alike."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 128, generator=g)
    mix = torch.randn(128, 128, generator=g) / 8 + torch.eye(128)            # correlated inputs, as layers see
    x = torch.randn(1024, 128, generator=g) @ mix
    x[:, 5] = 0
    q, scale = quantization.gptq_rows(w, x.t() @ x)
    near_q, near_scale = quantization.quantize_rows(w)
    assert q.dtype == torch.float8_e4m3fn and torch.equal(scale, near_scale)
    assert torch.all(q[:, 5].float() == 0)
    fresh = torch.randn(512, 128, generator=g) @ mix
    fresh[:, 5] = 0
    for inputs in (x, fresh):
        exact = inputs @ w.t()
        err = float((inputs @ (q.float() * scale).t() - exact).norm())
        near = float((inputs @ (near_q.float() * near_scale).t() - exact).norm())
        assert err < 0.85 * near, (err, near)


def test_gptq_rounding_at_load_serves_closer_to_full_precision(tiny):
    """--fp8-rounding gptq: every decoder projection e4m3, rounded layer by layer on the fixed
    calibration text (engine/runner/fp8_rounding.py), the prompt's logprobs closer to full precision's than
    rounding to nearest; without --quantization fp8 the flag is refused."""
    from baton.benchmarks.quant_accuracy import fixed_text
    from baton.engine import LLM, SamplingParams
    from baton.engine.config import EngineConfig
    with pytest.raises(ValueError, match="add --quantization fp8"):
        EngineConfig(fp8_rounding="gptq").validate()
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    logprobs = {}
    for name, kw in (("full", {}), ("nearest", {"quantization": "fp8"}),
                     ("gptq", {"quantization": "fp8", "fp8_rounding": "gptq"})):
        llm = LLM(str(tiny["bf16"]), dtype="float32", num_kv_blocks=64, max_model_len=512, **kw)
        if name == "gptq":
            assert all(m.weight.dtype == torch.float8_e4m3fn for layer in llm.engine.runner.model.model.layers
                       for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                 layer.mlp.down_proj))
        ids = llm.tokenizer(fixed_text()[0])["input_ids"][:400]
        logprobs[name] = torch.tensor([e.logprob for e in llm.generate([ids], sp)[0].prompt_logprobs[1:]])
    off = {k: float((logprobs[k] - logprobs["full"]).abs().mean()) for k in ("nearest", "gptq")}
    assert off["gptq"] < off["nearest"], off             # (random weights: a few percent closer)


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
    with pytest.raises(ValueError, match="fp8_accumulation must be one of fp32, fast"):
        EngineConfig(quantization="fp8", fp8_accumulation="fp16").validate()
    config = json.loads((tiny["bf16"] / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}    # (awq, gptq: tests/test_int4.py)
    with pytest.raises(ValueError, match="checkpoint quantization 'bitsandbytes' is not supported"):
        quantization.checkpoint_method(type("C", (), config)())


# -- FP8 MoE experts (--quantization fp8 on the stacked experts) -----------------------------------------

@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory, request):
    """A tiny random Qwen3-MoE checkpoint (8 experts, top 2; layers 0 and 2 routed, 1 dense) and its
    two FP8 re-writes (every expert's gate/up/down projection in e4m3 with its scales)."""
    import os

    from helpers import save_fp8_checkpoint, save_tiny_checkpoint
    tokenizer = os.environ.get("BATON_TOKENIZER") or request.getfixturevalue("embedded_source").tokenizer_path
    root = tmp_path_factory.mktemp("quant-moe")
    src = save_tiny_checkpoint("qwen3_moe", root / "bf16", tokenizer, seed=3)
    return {"bf16": src, "fp8-block": save_fp8_checkpoint(src, root / "fp8-block", "fp8-block", block=48),
            "compressed-tensors": save_fp8_checkpoint(src, root / "ct", "compressed-tensors")}


def _dequantized_experts(model):
    """A copy of an FP8 model whose expert stacks are widened back (e4m3 times scales, float32) and
    run unscaled: the reference the e4m3 experts' math must give."""
    ref = copy.deepcopy(model)
    for layer in ref.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            s13, s2 = experts.scales
            experts.w13 = torch.nn.Parameter(experts.w13.float() * s13[..., None], requires_grad=False)
            experts.w2 = torch.nn.Parameter(experts.w2.float() * s2[..., None], requires_grad=False)
            experts.scales = None
    return ref


def test_fp8_experts_match_dequantized_weights_and_stay_close_to_full_precision(tiny_moe, monkeypatch):
    """--quantization fp8 on a MoE model: both expert stacks become e4m3 with one scale per (expert,
    output channel), the router stays in the model dtype; the e4m3 experts give what their widened
    weights give (float32 rounding apart). The experts alone in FP8 (weight-only: activations stay
    float32) move the logits ~1 % (RMS) and keep the argmax at >= 95 % of positions (measured 58 of
    59); the whole model in FP8 (its projections' activations in e4m3 too) stays within the dense
    model's bounds (_compare: 15 %, the same argmax where full precision decides). Weight-only
    experts throughout (the FP8 x FP8 dots, on by default, are the next test's)."""
    monkeypatch.setattr(quantization, "FP8_EXPERT_DOTS_ABOVE", None)
    model, platform = _model(tiny_moe["bf16"])
    fp8 = copy.deepcopy(model)
    assert quantization.quantize_fp8(fp8, platform.ops, platform.fp8_linear()) == 3 * 2 + 2 + 2 * 2
    block = fp8.model.layers[0].mlp
    assert block.experts.w13.dtype == block.experts.w2.dtype == torch.float8_e4m3fn
    assert block.experts.scales.w13.shape == (8, 64) and block.experts.scales.w2.shape == (8, 64)
    assert block.gate.weight.dtype == torch.float32
    assert fp8.model.layers[1].mlp.down_proj.weight.dtype == torch.float8_e4m3fn       # the dense layer
    for e in range(8):       # per (expert, row): each row's largest |w| is e4m3's largest, 448, times its scale
        wide = model.model.layers[0].mlp.experts.w2[e]
        torch.testing.assert_close(block.experts.scales.w2[e], wide.abs().amax(-1) / 448)
    experts_only = copy.deepcopy(model)
    for layer in experts_only.model.layers:
        if hasattr(layer.mlp, "experts"):
            quantization.quantize_experts(layer.mlp.experts)
    ref = _dequantized_experts(fp8)
    agree = total = 0
    for ids in PROMPTS:
        full, got = _logits(model, platform, ids), _logits(fp8, platform, ids)
        torch.testing.assert_close(got, _logits(ref, platform, ids), rtol=1e-5, atol=1e-5)
        _compare(full, got)
        alone = _logits(experts_only, platform, ids)
        assert float((alone - full).norm() / full.norm()) < 0.03
        agree, total = agree + int((alone.argmax(-1) == full.argmax(-1)).sum()), total + len(ids)
    assert agree >= 0.95 * total, (agree, total)


def test_fp8_experts_serve_greedy_tokens_close_to_full_precision(tiny_moe):
    """Served through the engine (chunked prefill, paged KV, decode, a prefix-cache hit): the FP8
    model's greedy tokens are its own model's next-token argmax (teacher-forced offline, >= 90 %:
    prefill and decode attention sum in other orders), and full precision's argmax on the same
    sequences agrees with them at >= 50 % of the generated positions (random weights: small margins;
    measured 24 of 24 and 18 of 24). A cache hit changes nothing."""
    from baton.engine import LLM, SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(tiny_moe["bf16"]), quantization="fp8", num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=32)
    outs = llm.generate(PROMPTS, sp)
    model, platform = _model(tiny_moe["bf16"])
    fp8 = copy.deepcopy(model)
    quantization.quantize_fp8(fp8, platform.ops, platform.fp8_linear())
    own = full = 0
    for ids, out in zip(PROMPTS, outs, strict=True):
        seq = ids + out.token_ids[:-1]
        tokens = torch.tensor(out.token_ids)
        own += int((_logits(fp8, platform, seq)[len(ids) - 1:].argmax(-1) == tokens).sum())
        full += int((_logits(model, platform, seq)[len(ids) - 1:].argmax(-1) == tokens).sum())
    n = 8 * len(PROMPTS)
    print(f"[fp8-experts] next-token agreement: own model {own}/{n}, full precision {full}/{n}")
    assert own >= 0.9 * n and full >= 0.5 * n, (own, full, n)
    again = llm.generate([PROMPTS[2]], sp)[0]
    assert again.cached_tokens >= 32 and again.token_ids == outs[2].token_ids


def test_fp8_expert_dots_follow_the_step_shape_and_round_where_the_kernels_do(tiny_moe, monkeypatch):
    """Above quantization.FP8_EXPERT_DOTS_ABOVE (token, choice) pairs an expert, FP8 experts run
    FP8 x FP8 (the fused kernel's rule, on the CPU too): each GEMM's input rows rounded to e4m3 per
    token, the products times token scale x channel scale: in float64 the numbers of the mirror of
    the kernels' roundings (helpers.fp8_expert_dots_mirror), and apart from weight-only's by the
    activations' e4m3 rounding (measured 3-5 %). A 200-token prompt through the tiny Qwen3-MoE
    (400 pairs over 8 experts: FP8 x FP8) stays within the dense FP8 bounds of full precision.
    (The default, 0: the dots at every size, measured on an H100 and an H200: docs/benchmarks.md.)"""
    from helpers import fp8_expert_dots_mirror
    assert quantization.FP8_EXPERT_DOTS_ABOVE == 0                    # the default: every step
    assert quantization.fp8_expert_dots(1, 8)
    monkeypatch.setattr(quantization, "FP8_EXPERT_DOTS_ABOVE", 24)
    assert quantization.fp8_expert_dots(8 * 24 + 1, 8) and not quantization.fp8_expert_dots(8 * 24, 8)
    monkeypatch.setattr(quantization, "FP8_EXPERT_DOTS_ABOVE", None)
    assert not quantization.fp8_expert_dots(10 ** 9, 8)               # off: weight-only at every size
    monkeypatch.setattr(quantization, "FP8_EXPERT_DOTS_ABOVE", 24)
    g = torch.Generator().manual_seed(0)
    t, e, k, h, i = 100, 8, 2, 64, 32
    x = torch.randn(t, h, generator=g, dtype=torch.float64)
    (q13, s13), (q2, s2) = (quantization.quantize_stacked(torch.randn(e, n, kk, generator=g) / kk ** 0.5)
                            for n, kk in ((2 * i, h), (h, i)))
    scales = quantization.ExpertScales(s13, s2)
    ids, weights = LayerOps().moe_route(torch.randn(t, e, generator=g), k, renormalize=True)
    weights = weights.double()
    ops = LayerOps()
    dots = ops.moe_experts(x, q13, q2, ids, weights, scales=scales)              # 200 pairs, 25 an expert: by rule
    assert torch.equal(dots, ops.moe_experts(x, q13, q2, ids, weights, scales=scales, fp8_dots=True))
    torch.testing.assert_close(dots, fp8_expert_dots_mirror(x, q13, q2, ids, weights, scales), rtol=1e-12, atol=1e-12)
    weight_only = ops.moe_experts(x, q13, q2, ids, weights, scales=scales, fp8_dots=False)
    below = ops.moe_experts(x[:96], q13, q2, ids[:96], weights[:96], scales=scales)    # 192 pairs: weight-only
    torch.testing.assert_close(below, weight_only[:96], rtol=1e-12, atol=1e-12)
    assert 0.01 < float((dots - weight_only).norm() / weight_only.norm()) < 0.1
    model, platform = _model(tiny_moe["bf16"])
    fp8 = copy.deepcopy(model)
    quantization.quantize_fp8(fp8, platform.ops, platform.fp8_linear())
    long = torch.randint(10, 40000, (200,), generator=torch.Generator().manual_seed(2)).tolist()
    _compare(_logits(model, platform, long), _logits(fp8, platform, long))


@pytest.mark.parametrize("fmt", ["fp8-block", "compressed-tensors"])
def test_prequantized_moe_checkpoints_load_their_experts_in_fp8(tiny_moe, fmt):
    """An FP8 MoE checkpoint (one e4m3 tensor per expert projection with its block or per-channel
    scales) loads without a flag into the same form: widened per expert into the stacks (close to the
    source), then e4m3 per (expert, output channel), and it serves."""
    from baton.engine import LLM, SamplingParams
    model, _ = _model(tiny_moe["bf16"])
    widened, _ = _model(tiny_moe[fmt])
    source = dict(model.named_parameters())
    for name, p in widened.named_parameters():
        torch.testing.assert_close(p, source[name], rtol=0.07, atol=1e-6)     # e4m3 keeps 3 mantissa bits
    llm = LLM(str(tiny_moe[fmt]), num_kv_blocks=32, max_model_len=128)
    runner = llm.engine.runner
    experts = runner.model.model.layers[2].mlp.experts
    assert runner.quantization == "fp8" and experts.w13.dtype == torch.float8_e4m3fn
    wide = widened.model.layers[2].mlp.experts.w13
    torch.testing.assert_close(experts.w13.float() * experts.scales.w13[..., None], wide, rtol=0.07, atol=1e-6)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert all(len(o.token_ids) == 4 for o in outs)


# -- FP8 KV cache (--kv-cache-dtype fp8) -------------------------------------------------------------

def test_fp8_kv_cache_serves_close_to_full_precision_and_halves_nothing_else(tiny):
    """The cache holds float8 e4m3 (a quarter of float32's bytes per token, half of bf16's), prefill
    (chunked: later chunks read earlier ones back from the cache) and decode agree with full
    precision where the model is decided, and the KV spec the workers compare says float8."""
    from baton.engine import LLM, SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    full = LLM(str(tiny["bf16"]), num_kv_blocks=32, max_model_len=128, max_num_batched_tokens=16)
    kv8 = LLM(str(tiny["bf16"]), num_kv_blocks=32, max_model_len=128, max_num_batched_tokens=16,
              kv_cache_dtype="fp8")
    assert kv8.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert kv8.engine.kv_spec.dtype == "float8_e4m3fn"
    assert kv8.engine.runner.block_bytes() * 4 == full.engine.runner.block_bytes()
    a, b = full.generate(PROMPTS, sp), kv8.generate(PROMPTS, sp)
    for x, y in zip(a, b, strict=True):
        lx = torch.tensor([e.logprob for e in x.prompt_logprobs[1:]])
        ly = torch.tensor([e.logprob for e in y.prompt_logprobs[1:]])
        assert float((lx - ly).abs().max()) < 0.1          # the prompt's own tokens: nearly the same logprobs
        assert x.token_ids[:2] == y.token_ids[:2]


def _rewrite(src, dst, edit):
    """A copy of checkpoint `src` at `dst` whose tensors went through edit(dict) first."""
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    (path,) = dst.glob("*.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return dst


def _prompt_logprobs(llm, sp):
    return [torch.tensor([e.logprob for e in o.prompt_logprobs[1:]]) for o in llm.generate(PROMPTS, sp)]


def test_kv_scales_per_head_keep_an_fp8_cache_close_where_scale_one_cannot(tiny, tmp_path):
    """A model whose values e4m3 cannot hold at scale 1: V a thousandth of the usual (below e4m3's
    smallest subnormal, 2^-9, mostly) and K three hundred times it (past +-448; q shrunk as much, so
    the scores stay). Scales calibrated at load (engine/runner/kv_scales.py) are powers of two, the same on
    a second load (the checksum the KV handshake compares), land each head's calibrated largest |K|
    and |V| in (448/8, 448/4], and keep the prompt's logprobs near full precision's, where scale 1
    (--kv-cache-scales one) is far off."""
    from baton.engine import LLM, SamplingParams
    from baton.engine.runner import kv_scales as ks

    def skew(t):
        for name in t:
            if name.endswith("v_proj.weight"):
                t[name] = t[name] * 1e-3
            elif name.endswith("k_norm.weight"):
                t[name] = t[name] * 300
            elif name.endswith("q_norm.weight"):
                t[name] = t[name] / 300
    path = str(_rewrite(tiny["bf16"], tmp_path / "skewed", skew))
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=0)
    kw = dict(num_kv_blocks=32, max_model_len=128, max_num_batched_tokens=16)    # chunked: later chunks read the cache
    full = _prompt_logprobs(LLM(path, **kw), sp)
    cal = LLM(path, kv_cache_dtype="fp8", **kw)
    runner = cal.engine.runner
    scales = runner.kv_scales
    assert scales.shape == (runner.model.num_layers, 2, runner.model.num_kv_heads)
    assert torch.equal(scales, torch.exp2(torch.log2(scales).round()))
    assert float(scales[:, 0].min()) >= 0.5 and float(scales[:, 1].max()) <= 2 ** -8
    again = LLM(path, kv_cache_dtype="fp8", **kw).engine
    assert torch.equal(again.runner.kv_scales, scales)
    assert again.kv_spec.kv_scales == cal.engine.kv_spec.kv_scales == ks.checksum(scales) != ""
    one = LLM(path, kv_cache_dtype="fp8", kv_cache_scales="one", **kw)
    assert one.engine.runner.kv_scales is None and one.engine.kv_spec.kv_scales == ""
    err_cal = max(float((a - b).abs().max()) for a, b in zip(full, _prompt_logprobs(cal, sp), strict=True))
    err_one = max(float((a - b).abs().max()) for a, b in zip(full, _prompt_logprobs(one, sp), strict=True))
    assert err_cal < 0.1 and err_one > 5 * err_cal, (err_cal, err_one)


def test_kv_scales_a_checkpoint_carries_are_used_and_a_partial_set_refused(tiny, tmp_path):
    """vLLM's and compressed-tensors' FP8 checkpoints carry self_attn.k_scale / v_scale per layer:
    an fp8 cache takes them (every kv head), a full-precision one ignores them, and scales for some
    layers only are refused."""
    from baton.engine import LLM

    def carry(t, layers=(0, 1)):
        for i in layers:
            t[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.25 * (i + 1))
            t[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.125)
    path = str(_rewrite(tiny["bf16"], tmp_path / "scaled", carry))
    kw = dict(num_kv_blocks=16, max_model_len=64)
    scales = LLM(path, kv_cache_dtype="fp8", **kw).engine.runner.kv_scales
    assert scales[:, 0, :].tolist() == [[0.25] * scales.shape[2], [0.5] * scales.shape[2]]
    assert bool((scales[:, 1] == 0.125).all())
    assert LLM(path, **kw).engine.runner.kv_scales is None
    partial = str(_rewrite(tiny["bf16"], tmp_path / "partial", lambda t: carry(t, (1,))))
    with pytest.raises(ValueError, match="KV cache scales for 1 of 2 layers"):
        LLM(partial, kv_cache_dtype="fp8", **kw)


def test_the_npu_refuses_an_fp8_kv_cache_clearly():
    from baton.engine.config import PlatformOptions
    from baton.engine.platforms import get_platform
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8 is not supported on Ascend"):
        get_platform("npu:0", PlatformOptions(npu_emulation=True)).check_kv_layout(128, 64, torch.float8_e4m3fn)


def _workers(prefill_kv: str, decode_kv: str, prefill_extra: tuple[str, ...] = ()):
    """A decode and a prefill worker (tiny-llama, CPU, in-memory KV backend) in this process."""
    from test_kv_handoff import workers
    return workers(("--kv-cache-dtype", prefill_kv, *prefill_extra), ("--kv-cache-dtype", decode_kv))


PD_PROMPT = list(range(1000, 1050))


async def _handoff(prefill_kv: str, decode_kv: str, prefill_extra: tuple[str, ...] = ()):
    """Admit on decode, prefill with a hand-off, collect the decode stream: (tokens, decode layout)."""
    import asyncio

    from baton.engine import SamplingParams
    from baton.serving.wire import sampling_to_proto
    from baton.v1 import decode_pb2, prefill_pb2
    async with _workers(prefill_kv, decode_kv, prefill_extra) as (prefill, decode):
        sampling = sampling_to_proto(SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        admitted = await decode.admit(decode_pb2.AdmitRequest(request_id="r", prompt_token_ids=PD_PROMPT,
                                                              sampling=sampling, timeout_ms=20_000))

        async def collect():
            return [t async for chunk in decode.stream("r", 20_000) for t in chunk.token_ids]
        stream = asyncio.ensure_future(collect())
        try:
            await prefill.prefill(prefill_pb2.PrefillRequest(
                request_id="r", prompt_token_ids=PD_PROMPT, sampling=sampling, handoff=prefill_pb2.Handoff(
                    decode_address=admitted.kv_address, transfer_id=admitted.transfer_id, backend=admitted.backend)))
            return await asyncio.wait_for(stream, 30), decode.core.core.layout
        finally:
            stream.cancel()


def test_fp8_kv_moves_between_workers_and_a_dtype_mismatch_is_refused():
    """Prefill and decode both at --kv-cache-dtype fp8: the float8 bytes move (a quarter of float32's
    here) and decode continues from them as it does from full-precision KV. A prefill at fp8 and a decode
    at auto: the hand-off is refused naming the dtypes; both at fp8 but under other K/V scales (the
    prefill's at 1, --kv-cache-scales one): refused naming the scales."""
    import asyncio

    from baton.kvtransfer.layout import KVLayout
    tokens, layout = asyncio.run(_handoff("fp8", "fp8"))
    assert layout.dtype == "float8_e4m3fn" and len(layout.kv_scales) == 16
    full = KVLayout(layout.model, layout.architecture, "float32", layout.block_size, layout.num_layers,
                    layout.num_kv_heads, layout.head_dim)
    assert layout.block_nbytes * 4 == full.block_nbytes
    want, full_layout = asyncio.run(_handoff("auto", "auto"))
    assert tokens == want and full_layout.dtype == "float32"
    with pytest.raises(Exception, match="dtype: prefill has 'float8_e4m3fn', decode has 'float32'") as err:
        asyncio.run(_handoff("fp8", "auto"))
    assert "--kv-cache-dtype" in str(err.value)
    with pytest.raises(Exception, match=f"kv_scales: prefill has '', decode has '{layout.kv_scales}'") as err:
        asyncio.run(_handoff("fp8", "fp8", ("--kv-cache-scales", "one")))
    assert "--kv-cache-scales" in str(err.value)


# -- CUDA: the Triton quantizer, the scaled GEMM, attention over a float8 cache, graphs -----------------
def on_gpu(test):
    from test_platform_cuda import on_gpu as mark
    return mark(test)


@on_gpu
def test_triton_row_quantizer_matches_torch_and_the_scaled_gemm_the_widened_one():
    from baton.engine.platforms.triton_kernels import quant
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 4100, generator=g) * torch.logspace(-3, 2, 37)[:, None]).to(torch.bfloat16).cuda()
    x[5] = 0
    q, s = quant.quantize_fp8_rows(x)
    q_ref, s_ref = quantization.quantize_rows(x)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    differ = (q.float() != q_ref.float()).float().mean().item()
    assert differ < 1e-3                              # a division's last bit may round a tie the other way
    w = (torch.randn(3072, 4100, generator=g) * 0.02).to(torch.bfloat16).cuda()[:, :4096]
    wq, ws = quantization.quantize_rows(w)
    from baton.engine.platforms.cuda import TritonLayerOps
    y = quantization.Fp8Matmul(ws.reshape(1, -1).contiguous(), TritonLayerOps(), "scaled_mm")(x[:, :4096], wq)
    ref = x[:, :4096].float() @ (wq.float() * ws).t()
    assert y.dtype == torch.bfloat16 and not y.isnan().any()
    err = ((y.float() - ref).norm() / ref.norm()).item()
    assert err < 0.05, err                              # e4m3 activations: ~3 % of the output's norm


@on_gpu
def test_triton_fp8_gemm_sums_in_float32_in_a_fixed_order_and_replays_from_a_graph(monkeypatch):
    """The Triton FP8 GEMM of decode sizes (triton_kernels/fp8_gemm.py): tokens on the MMA's narrow side
    or not, split-K or not, ragged M, N and K. With float32 outputs, within 5e-4 of the float64 product
    of the same e4m3 inputs (the tensor cores' partial sums promoted to float32 every 128 products; an
    H100 measured 1.3e-4 at K = 12288, a tenth of the bf16 output's own rounding); in bf16 within a
    rounding of `_scaled_mm`'s (1.4e-7 apart there); split-K adds its partials in split order (the same
    bits every call, the tile counts back at zero) and a captured call replays on new inputs as eager."""
    from baton.engine.platforms.triton_kernels import fp8_gemm, quant
    c = fp8_gemm.Fp8GemmConfig
    cases = [(16, 4096, 12288, c(16, 64, 128, 4)), (37, 320, 200, c(64, 128, 128, 2)),
             (200, 1024, 4096, c(64, 128, 128, 2, swap_ab=False)), (256, 6144, 4096, c(128, 64, 256, 1, num_stages=3)),
             (1, 512, 1024, c(16, 128, 128, 8))]
    monkeypatch.setattr(fp8_gemm, "TABLE", {(n, k): ((m, cfg),) for m, n, k, cfg in cases})
    g = torch.Generator().manual_seed(0)
    for m, n, k, cfg in cases:
        x = (torch.randn(m, k, generator=g) * torch.logspace(-2, 1, m)[:, None]).to(torch.bfloat16).cuda()
        xq, xs = quant.quantize_fp8_rows(x)
        wq, ws = quantization.quantize_rows((torch.randn(n, k, generator=g) * 0.02).cuda())
        ws = ws.reshape(1, -1).contiguous()
        exact = (xq.double() * xs.double()) @ (wq.double() * ws.double().t()).t()
        y32 = fp8_gemm.fp8_gemm(xq, xs, wq, ws, cfg, torch.float32)
        err = ((y32.double() - exact).norm() / exact.norm()).item()
        y = fp8_gemm.scaled_mm(xq, xs, wq, ws)                       # the TABLE's pick: this cfg
        if k % 16 == 0:                  # (_scaled_mm takes K in multiples of 16 only; the exact product else)
            ref = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16).double()
        else:
            ref = exact
        gap = ((y.double() - ref).norm() / ref.norm()).item()
        print(f"[fp8-gemm] M={m} N={n} K={k} {cfg}: float32 {err:.1e}, bf16 vs _scaled_mm {gap:.1e}")
        assert err < 5e-4 and gap < 5e-3, (err, gap)
        # --fp8-accumulation fast: the tensor cores' own sums, never promoted (an H100 measured up to
        # 1.3e-3 here; bf16 within 2.3e-3 of _scaled_mm's)
        fast = fp8_gemm.fp8_gemm(xq, xs, wq, ws, cfg, torch.float32, fast_accum=True)
        fast_err = ((fast.double() - exact).norm() / exact.norm()).item()
        fast_bf16 = fp8_gemm.scaled_mm(xq, xs, wq, ws, fast_accum=True).double()
        fast_gap = ((fast_bf16 - ref).norm() / ref.norm()).item()
        print(f"[fp8-gemm] fast: float32 {fast_err:.1e}, bf16 vs _scaled_mm {fast_gap:.1e}")
        assert fast_err < 5e-3 and fast_gap < 1e-2, (fast_err, fast_gap)
        assert torch.equal(fp8_gemm.scaled_mm(xq, xs, wq, ws), y)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fp8_gemm.scaled_mm(xq, xs, wq, ws)
        x2 = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
        xq2, xs2 = quant.quantize_fp8_rows(x2)
        xq.copy_(xq2)
        xs.copy_(xs2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, fp8_gemm.scaled_mm(xq, xs, wq, ws))
    assert not fp8_gemm.WORKSPACE.get(torch.device("cuda", torch.cuda.current_device()))[1].any()


@on_gpu
def test_triton_fp8_gemm_measured_tables_are_valid():
    """Every GPU's measured table (fp8_gemm_tables.json): M increasing, split-K dividing K's blocks,
    and the workspace it sizes a few MiB, not a share of the KV cache."""
    import json

    from baton.engine.platforms.triton_kernels import fp8_gemm
    tables = json.loads(fp8_gemm.TABLES_FILE.read_text())
    assert tables
    for gpu, entry in tables.items():
        table = fp8_gemm.parse_table(entry)
        for (n, k), rows in table.items():
            ms = [largest for largest, _ in rows]
            assert ms == sorted(ms), (gpu, n, k)
            for _largest, cfg in rows:
                assert cfg is None or -(-k // cfg.block_k) % cfg.split_k == 0, (gpu, n, k, cfg)
        floats, tiles = fp8_gemm.WORKSPACE.needed(table)
        assert 4 * floats + 4 * tiles < 32 * 2 ** 20, gpu


@on_gpu
def test_triton_norm_and_silu_write_the_quantizers_fp8_input_on_cuda():
    """The fused RMSNorm / add-RMSNorm / SiLU-and-mul with e4m3 outputs give what the op followed
    by the per-token quantizer gives (rows wider than one program takes: the two kernels)."""
    from baton.engine.platforms.triton_kernels import layer_ops, quant
    g = torch.Generator().manual_seed(0)

    def same(fused, values, scales):
        torch.testing.assert_close(fused.scales, scales, rtol=0, atol=0)
        differ = (fused.values.view(torch.uint8) != values.view(torch.uint8)).float().mean().item()
        assert differ < 1e-3, differ                   # a division's last bit may round a tie the other way

    x = (torch.randn(37, 4096, generator=g) * torch.logspace(-2, 1, 37)[:, None]).to(torch.bfloat16).cuda()
    x[5] = 0
    res = torch.randn(37, 4096, generator=g).to(torch.bfloat16).cuda()
    w = (1 + 0.2 * torch.randn(4096, generator=g)).to(torch.bfloat16).cuda()
    same(layer_ops.rms_norm_fp8(x, w, 1e-6), *quant.quantize_fp8_rows(layer_ops.rms_norm(x, w, 1e-6)))
    fused, total = layer_ops.add_rms_norm_fp8(x, res, w, 1e-6)
    normed, total_ref = layer_ops.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(total, total_ref)
    same(fused, *quant.quantize_fp8_rows(normed))
    for width in (12288, 20000):                         # qwen3-8b's intermediate size; one past 16384
        h = (torch.randn(9, 2 * width, generator=g) * 3).to(torch.bfloat16).cuda()
        same(layer_ops.silu_and_mul_fp8(h), *quant.quantize_fp8_rows(layer_ops.silu_and_mul(h)))


@on_gpu
def test_attention_over_a_float8_cache_matches_the_widened_reference():
    """Store, decode and prefill-with-context on a float8 e4m3 cache against the CPU reference run
    on the same cache widened to float64."""
    from test_platform_cuda import cuda_platform, make_batch, rel_err
    fp8 = torch.float8_e4m3fn
    platform, cpu = cuda_platform(), CpuPlatform(torch.device("cpu"))
    for ctx, qlen in (([16, 600, 4100, 32], [1, 1, 1, 1]), ([0, 40, 300], [19, 7, 64])):
        batch = make_batch(ctx, qlen, 4, 128, 16, torch.bfloat16, seed=len(ctx))
        k8, v8 = (c.float().clamp(-448, 448).to(fp8) for c in (batch.k_cache, batch.v_cache))
        k_new, v_new = batch.k * 3, batch.v * 500                        # v beyond +-448: saturates, no NaN
        platform.store_kv(k_new, v_new, k8, v8, batch.meta.slot_mapping)
        slots = batch.meta.slot_mapping
        stored = k8.view(torch.uint8).view(-1, 2, 128)[slots]           # the bytes: float8 indexing varies by build
        assert torch.equal(stored, k_new.float().clamp(-448, 448).to(fp8).view(torch.uint8))
        assert not v8.float().isnan().any() and v8.float().abs().max() == 448
        scale = 128 ** -0.5
        q = batch.q.double().cpu()
        wide = k8.double().cpu(), v8.double().cpu()
        meta = batch.meta
        if meta.is_decode:
            out = platform.decode_attention(batch.q, k8, v8, meta, scale)
            ref = cpu.decode_attention(q, *wide, _on_cpu(meta), scale)
        else:
            out = platform.prefill_attention(batch.q, k_new, v_new, k8, v8, meta, scale)
            ref = cpu.prefill_attention(q, k_new.double().cpu(), v_new.double().cpu(), *wide, _on_cpu(meta), scale)
        assert rel_err(out.cpu(), ref) < 1e-2


@on_gpu
def test_attention_over_a_float8_cache_with_per_head_scales_matches_the_cpu_reference():
    """Per-(kv head) K and V scales (engine/runner/kv_scales.py), powers of two from 2^-6 to 2^3: the Triton
    store divides by them (the CPU's bytes), and decode, deterministic mode's rows, prefill with
    context (every key from the cache) and without (this step's own keys rounded as cached) multiply
    them back: the CPU reference's numbers on the same bytes, in float64."""
    from test_platform_cuda import KV_HEADS, cuda_platform, make_batch, rel_err
    fp8 = torch.float8_e4m3fn
    platform, cpu = cuda_platform(), CpuPlatform(torch.device("cpu"))
    spread = torch.exp2(torch.randint(-6, 4, (2, KV_HEADS), generator=torch.Generator().manual_seed(3)).float())
    kv_scale = spread.cuda()
    for ctx, qlen in (([16, 600, 4100, 32], [1, 1, 1, 1]), ([0, 40, 300], [19, 7, 64]), ([0, 0], [33, 5])):
        batch = make_batch(ctx, qlen, 4, 128, 16, torch.bfloat16, seed=len(ctx))
        k8, v8 = (c.float().clamp(-448, 448).to(fp8) for c in (batch.k_cache, batch.v_cache))
        ck, cv = k8.cpu(), v8.cpu()
        k_new = (batch.k.float() * 8 * spread[0, :, None].cuda()).to(torch.bfloat16)     # each head its own size
        v_new = (batch.v.float() * spread[1, :, None].cuda()).to(torch.bfloat16)
        platform.store_kv(k_new, v_new, k8, v8, batch.meta.slot_mapping, kv_scale)
        meta, cmeta = batch.meta, _on_cpu(batch.meta)
        cpu.store_kv(k_new.cpu(), v_new.cpu(), ck, cv, cmeta.slot_mapping, spread)
        assert torch.equal(k8.view(torch.uint8).cpu(), ck.view(torch.uint8))
        assert torch.equal(v8.view(torch.uint8).cpu(), cv.view(torch.uint8))
        scale = 128 ** -0.5
        q = batch.q.double().cpu()
        if meta.is_decode:
            ref = cpu.decode_attention(q, ck, cv, cmeta, scale, spread)
            for out in (platform.decode_attention(batch.q, k8, v8, meta, scale, kv_scale),
                        platform.row_attention(batch.q, k8, v8, meta, scale, kv_scale)):
                assert rel_err(out.cpu(), ref) < 1e-2
        else:
            out = platform.prefill_attention(batch.q, k_new, v_new, k8, v8, meta, scale, kv_scale)
            ref = cpu.prefill_attention(q, k_new.double().cpu(), v_new.double().cpu(), ck, cv, cmeta, scale, spread)
            assert rel_err(out.cpu(), ref) < 1e-2


@on_gpu
def test_a_prefills_own_keys_round_in_one_kernel_as_the_cache_holds_them():
    """kv_store.rounded_as_cached (one launch for K and V, a float8 cache's prefill without context):
    base.as_cached's numbers with no scale and with powers of two (saturating past 448), and with
    any scale what the store kernel writes to the cache, times the scale."""
    from baton.engine.platforms.base import as_cached
    from baton.engine.platforms.triton_kernels import kv_store
    fp8 = torch.float8_e4m3fn
    g = torch.Generator().manual_seed(0)
    qkv = (torch.randn(37, 12, 128, generator=g) * 200).to(torch.bfloat16).cuda()
    k, v = qkv[:, 8:10], qkv[:, 10:12]                      # views of a fused projection, as in a layer
    for scale in (None, torch.exp2(torch.tensor([[-3.0, 2.0], [0.0, -6.0]])), torch.tensor([[0.37, 3.1], [1.7, 0.011]])):
        s = None if scale is None else scale.cuda().contiguous()
        rk, rv = kv_store.rounded_as_cached(k, v, s)
        assert rk.dtype == k.dtype and rk.is_contiguous() and rk.shape == k.shape
        if scale is None or bool((torch.log2(scale) == torch.log2(scale).round()).all()):
            assert torch.equal(rk, as_cached(k, fp8, None if s is None else s[0]))
            assert torch.equal(rv, as_cached(v, fp8, None if s is None else s[1]))
        k8 = torch.zeros(3, 16, 2, 128, dtype=fp8, device="cuda")
        v8 = torch.zeros_like(k8)
        kv_store.store_kv(k, v, k8, v8, torch.arange(37, dtype=torch.int32, device="cuda"), s)
        one = torch.ones(2, 2, device="cuda") if s is None else s
        held_k = (k8.view(-1, 2, 128)[:37].float() * one[0, :, None]).to(torch.bfloat16)
        held_v = (v8.view(-1, 2, 128)[:37].float() * one[1, :, None]).to(torch.bfloat16)
        assert torch.equal(rk, held_k) and torch.equal(rv, held_v)
    assert kv_store.rounded_as_cached(k[:0], v[:0])[0].shape == (0, 2, 128)


def _on_cpu(meta: AttnMetadata) -> AttnMetadata:
    import dataclasses
    return dataclasses.replace(meta, **{n: getattr(meta, n).cpu() for n in
                                        ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")})


@on_gpu
def test_fp8_weights_and_kv_on_cuda_replay_graphs_as_eager_and_track_the_cpu(tiny, monkeypatch):
    """A tiny Qwen3 on cuda:0 with FP8 weights and an FP8 KV cache: captured decode graphs give the
    eager tokens, and the logprobs of the prompt stay near the CPU's FP8 ones. Decode steps (M <= 16)
    run every projection through the Triton FP8 GEMM with split-K (a TABLE for the tiny shapes),
    prefill through `_scaled_mm`."""
    import json

    from baton.engine import LLM, SamplingParams
    from baton.engine.platforms.triton_kernels import fp8_gemm
    cfg = json.loads((tiny["bf16"] / "config.json").read_text())
    h, d, i = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]           # qkv, o, gate_up, down
    monkeypatch.setattr(fp8_gemm, "TABLE", {(n, k): ((16, fp8_gemm.Fp8GemmConfig(16, 64, 64, -(-k // 64))),)
                                            for n, k in shapes})
    calls = []
    triton_gemm = fp8_gemm.fp8_gemm
    monkeypatch.setattr(fp8_gemm, "fp8_gemm", lambda *a, **kw: calls.append(1) or triton_gemm(*a, **kw))
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=0)
    kw = dict(num_kv_blocks=64, max_model_len=256, quantization="fp8", kv_cache_dtype="fp8", dtype="bfloat16")
    graphs = LLM(str(tiny["bf16"]), device="cuda:0", **kw)
    assert graphs.engine.runner.graphs is not None
    eager = LLM(str(tiny["bf16"]), device="cuda:0", enforce_eager=True, **kw)
    cpu = LLM(str(tiny["bf16"]), **kw)
    a, b, c = (m.generate(PROMPTS, sp) for m in (graphs, eager, cpu))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert len(calls) >= 4 * cfg["num_hidden_layers"] * 11                # eager's decode steps
    for x, y in zip(a, c, strict=True):
        lx = torch.tensor([e.logprob for e in x.prompt_logprobs[1:]])
        ly = torch.tensor([e.logprob for e in y.prompt_logprobs[1:]])
        assert float((lx - ly).abs().mean()) < 0.1


# -- W8A8 INT8 (--quantization w8a8): torch_npu's documented ops (emulated), the CPU's torch._int_mm ---------
def test_emulated_w8a8_ops_compute_what_their_documents_say():
    from baton.engine.platforms.npu_emulation import NpuEmulationError, emulated_torch_npu
    npu = emulated_torch_npu()
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 96, generator=g) * 3).to(torch.bfloat16)
    x[2] = 0
    y, scale = npu.npu_dynamic_quant(x)
    assert y.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (6,)
    torch.testing.assert_close(scale, x.float().abs().amax(-1) / 127)
    assert torch.equal(y[2], torch.zeros(96, dtype=torch.int8)) and int(y.abs().max()) == 127
    q, s = quantization.quantize_rows_int8(x)                   # the CPU path's quantizer: the same numbers
    assert torch.equal(q, y) and torch.equal(s[:, 0], scale)
    w = torch.randint(-127, 128, (96, 40), generator=g, dtype=torch.int8)      # x2 [K, N]
    ws = torch.rand(40, generator=g) / 100
    out = npu.npu_quant_matmul(y, w, ws, pertoken_scale=scale, output_dtype=torch.bfloat16)
    ref = (y.long() @ w.long()).double() * ws.double() * scale.double()[:, None]
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-6)
    with pytest.raises(NpuEmulationError, match="x dtype must be float16 or bfloat16"):
        npu.npu_dynamic_quant(x.float())
    with pytest.raises(NpuEmulationError, match="pertoken_scale must be float32"):
        npu.npu_quant_matmul(y, w, ws, pertoken_scale=scale[:5], output_dtype=torch.bfloat16)
    with pytest.raises(NpuEmulationError, match="disagree on K"):
        npu.npu_quant_matmul(y, w[:64], ws, output_dtype=torch.bfloat16)


def test_w8a8_on_the_cpu_stays_close_to_full_precision(tiny):
    """int8 weights per channel and int8 tokens through torch._int_mm: logits close (int8 keeps
    more bits than e4m3), the same argmax where full precision decides."""
    from baton.engine.platforms.cpu import CpuPlatform as Cpu
    model, platform = _model(tiny["bf16"])
    w8 = copy.deepcopy(model)
    assert quantization.quantize_w8a8(w8, Cpu(torch.device("cpu"))) == 2 * 4
    assert w8.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.int8
    decided = [_compare(_logits(model, platform, ids), _logits(w8, platform, ids)) for ids in PROMPTS]
    decided, agree, total = (sum(c) for c in zip(*decided, strict=True))
    assert agree >= 0.9 * total, (decided, agree, total)


def test_w8a8_on_the_emulated_npu_gives_the_cpu_w8a8_model_under_graphs(tiny):
    """--quantization w8a8 on npu:0 (emulated torch_npu: npu_dynamic_quant + npu_quant_matmul, K-major
    int8 weights), decode captured in graphs: the prompt's logprobs match the CPU's w8a8 run (same
    int8 numbers; the scales multiply in another order) and the greedy tokens agree."""
    from baton.engine import LLM, SamplingParams
    kw = dict(dtype="bfloat16", block_size=128, num_kv_blocks=16, max_num_seqs=4, max_num_batched_tokens=128,
              quantization="w8a8")           # (test_npu_models.ENGINE: what the emulated FIA takes)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    cpu = LLM(str(tiny["bf16"]), **kw).generate(PROMPTS, sp)
    llm = LLM(str(tiny["bf16"]), device="npu:0", npu_emulation=True, fused_ops=False, **kw)
    assert llm.engine.runner.graphs is not None
    w = llm.engine.runner.model.model.layers[0].self_attn.o_proj.weight
    assert w.dtype == torch.int8 and w.t().is_contiguous()
    npu = llm.generate(PROMPTS, sp)
    for a, b in zip(cpu, npu, strict=True):
        la = torch.tensor([e.logprob for e in a.prompt_logprobs[1:]])
        lb = torch.tensor([e.logprob for e in b.prompt_logprobs[1:]])
        assert float((la - lb).abs().max()) < 0.05
        assert a.token_ids[:4] == b.token_ids[:4]


def test_w8a8_is_refused_where_it_has_no_path():
    from baton.engine.platforms.cuda import CudaPlatform
    with pytest.raises(ValueError, match="on CUDA use --quantization fp8"):
        CudaPlatform(torch.device("cuda")).int8_linear()


@pytest.mark.parametrize("model,bound", [("tiny", 0.05), ("tiny_moe", 0.1)])
def test_fp8_under_tensor_parallelism_tracks_one_rank(model, bound, request):
    """Two CPU ranks (gloo), FP8 weights and an FP8 KV cache: each rank quantizes its own shard (its
    rows' scales; a MoE's experts: its slice of every expert's intermediate dimension, w2's scales
    over its half of each row), and the prompt's logprobs stay near one rank's. (The MoE model's
    bound: FP8 itself moves its logprobs by 0.04-0.075 from full precision's, and two ranks round
    other halves of the rows: measured 0.04-0.074 from one rank; full precision: 0.0.)"""
    from baton.engine import LLM, SamplingParams
    path = str(request.getfixturevalue(model)["bf16"])
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    kw = dict(num_kv_blocks=32, max_model_len=128, quantization="fp8", kv_cache_dtype="fp8")
    one = LLM(path, **kw).generate(PROMPTS, sp)
    llm = LLM(path, tp_size=2, **kw)
    try:
        two = llm.generate(PROMPTS, sp)
    finally:
        llm.engine.runner.close()
    for a, b in zip(one, two, strict=True):
        la = torch.tensor([e.logprob for e in a.prompt_logprobs[1:]])
        lb = torch.tensor([e.logprob for e in b.prompt_logprobs[1:]])
        assert float((la - lb).abs().mean()) < bound
