"""INT4 weight-only linear layers (W4A16) from AWQ and GPTQ checkpoints: 4-bit weights, one scale and one
4-bit zero point per group of `group_size` input rows and output column, activations in the model dtype;
w = (q - zero) * scale. The checkpoint's `quantization_config` selects it (no flag), as FP8's does.

Both formats are read into one layout, kept packed on the device (0.5 byte a weight, plus 3 bytes a group
and column: 0.52 at group 128):
  qweight int32 [K/8, N]: input row 8i+j of column n in bits 4j..4j+3 of qweight[i, n] (GPTQ's packing)
  scales  float16 [K/g, N], as the checkpoints store them
  qzeros  uint8 [K/g, N], unpacked (the zero points, offset applied)
  perm    int64 [K] or None: a GPTQ act-order layer's rows sorted by group; x's columns gathered alike per call
The formats (AutoAWQ's and AutoGPTQ's packers; vLLM's awq.py / gptq.py read them the same way):
  AWQ (GEMM version): qweight int32 [K, N/8] packed along the output, nibble i of a word holding column
    AWQ_ORDER[i] of its eight; qzeros int32 [K/g, N/8] packed the same way; scales [K/g, N].
  GPTQ: qweight int32 [K/8, N] packed along the input (as above); qzeros int32 [K/g, N/8] packed along the
    output in order; scales [K/g, N]; g_idx int32 [K], each input row's group (act-order, desc_act: unsorted).
    checkpoint_format "gptq" (v1, the default) stores zero - 1, "gptq_v2" the zero itself.
The platform multiplies (`Platform.w4a16_matmul`): the CPU dequantizes per call (the reference), CUDA runs a
Triton W4A16 GEMM, Ascend torch_npu's npu_weight_quant_batchmatmul on its own layout (`Platform.w4a16_layout`).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch
from torch import nn

INT4_METHODS = ("awq", "gptq")
GPTQ_FORMATS = ("gptq", "gptq_v2")
PACK = 8                                   # 4-bit values an int32 holds
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)       # AutoAWQ: nibble i of a word holds column AWQ_ORDER[i] of its eight
AWQ_COLUMN_NIBBLE = tuple(AWQ_ORDER.index(c) for c in range(PACK))     # column c sits in nibble (0,4,1,5,2,6,3,7)[c]
SHIFTS = tuple(range(0, 32, 4))


@dataclass(frozen=True, slots=True)
class Int4Scheme:
    """What a checkpoint's quantization_config says about its INT4 weights."""
    method: str                 # awq | gptq
    group_size: int             # input rows sharing a scale; -1: all of them (one group per column)
    zero_offset: int            # added to the stored zero points (GPTQ v1 stores zero - 1)
    act_order: bool             # GPTQ desc_act: g_idx is not sorted


class Int4Weight(NamedTuple):
    """One layer's packed weight as its platform multiplies it (`Platform.w4a16_layout` may relayout
    qweight / scales / zeros: Ascend's are torch_npu's int4pack, antiquant scale and offset)."""
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    perm: torch.Tensor | None   # x's columns in the weight's row order (act-order), None: as they are
    group_size: int
    in_features: int
    out_features: int


