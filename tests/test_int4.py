"""INT4 weight-only checkpoints (AWQ, GPTQ; models/layers/int4.py): written here in their on-disk formats,
they load packed (~1/4 of bf16's bytes), every projection multiplies as its dequantized weight does, the
engine decodes the greedy tokens transformers decodes from the dequantized weights, bad checkpoints are
refused clearly, and the Ascend path (emulated) and the Triton kernel (interpreted) give the reference's
numbers."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from helpers import in_triton_interpreter
from safetensors.torch import load_file, save_file

from baton.engine.platforms.cpu import CpuPlatform
from baton.models import loader
from baton.models.layers import int4

PROMPTS = [[5, 70, 80, 90, 100, 7, 300, 12], [3, 4, 200, 201, 202, 203, 50, 9, 9, 1000, 77]]
SHAPE = dict(hidden_size=128, intermediate_size=256)       # K of every projection: a multiple of 128
VARIANTS = {"awq-g128": ("awq", 128, False), "awq-g32": ("awq", 32, False), "gptq-g64": ("gptq", 64, False),
            "gptq-act-g32": ("gptq", 32, True), "gptq_v2-act-g128": ("gptq_v2", 128, True)}


# -- the formats, as AutoAWQ's and AutoGPTQ's packers write them ---------------------------------

def _quantize(w: torch.Tensor, group: int, g_idx: torch.Tensor):
    """w [N, K] asymmetric 4-bit per group of input rows (g_idx: each row's group): (q uint8 [K, N],
    zeros uint8 [G, N], scales fp16 [G, N]), min/max as AutoAWQ / AutoGPTQ (sym false) compute them."""
    wt = w.t().float()                                                  # [K, N]
    groups = wt.shape[0] // group
    rows = [wt[g_idx == g] for g in range(groups)]
    hi = torch.stack([r.amax(0) for r in rows]).clamp(min=0)
    lo = torch.stack([r.amin(0) for r in rows]).clamp(max=0)
    scales = ((hi - lo).clamp(min=1e-5) / 15).half()
    zeros = torch.round(-lo / scales.float()).clamp(0, 15)
    q = torch.round(wt / scales.float()[g_idx] + zeros[g_idx]).clamp(0, 15)
    return q.to(torch.uint8), zeros.to(torch.uint8), scales


def _dequantized(q, zeros, scales, g_idx) -> torch.Tensor:
    return ((q.float() - zeros.float()[g_idx]) * scales.float()[g_idx]).t().contiguous()     # [N, K]


def save_int4_checkpoint(src: Path, dst: Path, fmt: str, group: int, act_order: bool, seed: int = 0,
                         edit_config=None) -> tuple[Path, Path]:
    """Checkpoint `src`'s decoder projections as AWQ (GEMM) or GPTQ (v1 "gptq" / "gptq_v2") INT4, and a plain
    float32 checkpoint of the dequantized weights (transformers' reference). Returns (int4 dir, reference dir)."""
    gen = torch.Generator().manual_seed(seed)
    tensors, plain, orders = {}, {}, {}
    for name, w in load_file(Path(src) / "model.safetensors").items():
        if not (name.endswith("proj.weight") and ".layers." in name):
            tensors[name] = plain[name] = w
            continue
        k = w.shape[1]
        g_idx = torch.arange(k) // group
        if act_order:        # the rows quantized in another order, groups scattered; one order per input (GPTQ's
            shared = name.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
            order = orders.setdefault(shared, torch.argsort(torch.rand(k, generator=gen)))   # Hessian is the input's)
            g_idx = g_idx[order]
        q, zeros, scales = _quantize(w, group, g_idx)
        base = name[: -len("weight")]
        plain[name] = _dequantized(q, zeros, scales, g_idx)
        if fmt == "awq":
            tensors[base + "qweight"] = int4.pack_columns(q, awq=True)
            tensors[base + "qzeros"] = int4.pack_columns(zeros, awq=True)
        else:
            tensors[base + "qweight"] = int4.pack_rows(q)                                  # along K
            stored = zeros.long() - 1 if fmt == "gptq" else zeros.long()      # v1 stores zero - 1
            tensors[base + "qzeros"] = int4.pack_columns((stored & 0xF).to(torch.uint8))
            tensors[base + "g_idx"] = g_idx.to(torch.int32)
        tensors[base + "scales"] = scales
    config = json.loads((Path(src) / "config.json").read_text())
    out, ref = Path(f"{dst}-{fmt}"), Path(f"{dst}-ref")
    for path, weights, qc in ((out, tensors, _quant_config(fmt, group, act_order)), (ref, plain, None)):
        path.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(path / "model.safetensors"))
        cfg = dict(config, **({"quantization_config": qc} if qc else {}))
        if edit_config is not None and qc:
            edit_config(cfg)
        (path / "config.json").write_text(json.dumps(cfg))
        for f in Path(src).iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
                (path / f.name).write_bytes(f.read_bytes())
    return out, ref


