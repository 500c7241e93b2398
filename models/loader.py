"""Building a model and putting weights into it: HF safetensors through each parameter's weight_loader, or
deterministic random weights for presets."""
from __future__ import annotations

import contextlib
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from baton.models.layers import quantization
from baton.models.layers.int4 import prepare_int4
from baton.models.layers.linear import TPInfo
from baton.models.layers.moe import is_moe_layer
from baton.models.registry import model_class
from baton.progress import Progress

IGNORED = ("rotary_emb.inv_freq",)
# a float8 KV cache's scales in FP8 checkpoints (vLLM, compressed-tensors): one per layer, for K and V
# (kv_scale: one for both); kept on the model as `checkpoint_kv_scales` (engine/runner/kv_scales.py)
KV_SCALE = re.compile(r"layers\.(\d+)\.self_attn\.(k|v|kv)_scale$")


def build_model(hf_config, dtype: torch.dtype, device, ops, tp_rank: int = 0, tp_size: int = 1,
                tp_group=None, expert_parallel: str | None = None,
                redundant_experts: tuple[int, ...] = ()) -> nn.Module:
    """An empty (uninitialised) model for this config on `device`; load or init weights next. An AWQ /
    GPTQ checkpoint's projections are INT4 (models/layers/int4.py): their bf16 weights, allocated by the
    layers, are freed here, before any is read (the peak while building is the bf16 model's)."""
    cls = model_class((getattr(hf_config, "architectures", None) or ["?"])[0])
    if expert_parallel is not None and not getattr(cls, "uses_moe", False):
        raise ValueError(f"--enable-expert-parallel splits routed experts over the ranks; {cls.__name__} has none "
                         "(serve it without the flag: its layers are tensor-parallel)")
    scheme = quantization.checkpoint_int4_scheme(hf_config)
    with torch.device(device):
        model = cls(hf_config, ops, dtype=dtype, tp=TPInfo(tp_rank, tp_size, tp_group, expert_parallel, redundant_experts))
        if scheme is not None:          # INT4 projections: packed tensors whose loaders read AWQ / GPTQ
            prepare_int4(model, scheme)
    return model