def int4_scheme(qc: dict) -> Int4Scheme:
    """The INT4 scheme of an awq / gptq quantization_config; ValueError naming what is supported."""
    method = qc.get("quant_method")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{method} checkpoints with bits={bits} are not supported (supported: bits=4, "
                         "INT4 weight-only)")
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if group != -1 and (group <= 0 or group % PACK):
        raise ValueError(f"{method} group_size {group} is not supported (supported: -1 or a multiple of 8, "
                         "e.g. 32, 64, 128)")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported (supported: gemm, AutoAWQ's GEMM layout)")
        if not qc.get("zero_point", True):
            raise ValueError("AWQ checkpoints without zero points (zero_point: false) are not supported")
        return Int4Scheme("awq", group, 0, False)
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in GPTQ_FORMATS:
        raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (supported: {', '.join(GPTQ_FORMATS)})")
    if qc.get("lm_head"):
        raise ValueError("GPTQ checkpoints with a quantized LM head (lm_head: true) are not supported")
    return Int4Scheme("gptq", group, 1 if fmt == "gptq" else 0, bool(qc.get("desc_act", False)))


# -- packing -------------------------------------------------------------------------------------

def unpack_columns(packed: torch.Tensor, awq: bool = False) -> torch.Tensor:
    """int32 [R, C/8] packed along its columns -> uint8 [R, C] (in order, or AWQ's interleaved order)."""
    shifts = torch.tensor(SHIFTS, dtype=torch.int32, device=packed.device)
    q = (packed[..., None] >> shifts) & 0xF                        # [R, C/8, nibble]
    if awq:
        q = q[..., list(AWQ_COLUMN_NIBBLE)]
    return q.reshape(packed.shape[0], -1).to(torch.uint8)


def pack_columns(q: torch.Tensor, awq: bool = False) -> torch.Tensor:
    """uint8 [R, C] of 0..15 -> int32 [R, C/8] packed along its columns (in order, or AWQ's interleaved order):
    unpack_columns' inverse, as AutoGPTQ packs qzeros and AutoAWQ qweight and qzeros."""
    q = q.long().reshape(q.shape[0], -1, PACK)
    if awq:
        q = q[..., list(AWQ_ORDER)]
    words = (q << torch.tensor(SHIFTS, dtype=torch.int64, device=q.device)).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [K/8, N] packed along its rows (the layout above) -> uint8 [K, N]."""
    shifts = torch.tensor(SHIFTS, dtype=torch.int32, device=packed.device)
    q = (packed[:, None, :] >> shifts[None, :, None]) & 0xF       # [K/8, nibble, N]
    return q.reshape(-1, packed.shape[1]).to(torch.uint8)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """uint8 [K, N] of 0..15 -> int32 [K/8, N], input row 8i+j in bits 4j.. of word i (two's complement)."""
    shifts = torch.tensor(SHIFTS, dtype=torch.int64, device=q.device)
    words = (q.reshape(-1, PACK, q.shape[1]).long() << shifts[None, :, None]).sum(1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def dequantize(w: Int4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [N, K] in `dtype` (rows in w's order), (q - zero) * scale computed in float32."""
    q = unpack_rows(w.qweight).float()
    zeros = w.zeros.float().repeat_interleave(w.group_size, 0)
    scales = w.scales.float().repeat_interleave(w.group_size, 0)
    return ((q - zeros) * scales).to(dtype).t()


# -- the layers ----------------------------------------------------------------------------------

def int4_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The decoder's projections that an INT4 checkpoint quantizes: every LinearBase under the decoder
    layers (not the embedding, the LM head, norms, a MoE router or a vision tower)."""
    from baton.models.layers.linear import LinearBase
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, LinearBase) and not getattr(m, "keep_dtype", False)
            and ".layers." in f".{name}" and "visual" not in name]


@torch.no_grad()
def prepare_int4(model: nn.Module, scheme: Int4Scheme) -> int:
    """Each INT4 projection's weight swapped, before loading, for empty packed tensors whose weight
    loaders convert and shard the checkpoint's; returns how many layers."""
    if any(getattr(m, "stacked_experts", False) for m in model.modules()):
        raise ValueError(f"{scheme.method} checkpoints of MoE models are not supported (their routed experts are "
                         "INT4; supported: dense decoders)")
    layers = int4_layers(model)
    for name, module in layers:
        _make_int4(name, module, scheme)
    return len(layers)


def _full_in_features(module) -> int:
    shard = module.input_shard()
    return module.in_features if shard is None else module.in_features * module.tp.size


def _make_int4(name: str, module: nn.Module, scheme: Int4Scheme) -> None:
    k, n, k_full = module.in_features, module.out_features, _full_in_features(module)
    group = k_full if scheme.group_size == -1 else scheme.group_size
    if k_full % group or k_full % PACK:
        raise ValueError(f"{scheme.method} group_size {scheme.group_size} does not divide {name}'s {k_full} "
                         "input features (the checkpoint's groups cannot tile them)")
    split = k != k_full
    if split and scheme.group_size != -1 and (k % group or k % PACK):
        raise ValueError(f"tensor parallelism splits {name}'s {k_full} input features into {k} per rank, which "
                         f"cuts its groups of {group} rows; use a --tp-size that divides {k_full // group} groups")
    if split and scheme.act_order:
        raise ValueError(f"GPTQ act-order (desc_act) weights cannot be split on their input features across "
                         f"tensor-parallel ranks ({name}: each rank's rows hold scattered groups); serve with --tp-size 1")
    groups = 1 if scheme.group_size == -1 else k // group
    device = module.weight.device
    module.register_parameter("weight", None)          # freed: the packed tensors replace it
    module.int4_scheme, module.int4_name = scheme, name
    module.group_size = k if scheme.group_size == -1 else group
    shapes = {"qweight": ((k // PACK, n), torch.int32), "scales": ((groups, n), torch.float16),
              "qzeros": ((groups, n), torch.uint8)}
    if scheme.method == "gptq":
        shapes["g_idx"] = ((k,), torch.int32)
    for kind, (shape, dtype) in shapes.items():
        param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
        param.weight_loader = partial(_load, module, kind)
        module.register_parameter(kind, param)


def _canonical(kind: str, t: torch.Tensor, scheme: Int4Scheme) -> torch.Tensor:
    """A checkpoint tensor in the layout above, full size."""
    if kind == "qweight" and scheme.method == "awq":
        return pack_rows(unpack_columns(t, awq=True))
    if kind == "qzeros":
        return (unpack_columns(t, awq=scheme.method == "awq") + scheme.zero_offset).to(torch.uint8)
    return t


def _load(module, kind: str, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    scheme, name = module.int4_scheme, module.int4_name
    if loaded.dtype != {"qweight": torch.int32, "qzeros": torch.int32, "g_idx": torch.int32}.get(kind, loaded.dtype):
        raise ValueError(f"{name}.{kind}: expected int32 (packed 4-bit), got {loaded.dtype}")
    full = _canonical(kind, loaded, scheme)
    k_full, shard = _full_in_features(module), module.input_shard()
    rows = {"qweight": k_full // PACK, "g_idx": k_full}.get(kind, 1 if scheme.group_size == -1 else k_full // module.group_size)
    dst, size, src = module.output_shard(shard_id)
    if full.shape[0] != rows or (kind != "g_idx" and full.shape[1] < src + size):
        raise ValueError(f"{name}.{kind} has shape {tuple(full.shape)} in the layout above (models/layers/int4.py); "
                         f"expected {rows} rows (group_size {scheme.group_size}, {k_full} input features)")
    if kind == "g_idx":              # a row shard's groups counted from its own first (act-order is refused there)
        local = full if shard is None else full.narrow(0, *shard) - shard[0] // module.group_size
        _load_g_idx(module, param, torch.zeros_like(local) if scheme.group_size == -1 else local)
        return
    if shard is not None and not (kind != "qweight" and scheme.group_size == -1):
        per = PACK if kind == "qweight" else module.group_size
        full = full.narrow(0, shard[0] // per, shard[1] // per)
    param.data.narrow(1, dst, size).copy_(full.narrow(1, src, size))


def _load_g_idx(module, param: nn.Parameter, g_idx: torch.Tensor) -> None:
    """A fused layer's shards (q, k, v; gate, up) share their input, so GPTQ sorted their rows alike:
    one g_idx serves all; a shard that disagrees is refused."""
    if getattr(module, "g_idx_loaded", False) and not torch.equal(param.data.cpu(), g_idx.to(torch.int32).cpu()):
        raise ValueError(f"{module.int4_name}: the fused projections' g_idx differ (act-order sorted their input "
                         "rows differently); Baton needs one row order per fused layer")
    param.data.copy_(g_idx)
    module.g_idx_loaded = True


class Int4Matmul:
    """LinearBase's matmul for an INT4 layer: x's columns in the weight's row order, then the platform's
    W4A16 GEMM (`Platform.w4a16_matmul`); the layer's `weight` argument is None."""

    def __init__(self, w: Int4Weight, platform):
        self.w, self.platform = w, platform

    def __call__(self, x: torch.Tensor, weight=None, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        if self.w.perm is not None:
            x2 = x2.index_select(1, self.w.perm)
        y = self.platform.w4a16_matmul(x2, self.w)
        if bias is not None:
            y = y + bias
        return y.reshape(*lead, self.w.out_features)


@torch.no_grad()
def finish_int4(model: nn.Module, platform, dtype: torch.dtype) -> int:
    """After loading: act-order rows sorted by group, each layer laid out as its platform's GEMM reads it
    (`Platform.w4a16_layout`), its matmul set to Int4Matmul; returns how many layers."""
    layers = [m for _, m in model.named_modules() if hasattr(m, "int4_scheme")]
    for module in layers:
        perm = _sort_groups(module)
        w = Int4Weight(module.qweight.data, module.scales.data, module.qzeros.data, perm, module.group_size,
                       module.in_features, module.out_features)
        w = platform.w4a16_layout(w, dtype)
        for kind, t in (("qweight", w.qweight), ("scales", w.scales), ("qzeros", w.zeros)):
            module.register_parameter(kind, nn.Parameter(t, requires_grad=False))
        module.register_buffer("perm", w.perm, persistent=False)
        module.matmul = Int4Matmul(w, platform)
    return len(layers)


def _sort_groups(module) -> torch.Tensor | None:
    """GPTQ act-order: the rows sorted by group (stable), so each group is `group_size` rows in a row, as
    the GEMMs read them; the permutation x's columns take. None where g_idx is already in order."""
    if getattr(module, "g_idx", None) is None:
        return None
    g_idx = module.g_idx.data.long()
    del module.g_idx
    k, group = module.in_features, module.group_size
    in_order = torch.arange(k, device=g_idx.device) // group
    if torch.equal(g_idx, in_order):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], in_order):
        raise ValueError(f"{module.int4_name}: g_idx does not give every group {group} rows; not supported")
    module.qweight.data = pack_rows(unpack_rows(module.qweight.data)[perm])
    return perm