def _quant_config(fmt: str, group: int, act_order: bool) -> dict:
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order, "sym": False,
            "checkpoint_format": fmt}


@pytest.fixture(scope="module")
def source(tmp_path_factory, request):
    from helpers import save_tiny_checkpoint
    tokenizer = os.environ.get("BATON_TOKENIZER") or request.getfixturevalue("embedded_source").tokenizer_path
    root = tmp_path_factory.mktemp("int4")
    return save_tiny_checkpoint("qwen3", root / "bf16", tokenizer, **SHAPE), root


@pytest.fixture(scope="module")
def checkpoints(source):
    src, root = source
    return {name: save_int4_checkpoint(src, root / name, fmt, group, act)
            for name, (fmt, group, act) in VARIANTS.items()}


def _cpu_model(path):
    from transformers import AutoConfig

    from baton.models.layers.int4 import finish_int4
    platform = CpuPlatform(torch.device("cpu"))
    model = loader.build_model(AutoConfig.from_pretrained(path), torch.float32, "cpu", platform.ops)
    loader.load_weights(model, path)
    finish_int4(model, platform, torch.float32)
    return model.eval(), platform


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_projection_multiplies_as_its_dequantized_weight(checkpoints, variant):
    """Each packed layer (qkv, o, gate_up, down of every decoder layer) times x equals x times the
    weights the checkpoint dequantizes to, to float32 rounding; the embedding, head and norms stay float."""
    path, ref = checkpoints[variant]
    model, _ = _cpu_model(path)
    plain = load_file(ref / "model.safetensors")
    layers = int4.int4_layers(model)
    assert len(layers) == 4 * 2 and model.lm_head.weight.dtype == torch.float32
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    for name, layer in layers:
        assert layer.weight is None and layer.qweight.dtype == torch.int32
        stem = "model." + name.split("model.", 1)[1].rsplit(".", 1)[0] + "."
        parts = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
        proj = name.rsplit(".", 1)[1]
        w = torch.cat([plain[f"{stem}{p}.weight"] for p in parts.get(proj, [proj])])
        xs = x[:, : w.shape[1]]
        torch.testing.assert_close(layer(xs), xs @ w.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", ["awq-g128", "gptq-g64", "gptq-act-g32"])
def test_engine_decodes_what_transformers_decodes_from_the_dequantized_weights(checkpoints, variant):
    from helpers import hf_greedy
    from transformers import AutoModelForCausalLM

    from baton.engine import LLM, SamplingParams
    path, ref = checkpoints[variant]
    llm = LLM(str(path), num_kv_blocks=32, max_model_len=128)
    assert llm.engine.runner.quantization == VARIANTS[variant][0].split("_")[0]
    got = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))]
    hf = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    assert got == hf_greedy(hf, PROMPTS, 8)


def test_int4_weights_take_about_a_quarter_of_bf16s_bytes(checkpoints):
    """Packed on the device: 0.5 byte a weight, plus a float16 scale and a byte of zero point per group of 128
    and column (0.52 a weight against bf16's 2)."""
    model, _ = _cpu_model(checkpoints["awq-g128"][0])
    packed = weights = 0
    for _, layer in int4.int4_layers(model):
        packed += sum(t.numel() * t.element_size() for t in (layer.qweight, layer.scales, layer.qzeros))
        weights += layer.in_features * layer.out_features
    assert packed / (2 * weights) == pytest.approx((0.5 + 3 / 128) / 2, rel=1e-6)


def _bad(source, tmp_path, edit_config=None, drop=None, group=32):
    src, _ = source
    path, _ = save_int4_checkpoint(src, tmp_path / "bad", "gptq", group, False, edit_config=edit_config)
    if drop:
        tensors = {k: v for k, v in load_file(path / "model.safetensors").items() if not k.endswith(drop)}
        save_file(tensors, str(path / "model.safetensors"))
    return path