def load_weights(model: nn.Module, path: str | Path) -> None:
    """Every tensor of the checkpoint into its parameter. A pre-quantized checkpoint's FP8
    tensors arrive widened (times their scales, which may sit in another file); their
    scales and static input scales are consumed, not loaded (models/layers/quantization.py).
    KV cache scales go to `model.checkpoint_kv_scales` {layer: (k, v)}."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}")
    quantized = quantization.checkpoint_method(model.config) is not None
    block = quantization.block_size(model.config)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    kv_scales: dict[int, dict[str, float]] = {}
    ignored = IGNORED + getattr(model, "ignored_weights", ())
    rename = getattr(model, "checkpoint_name", None)     # a model whose checkpoints spell names their own way
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(safe_open(f, framework="pt")) for f in files]
        where = {name: st for st in handles for name in st.keys()}
        progress = Progress("loading weights", len(files), "files") if len(files) > 1 else None
        for i, st in enumerate(handles):
            if progress is not None:
                progress.update(i + 1)
            for stored in st.keys():
                name = rename(stored) if rename is not None else stored
                if any(name.endswith(s) for s in ignored) or (quantized and quantization.is_scale(name)):
                    continue
                if hit := KV_SCALE.search(name):     # a scalar (or one per head: the largest serves)
                    kv_scales.setdefault(int(hit[1]), {})[hit[2]] = float(st.get_tensor(stored).float().max())
                    continue
                loaded.add(_load_one(model, params, name, _read(st, stored, where, quantized, block)))
    if progress is not None:
        progress.done(f"loaded weights from {len(files)} files")
    _check_complete(model, params, loaded)
    model.checkpoint_kv_scales = {}
    for layer, found in kv_scales.items():
        k, v = found.get("k", found.get("kv")), found.get("v", found.get("kv"))
        if k is None or v is None:
            raise ValueError(f"checkpoint layer {layer} has a KV cache scale for {'K' if v is None else 'V'} only")
        model.checkpoint_kv_scales[layer] = (k, v)


def _read(st, name: str, where: dict, quantized: bool, block) -> torch.Tensor:
    tensor = st.get_tensor(name)
    if not quantized or tensor.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return tensor
    scale = quantization.scale_name(name, where)
    if scale is None:
        raise ValueError(f"checkpoint tensor {name!r} is float8 but has no {name}_scale_inv or {name}_scale")
    return quantization.dequantize(tensor, where[scale].get_tensor(scale), block)


def _load_one(model, params: dict, name: str, tensor: torch.Tensor) -> str:
    remap = getattr(model, "remap_weight", None)
    hit = remap(name) if remap is not None else None
    if hit is not None:
        pname, shard = hit
        params[pname].weight_loader(params[pname], tensor, shard)
        return pname
    for part, (target, shard) in getattr(model, "packed_modules_mapping", {}).items():
        pname = name.replace(f".{part}.", f".{target}.")
        if pname != name and pname in params:      # (an unpacked module of that name, e.g. an audio tower's, loads as is)
            param = params[pname]
            param.weight_loader(param, tensor, shard)
            return pname
    if name not in params:
        if name == "lm_head.weight" and getattr(model, "tie_word_embeddings", False):
            return name          # tied: the embedding is the head
        raise ValueError(f"checkpoint tensor {name!r} has no parameter in {type(model).__name__}")
    param = params[name]
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        param.data.copy_(tensor)
    else:
        loader(param, tensor)
    return name


def _check_complete(model, params: dict, loaded: set[str]) -> None:
    missing = [n for n in params if n not in loaded and not (n == "lm_head.weight" and model.tie_word_embeddings)]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")


def checkpoint_shapes(config) -> list[tuple[str, tuple[int, ...]]]:
    """The tensors an HF checkpoint of this decoder config holds, with their full shapes."""
    custom = getattr(model_class(config.architectures[0]), "checkpoint_shapes", None)
    if custom is not None:                    # a model with more than a decoder (Qwen3-VL's vision tower)
        return custom(config)
    h, v, i = config.hidden_size, config.vocab_size, config.intermediate_size
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    hq, hkv = config.num_attention_heads * d, config.num_key_value_heads * d
    arch = config.architectures[0]
    bias = arch == "Qwen2ForCausalLM" or bool(getattr(config, "attention_bias", False))
    out = [("model.embed_tokens.weight", (v, h)), ("model.norm.weight", (h,))]
    if not getattr(config, "tie_word_embeddings", False):
        out.append(("lm_head.weight", (v, h)))
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        out += [(p + "self_attn.q_proj.weight", (hq, h)), (p + "self_attn.k_proj.weight", (hkv, h)),
                (p + "self_attn.v_proj.weight", (hkv, h)), (p + "self_attn.o_proj.weight", (h, hq)),
                (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
        if is_moe_layer(config, n):
            e, m = config.num_experts, config.moe_intermediate_size
            out.append((p + "mlp.gate.weight", (e, h)))
            for x in range(e):
                q = f"{p}mlp.experts.{x}."
                out += [(q + "gate_proj.weight", (m, h)), (q + "up_proj.weight", (m, h)), (q + "down_proj.weight", (h, m))]
        else:
            out += [(p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                    (p + "mlp.down_proj.weight", (h, i))]
        if bias:
            out += [(p + "self_attn.q_proj.bias", (hq,)), (p + "self_attn.k_proj.bias", (hkv,)),
                    (p + "self_attn.v_proj.bias", (hkv,))]
        if model_class(arch).qk_norm:
            out += [(p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,))]
    return out


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights in real shapes, as a synthesized checkpoint routed through the weight
    loaders, so every tensor-parallel layout of the same seed holds the same model."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = set()
    for k, (name, shape) in enumerate(checkpoint_shapes(model.config)):
        if len(shape) == 1:
            t = torch.ones(shape) if name.endswith("norm.weight") else torch.zeros(shape)
        else:
            g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + k)
            t = torch.randn(shape, generator=g, device=device, dtype=dtype).mul_(0.02)
        loaded.add(_load_one(model, params, name, t.to(device=device, dtype=dtype)))
    _check_complete(model, params, loaded)
