"""Quantized linear layers: FP8 weights (`--quantization fp8`) and W8A8 INT8 (`--quantization w8a8`).

FP8 (`--quantization fp8`): e4m3 weights with one scale per output channel, activations
quantized per token on the fly, matmuls as scaled FP8 GEMMs (`LayerOps.scaled_mm`: `torch._scaled_mm`,
or on CUDA a Triton GEMM at the decode sizes where it measured faster, triton_kernels/fp8_gemm.py).

A bf16 checkpoint is quantized at load, after its weights went through the usual weight
loaders (so every tensor-parallel shard gets the scales of its own rows). A pre-quantized
checkpoint (a `quantization_config` in its config.json) is read widened (models/loader.py, `dequantize`):
its FP8 tensors times their scales (the `fp8` method's 128x128 blocks of `weight_scale_inv`,
Qwen3-FP8 and DeepSeek-V3 style; compressed-tensors' per-channel or per-tensor `weight_scale`),
then quantized per channel like a bf16 checkpoint. The matmul is per-channel either way; a
block-scaled GEMM is not built (docs/benchmarks.md, "Quantized serving").

What is quantized: the attention and MLP projections (every `LinearBase` but a MoE router's
gate), and the routed experts' stacked weights (models/layers/moe.py: w13 and w2 in e4m3, one scale
per expert and output channel, `ExpertScales`; an FP8 checkpoint's experts, block-scaled or per
channel, are widened and re-quantized the same way). The embedding, the LM head, norms and the
routers stay in the model dtype. The experts run one of two ways, chosen by the step's shape
(`fp8_expert_dots`, the same rule on every platform, so the CPU computes the numbers CUDA does;
the bound: FP8_EXPERT_DOTS_ABOVE):
FP8 x FP8 (each GEMM's input rows quantized per token to e4m3 with a float32 scale, as the dense
projections' are, the products times token scale x channel scale: the FP8 tensor cores' rate, where
the weight-only kernel is bound by widening the weights; engine/platforms/triton_kernels/moe.py),
by default at every size, or weight-only (`LayerOps.moe_experts` with scales: activations in the
model dtype times the e4m3 weights, widened exactly, the scales applied to the sums) at or below the
bound (and under CUDA's deterministic mode, whose tiles are fixed).

How the platform runs it (`Platform.fp8_linear`): "scaled_mm" (CUDA on compute capability 8.9+,
the CPU where torch has float8 `_scaled_mm`), "dequant" (a CPU torch without it: the weights
widened per call, activations left as they are: a reference, not a speed path) or a refusal (NPU).

W8A8 (`--quantization w8a8`, Ascend's production scheme, vllm-ascend's w8a8 dynamic): int8 weights
with one symmetric scale per output channel (amax / 127), activations quantized per token to int8
at run time, an int8 GEMM accumulating in int32, then both scales. The platform runs it
(`Platform.w8a8_matmul`): torch_npu's npu_dynamic_quant + npu_quant_matmul on Ascend, torch._int_mm
on the CPU; CUDA refuses (FP8 is its path). Quantized at load from bf16 checkpoints only.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from baton.models.layers.int4 import INT4_METHODS, Int4Scheme, int4_scheme

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max             # 448
INT8_MAX = 127
# read from a checkpoint's quantization_config; awq / gptq: INT4 weight-only (models/layers/int4.py)
CHECKPOINT_METHODS = ("fp8", "compressed-tensors", "awq", "gptq")
SCALE_EPS = 1e-12


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of 2-D x as e4m3 with its own float32 scale: (x_fp8 [M, K], scales [M, 1]),
    x ~= x_fp8 * scales. The plain-torch form of `LayerOps.quantize_fp8_rows`."""
    x32 = x.float()
    scale = x32.abs().amax(dim=-1, keepdim=True).clamp(min=SCALE_EPS) / FP8_MAX
    return (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class Fp8Rows(NamedTuple):
    """An FP8 linear's input already quantized per token, by the op that produced it (the RMSNorm
    or SiLU-and-mul before the projection: models/decoder.py, `fuse_fp8_inputs`), so the projection
    skips its own quantizer launch. `shape` is the activation's, as the modules between read it."""
    values: torch.Tensor       # e4m3 [T, K]
    scales: torch.Tensor       # float32 [T, 1]

    @property
    def shape(self) -> torch.Size:
        return self.values.shape


class Fp8Matmul:
    """LinearBase's matmul (`self.matmul(x, weight, bias)`) for an e4m3 weight [N, K] with
    per-output-channel scales [1, N]: x's rows quantized by `ops`, one scaled GEMM."""

    def __init__(self, scale: torch.Tensor, ops, mode: str, dtype: torch.dtype | None = None):
        self.scale = scale                 # float32 [1, N]
        self.ops, self.mode = ops, mode
        self.dtype = dtype                 # what the layer returns (None: x's dtype; an Fp8Rows x needs it)

    def __call__(self, x: torch.Tensor | Fp8Rows, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        dtype = self.dtype or x.dtype
        if self.mode == "dequant":
            y = torch.nn.functional.linear(x.reshape(-1, k), (weight.float() * self.scale.t()).to(x.dtype))
        else:
            # quantized here, or by the op before (decoder.fuse_fp8_inputs)
            xq, xs = x if isinstance(x, Fp8Rows) else self.ops.quantize_fp8_rows(x.reshape(-1, k))
            # CUDA's row-wise scaled GEMM writes bf16 only; bias is added after, in the model's dtype
            out = torch.bfloat16 if xq.device.type == "cuda" else dtype
            y = self.ops.scaled_mm(xq, xs, weight, self.scale, out).to(dtype)
        if bias is not None:
            y = y + bias
        return y.reshape(*lead, weight.shape[0])


# FP8 experts: FP8 x FP8 dots (activations quantized per token) once a step routes more than this
# many (token, choice) pairs per expert on average, weight-only up to it; None: weight-only at every
# size. 0: the dots at every size. Measured (docs/benchmarks.md, "FP8 x FP8 expert dots" and "Swapped
# FP8 x FP8 at decode sizes"): above 24 pairs an expert the dots ran 1.4-1.95x weight-only on an
# H100; below it, since the decode-size tiles run swapped (the weights as e4m3 wgmma's A), they run
# 1.06-1.09x weight-only on an H100 and 1.26-1.38x on an H200, where weight-only's widening is the
# limit (B1 of Qwen3-30B-A3B on an H200: 1.13x over the bound at 24), for the activations' rounding
# (1.3-1.6e-2 from float64 against weight-only's 2.3e-3 on the expert step alone).
FP8_EXPERT_DOTS_ABOVE: int | None = 0


def fp8_expert_dots(num_pairs: int, num_experts: int) -> bool:
    """Whether FP8 experts quantize their activations (FP8 x FP8) for a step of `num_pairs`
    (token, choice) pairs over `num_experts` experts: by the expected rows per expert, as the fused
    kernel's tile buckets are (never while FP8_EXPERT_DOTS_ABOVE is None)."""
    return FP8_EXPERT_DOTS_ABOVE is not None and num_pairs > FP8_EXPERT_DOTS_ABOVE * num_experts


class ExpertScales(NamedTuple):
    """The float32 scales of e4m3 stacked experts: one per (expert, output channel)."""
    w13: torch.Tensor          # [E, 2I]: gate rows, then up rows
    w2: torch.Tensor           # [E, H]


def quantize_stacked(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked expert weights [E, N, K] as e4m3 with one scale per (expert, row): (w_fp8, scales
    float32 [E, N]), an expert at a time (one expert's float32 copy at most, not the stack's)."""
    wq = torch.empty(w.shape, dtype=FP8, device=w.device)
    scales = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
    for e in range(w.shape[0]):
        q, s = quantize_rows(w[e])
        wq[e].copy_(q)
        scales[e].copy_(s[:, 0])
    return wq, scales


@torch.no_grad()
def quantize_experts(experts: nn.Module) -> None:
    """A FusedExperts' w13 and w2 to e4m3 per (expert, output channel), their scales beside them."""
    w13, s13 = quantize_stacked(experts.w13.data)
    experts.w13 = nn.Parameter(w13, requires_grad=False)
    w2, s2 = quantize_stacked(experts.w2.data)
    experts.w2 = nn.Parameter(w2, requires_grad=False)
    experts.scales = ExpertScales(s13, s2)         # a plain attribute: never loaded


def quantizable(module: nn.Module) -> bool:
    from baton.models.layers.linear import LinearBase
    if not isinstance(module, LinearBase) or getattr(module, "keep_dtype", False) or module.weight.dtype == FP8:
        return False
    n, k = module.weight.shape
    return n % 16 == 0 and k % 16 == 0          # the scaled GEMM's shape rule (CUDA)


def gptq_rows(w: torch.Tensor, hessian: torch.Tensor, damp: float = 0.01,
              block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] as e4m3 rows with quantize_rows' scales (a row's largest |w| / 448), rounded a column
    at a time, each column's rounding error spread over the columns not rounded yet as the inverse of
    `hessian` ([K, K], the sum of x^T x over the layer's inputs) weighs them: GPTQ's error feedback
    (Frantar et al., 2022) onto e4m3's grid, so that x @ w^T rather than w itself stays close.
    Returns (w_fp8 [N, K], scales float32 [N, 1]); float32 arithmetic on w's device."""
    w = w.float().clone()
    h = hessian.float().clone()
    dead = torch.diagonal(h) == 0                 # inputs that were always zero: their weights do not matter
    h[dead, dead] = 1
    w[:, dead] = 0
    torch.diagonal(h).add_(damp * torch.diagonal(h).mean())
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=SCALE_EPS) / FP8_MAX
    q = torch.empty(w.shape, dtype=FP8, device=w.device)
    k = w.shape[1]
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        wb, ub = w[:, b0:b1].clone(), u[b0:b1, b0:b1]
        err = torch.empty_like(wb)
        for j in range(b1 - b0):
            qj = (wb[:, j:j + 1] / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            q[:, b0 + j] = qj[:, 0]
            err[:, j] = (wb[:, j] - qj[:, 0].float() * scale[:, 0]) / ub[j, j]
            wb[:, j:] -= err[:, j:j + 1] * ub[j:j + 1, j:]
        w[:, b1:] -= err @ u[b0:b1, b1:]
    return q, scale


def quantize_linear(module: nn.Module, ops, mode: str, rounded: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """One linear layer's weight to e4m3 per output channel (`rounded`: already rounded, e.g. by
    gptq_rows; else to nearest), its matmul to Fp8Matmul. The bf16 weight is freed."""
    w = module.weight.data
    wq, scale = rounded if rounded is not None else quantize_rows(w)
    module.weight = nn.Parameter(wq, requires_grad=False)
    module.weight_scale = scale.reshape(1, -1).contiguous()       # a plain attribute: never loaded
    module.matmul = Fp8Matmul(module.weight_scale, ops, mode, w.dtype)


@torch.no_grad()
def quantize_fp8(model: nn.Module, ops, mode: str) -> int:
    """Every quantizable linear layer's weight to e4m3 per output channel, its matmul to
    Fp8Matmul, and every routed experts' stacks (quantize_experts); returns how many layers and
    expert stacks (w13 and w2 count one each). The bf16 weight is freed layer by layer; layers
    already in e4m3 (engine/runner/fp8_rounding.py rounded them) are left as they are."""
    n = 0
    for module in model.modules():
        if getattr(module, "stacked_experts", False):         # moe.FusedExperts (which imports this module)
            quantize_experts(module)
            n += 2
            continue
        if not quantizable(module):
            continue
        quantize_linear(module, ops, mode)
        n += 1
    return n


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of 2-D x as symmetric int8 with its own float32 scale amax / 127 (round half to
    even, as torch.round): (x_int8 [M, K], scales [M, 1]); an all-zero row stays zero."""
    x32 = x.float()
    scale = x32.abs().amax(dim=-1, keepdim=True) / INT8_MAX
    q = torch.round(x32 / scale.clamp(min=SCALE_EPS)).clamp(-INT8_MAX - 1, INT8_MAX)
    return q.to(torch.int8), scale


class Int8Matmul:
    """LinearBase's matmul for an int8 weight [N, K] with per-output-channel scales [N] (float32):
    the platform quantizes x per token and runs the int8 GEMM (`Platform.w8a8_matmul`)."""

    def __init__(self, scale: torch.Tensor, platform):
        self.scale = scale
        self.platform = platform

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        y = self.platform.w8a8_matmul(x.reshape(-1, k), weight, self.scale)
        if bias is not None:
            y = y + bias
        return y.reshape(*lead, weight.shape[0])


@torch.no_grad()
def quantize_w8a8(model: nn.Module, platform) -> int:
    """Every quantizable linear layer's weight to int8 per output channel (laid out as the
    platform's GEMM reads it), its matmul to Int8Matmul; returns how many layers."""
    n = 0
    for module in model.modules():
        if not quantizable(module):
            continue
        wq, scale = quantize_rows_int8(module.weight.data)
        module.weight = nn.Parameter(platform.int8_weight_layout(wq), requires_grad=False)
        module.weight_scale = scale.reshape(-1).contiguous()
        module.matmul = Int8Matmul(module.weight_scale, platform)
        n += 1
    return n


# -- pre-quantized checkpoints -----------------------------------------------------------------

def checkpoint_method(hf_config) -> str | None:
    """The quantization a checkpoint's config.json declares (None: plain weights): "fp8" (its FP8
    weights are widened at load and re-quantized), "awq" or "gptq" (INT4, kept packed); ValueError
    for one Baton cannot read."""
    qc = getattr(hf_config, "quantization_config", None)
    if not qc:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    if method not in CHECKPOINT_METHODS:
        raise ValueError(f"checkpoint quantization {method!r} is not supported (supported: fp8 and "
                         "compressed-tensors with float8 e4m3 weights, awq and gptq with 4-bit weights)")
    if method in INT4_METHODS:
        int4_scheme(qc)                  # ValueError for what the INT4 path cannot read
        return method
    if method == "fp8" and qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"fp8 checkpoints with activation_scheme {qc['activation_scheme']!r} are not supported "
                         "(supported: dynamic)")
    if method == "compressed-tensors":
        _check_compressed_tensors(qc)
    return "fp8"


def _check_compressed_tensors(qc: dict) -> None:
    for name, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        if w.get("num_bits") != 8 or w.get("type") != "float" or w.get("strategy") not in ("channel", "tensor"):
            raise ValueError(f"compressed-tensors group {name!r}: only 8-bit float weights per channel or per "
                             f"tensor are supported, got {w}")


def checkpoint_int4_scheme(hf_config) -> Int4Scheme | None:
    """The INT4 scheme of an awq / gptq checkpoint (None: any other)."""
    if checkpoint_method(hf_config) not in INT4_METHODS:
        return None
    qc = hf_config.quantization_config
    return int4_scheme(qc if isinstance(qc, dict) else qc.to_dict())


def scale_name(name: str, keys) -> str | None:
    """The checkpoint tensor holding the scales of FP8 tensor `name`, or None."""
    for suffix in ("_scale_inv", "_scale"):
        if name + suffix in keys:
            return name + suffix
    return None


def is_scale(name: str) -> bool:
    return name.endswith(("weight_scale_inv", "weight_scale", "input_scale"))


def block_size(hf_config) -> tuple[int, int] | None:
    """The `fp8` method's weight_block_size ([128, 128] in Qwen3-FP8), None if per channel/tensor."""
    qc = getattr(hf_config, "quantization_config", None) or {}
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    block = qc.get("weight_block_size")
    return (int(block[0]), int(block[1])) if block else None


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """An FP8 checkpoint tensor widened to float32. With `block` (the `fp8` method's
    weight_block_size), a 2-D `weight_scale_inv` holds one scale per block of rows x columns,
    the last ones partial; otherwise `weight_scale` is per channel ([N] or [N, 1]) or per tensor.
    Both multiply (`_inv`: the inverse of the quantizer's divisor, which the dequantizer multiplies by)."""
    w = weight.float()
    s = scale.float()
    if block is not None and s.dim() == 2 and w.dim() == 2 and s.numel() > 1:
        if s.shape != (-(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])):
            raise ValueError(f"block scales {tuple(s.shape)} do not tile a {tuple(w.shape)} weight in {block} blocks")
        s = s.repeat_interleave(block[0], 0)[:w.shape[0]].repeat_interleave(block[1], 1)[:, :w.shape[1]]
    elif s.dim() == 1 and s.numel() == w.shape[0] and w.dim() == 2:
        s = s[:, None]
    return w * s