def test_bad_checkpoints_are_refused_naming_what_is_supported(source, tmp_path):
    from transformers import AutoConfig
    platform = CpuPlatform(torch.device("cpu"))

    def load(path):
        model = loader.build_model(AutoConfig.from_pretrained(path), torch.float32, "cpu", platform.ops)
        loader.load_weights(model, path)

    with pytest.raises(ValueError, match=r"bits=8 are not supported \(supported: bits=4"):
        load(_bad(source, tmp_path, lambda c: c["quantization_config"].update(bits=8)))
    with pytest.raises(ValueError, match="group_size 96 does not divide .*proj's 128 input features"):
        load(_bad(source, tmp_path, lambda c: c["quantization_config"].update(group_size=96)))
    with pytest.raises(ValueError, match="missing .* weights, e.g. .*qzeros"):
        load(_bad(source, tmp_path, drop="qzeros"))
    with pytest.raises(ValueError, match="AWQ version 'gemv' is not supported"):
        load(_bad(source, tmp_path, lambda c: c["quantization_config"].update(quant_method="awq", version="gemv")))
    with pytest.raises(ValueError, match=r"expected \d+ rows \(group_size 64"):     # groups of 32 read as 64
        load(_bad(source, tmp_path, lambda c: c["quantization_config"].update(group_size=64)))


def test_int4_refuses_a_quantization_flag_and_a_tp_split_that_cuts_groups(checkpoints, source, tmp_path):
    from baton.engine import LLM
    with pytest.raises(ValueError, match="INT4 \\(awq\\).*serve it without --quantization"):
        LLM(str(checkpoints["awq-g128"][0]), quantization="fp8", num_kv_blocks=32, max_model_len=128)
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(checkpoints["awq-g128"][0])
    with pytest.raises(ValueError, match="cuts its groups of 128 rows"):
        loader.build_model(config, torch.float32, "cpu", CpuPlatform(torch.device("cpu")).ops, tp_rank=0, tp_size=2)
    config = AutoConfig.from_pretrained(checkpoints["gptq-act-g32"][0])
    with pytest.raises(ValueError, match="act-order .* --tp-size 1"):
        loader.build_model(config, torch.float32, "cpu", CpuPlatform(torch.device("cpu")).ops, tp_rank=0, tp_size=2)


def test_gptq_rounding_keeps_a_layers_output_closer_than_rounding_to_nearest():
    """benchmarks/int4_checkpoint.py's rounding: to nearest, every weight within half a step of its group's grid;
    GPTQ's error feedback, on the same grid, gives a layer output closer to the float one on its inputs."""
    from baton.benchmarks.int4_checkpoint import quantize_int4
    gen = torch.Generator().manual_seed(3)
    mix = torch.randn(96, 96, generator=gen)
    x = torch.randn(512, 96, generator=gen) @ mix                       # correlated inputs, as activations are
    w = torch.randn(40, 96, generator=gen) * 0.05
    errors = {}
    for name, hessian, act in (("rtn", None, False), ("gptq", x.t() @ x, False), ("gptq-act", x.t() @ x, True)):
        q, scales, zeros, g_idx = quantize_int4(w, 32, hessian, act_order=act)
        assert q.shape == (96, 40) and scales.shape == zeros.shape == (3, 40) and int(q.max()) <= 15
        assert sorted(g_idx.tolist()) == [g for g in range(3) for _ in range(32)]       # 32 rows a group
        assert (g_idx.tolist() == sorted(g_idx.tolist())) != act                         # act-order: unsorted
        g = g_idx.long()
        deq = ((q.float() - zeros.float()[g]) * scales.float()[g]).t()
        if hessian is None:
            assert ((deq - w).abs() <= scales.float()[g].t() / 2 + 1e-6).all()
        errors[name] = float((x @ deq.t() - x @ w.t()).norm())
    assert errors["gptq"] < 0.8 * errors["rtn"] and errors["gptq-act"] < 0.8 * errors["rtn"], errors


def test_an_int4_checkpoint_made_here_loads_as_gptq(source, tmp_path):
    """make_checkpoint (GPTQ rounding with act-order, calibrated through the model) writes AutoGPTQ's format
    (v2, desc_act, g_idx unsorted) with packed projections, and the engine serves it as a GPTQ checkpoint."""
    from baton.benchmarks.int4_checkpoint import make_checkpoint
    from baton.engine import LLM, SamplingParams
    src, _ = source
    made = make_checkpoint(str(src), tmp_path / "gptq-g32", 32, "gptq", act_order=True, calibration_tokens=2048)
    config = json.loads((tmp_path / "gptq-g32" / "config.json").read_text())
    assert config["quantization_config"]["checkpoint_format"] == "gptq_v2" and made["rounding"] == "gptq"
    assert config["quantization_config"]["desc_act"] is True
    tensors = load_file(tmp_path / "gptq-g32" / "model.safetensors")
    assert tensors["model.layers.0.mlp.down_proj.qweight"].shape == (256 // 8, 128)
    llm = LLM(str(tmp_path / "gptq-g32"), num_kv_blocks=32, max_model_len=128)
    assert llm.engine.runner.quantization == "gptq"
    [out] = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4


def test_tensor_parallel_shards_of_packed_weights_rebuild_the_layer(checkpoints):
    """Two ranks' shards (columns of qkv / gate_up, rows and groups of o / down): concatenated outputs and
    summed partials equal one rank's layer."""
    from transformers import AutoConfig
    path = checkpoints["gptq-g64"][0]
    config = AutoConfig.from_pretrained(path)
    platform = CpuPlatform(torch.device("cpu"))
    one, _ = _cpu_model(path)
    ranks = []
    for rank in range(2):
        m = loader.build_model(config, torch.float32, "cpu", platform.ops, tp_rank=rank, tp_size=2)
        loader.load_weights(m, path)
        int4.finish_int4(m, platform, torch.float32)
        ranks.append(m)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2))
    layer = lambda m, name: dict(m.named_modules())[name]          # noqa: E731
    gate_up = [layer(m, "model.layers.1.mlp.gate_up_proj")(x[:, :128]) for m in ranks]
    want = layer(one, "model.layers.1.mlp.gate_up_proj")(x[:, :128])
    got = torch.cat([gate_up[0][:, :128], gate_up[1][:, :128], gate_up[0][:, 128:], gate_up[1][:, 128:]], -1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    down = sum(layer(m, "model.layers.1.mlp.down_proj").matmul(x[:, 128 * r:128 * (r + 1)], None)
               for r, m in enumerate(ranks))
    torch.testing.assert_close(down, layer(one, "model.layers.1.mlp.down_proj")(x), rtol=1e-5, atol=1e-5)


def test_the_emulated_ascend_weight_quant_matmul_gives_the_cpu_references_numbers(checkpoints):
    """npu_convert_weight_to_int4pack + npu_weight_quant_batchmatmul (emulated from their documents; signed
    int4 with offset 8 - zero) against the CPU reference, in bfloat16; and the engine on npu:0 (emulated,
    decode graphs) gives the CPU's prompt logprobs, to bfloat16 rounding (the scales are bfloat16 there, the
    op's rule: measured 0.03 at most; the tiny model's logits are too flat for its tokens to be compared)."""
    from baton.engine import LLM, SamplingParams
    from baton.engine.platforms.npu import NpuPlatform
    from baton.engine.platforms.npu_emulation import NpuEmulationError, emulated_torch_npu
    npu = emulated_torch_npu()
    model, cpu = _cpu_model(checkpoints["gptq-act-g32"][0])
    platform = NpuPlatform(torch.device("cpu"), npu)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    for _, layer in int4.int4_layers(model):
        w = layer.matmul.w
        xs = x[:, : w.in_features]
        on_npu = platform.w4a16_matmul(xs, platform.w4a16_layout(w, torch.bfloat16))
        torch.testing.assert_close(on_npu, cpu.w4a16_matmul(xs, w), rtol=2e-2, atol=2e-2)
    with pytest.raises(NpuEmulationError, match="antiquant_group_size must be a multiple of 32"):
        npu.npu_weight_quant_batchmatmul(x[:, :64], torch.zeros(64, 2, dtype=torch.int32),
                                         torch.ones(4, 16, dtype=torch.bfloat16), antiquant_group_size=16)
    kw = dict(dtype="bfloat16", block_size=128, num_kv_blocks=16, max_num_seqs=4, max_num_batched_tokens=128)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    path = str(checkpoints["awq-g128"][0])
    want = LLM(path, **kw).generate(PROMPTS, sp)
    llm = LLM(path, device="npu:0", npu_emulation=True, fused_ops=False, **kw)
    assert llm.engine.runner.graphs is not None
    assert llm.engine.runner.model.model.layers[0].mlp.down_proj.qweight.shape == (256, 128 // 8)    # int4pack [K, N/8]
    for a, b in zip(want, llm.generate(PROMPTS, sp), strict=True):
        la, lb = (torch.tensor([e.logprob for e in o.prompt_logprobs[1:]]) for o in (a, b))
        assert float((la - lb).abs().max()) < 0.06


# -- the Triton kernel, through Triton's interpreter (no GPU here) ------------------------------

def check_triton_kernel(path: str) -> None:
    """Run under TRITON_INTERPRET=1: the GEMV (one row and 2-8 rows a program, M = 2, 3, 5, 8) and the dot kernel
    (both unpackings; decode and 64-row tiles, split-K reduced in the kernel and by a second one) and the
    dequantizer, on the CUDA platform's layout (w4a16.relayout), against the reference, float16 and float32
    activations, groups 32 and 128, act-order included."""
    from baton.engine.platforms.triton_kernels import w4a16
    model, cpu = _cpu_model(path)
    gen = torch.Generator().manual_seed(4)
    for _, layer in int4.int4_layers(model)[:4]:
        ref_w = layer.matmul.w
        assert w4a16.supported(ref_w)
        w = w4a16.relayout(ref_w)
        for m, dtype in ((1, torch.float32), (2, torch.float16), (3, torch.float16), (5, torch.float16),
                         (8, torch.float32), (40, torch.float32)):
            x = torch.randn(m, w.in_features, generator=gen).to(dtype)
            want = cpu.w4a16_matmul(x.float(), ref_w)
            split = 2 if w.in_features >= 256 else 1
            bm = 16 if m <= 16 else 64
            configs = () if m in (2, 8) else (None, w4a16.W4a16Config("gemv", 32, split),
                                                   w4a16.W4a16Config("dot", 32, split, bm),
                                                   w4a16.W4a16Config("dotshift", 32, 1, bm))
            # the multi-row GEMV: one and several programs over M, a partial last one (odd M: rows past M masked)
            rows = {2: (2,), 3: (2, 4), 5: (4, 8), 8: (8,)}.get(m, ())
            configs += tuple(w4a16.W4a16Config("gemvm", 32, split, r) for r in rows)
            assert configs
            for cfg in configs:
                got = w4a16.w4a16_gemm(x, w, cfg).float()
                torch.testing.assert_close(got, want, rtol=2e-3 if dtype == torch.float16 else 1e-5,
                                           atol=2e-3 if dtype == torch.float16 else 1e-5)
                if cfg is not None and cfg.split_k > 1 and cfg.kernel != "gemvm":
                    # split-K's reduce in the kernel (tickets) and as a second kernel: the same sums, bit for bit
                    w4a16.FOLD_SPLIT_K = False
                    separate = w4a16.w4a16_gemm(x, w, cfg).float()
                    w4a16.FOLD_SPLIT_K = True
                    assert torch.equal(got, separate), cfg
                    assert not w4a16._TICKETS[x.device].any(), "every tile's ticket is back at zero"
        torch.testing.assert_close(w4a16.w4a16_dequantize(w, torch.float32), int4.dequantize(ref_w).t())
    print("w4a16 kernels ok")


@pytest.mark.timeout(600)            # (two interpreter runs of up to 300 s each, on shared cores)
def test_triton_w4a16_kernels_match_the_reference_in_the_interpreter(checkpoints):
    for variant in ("awq-g128", "gptq-act-g32"):
        in_triton_interpreter(f"import test_int4; test_int4.check_triton_kernel({str(checkpoints[variant][0])!r})",
                              "w4a16 kernels ok", "the W4A16 kernels")


@pytest.mark.slow
def test_the_int4_decode_benchmark_runs_on_the_cpu(tmp_path):
    """benchmarks/int4_decode.py end to end on a tiny config of qwen3-8b (the GPU run's arguments and imports)."""
    from baton.benchmarks import int4_decode
    int4_decode.main(["--out", str(tmp_path), "--device", "cpu", "--tiny", "--batches", "1,2", "--gemm-ms", "1",
                      "--steps", "2", "--context", "16"])
    rows = [json.loads(line) for line in (tmp_path / "int4_decode.jsonl").read_text().splitlines()]
    assert {(r["kind"], r.get("weights")) for r in rows} == {("gemm", None), ("decode", "int4-awq-g128"), ("decode", "bf16")}
    assert all(r["rel_err"] < 1e-5 for r in rows if r["kind"] == "gemm")
    assert {r["quantization"] for r in rows if r["kind"] == "decode"} == {"awq", None}
