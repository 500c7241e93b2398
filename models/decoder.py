"""The decoder-only transformer that Llama, Qwen2 and Qwen3 share, composed from layers.

The architectures differ only in switches: qkv bias (Qwen2), per-head q/k RMSNorm (Qwen3),
tied embeddings, explicit head_dim, and the feed-forward block of each layer (dense, or routed
experts in Qwen3-MoE: `make_mlp`); MiniCPM sets its embedding and residual-branch scales
(`embed_scale`, `residual_scale`: None elsewhere, so other models run the same ops).
Attention goes through `ctx.attend`, so the model knows nothing of the KV cache or the platform.
"""
from __future__ import annotations

import torch
from torch import nn

from baton.models.forward_context import ForwardContext
from baton.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from baton.models.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    TPInfo,
)
from baton.models.layers.norm import RMSNorm
from baton.models.layers.quantization import Fp8Matmul
from baton.models.layers.rope_config import rope_parameters
from baton.models.layers.rotary import RotaryEmbedding


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int, ops, tp: TPInfo, dtype, qkv_bias: bool, qk_norm: bool,
                 rotary: RotaryEmbedding):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=qkv_bias, tp=tp, dtype=dtype)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        bias=False, tp=tp, dtype=dtype)
        self.rotary = rotary                 # one table for every layer (30 copies were 120 MB on SmolLM2)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops, dtype) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops, dtype) if qk_norm else None
        self.ops, self.eps = ops, config.rms_norm_eps

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext,
                reduce: bool = True) -> torch.Tensor:
        """reduce=False: the o_proj's partial sum on this rank, reduced by the RMSNorm after it."""
        q, k, v = self._qkv(positions, x)
        out = ctx.attend(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(x.shape[0], -1), reduce=reduce)

    def write_kv(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> None:
        """The step's K and V into the cache, as `forward` writes them, and nothing else (no attention,
        no output): for a layer whose KV must stay current while its output goes unused."""
        _, k, v = self._qkv(positions, x)
        ctx.store(self.layer_idx, k, v)

    def _qkv(self, positions: torch.Tensor, x: torch.Tensor):
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        q, k = self.ops.qk_norm_rotary(q, k, self.q_norm.weight if self.q_norm is not None else None,
                                       self.k_norm.weight if self.k_norm is not None else None, self.eps,
                                       self.rotary.cos, self.rotary.sin, positions)
        return q, k, v


class MLP(nn.Module):
    fp8_act = False     # down_proj is FP8: the activation comes quantized (fuse_fp8_inputs)

    def __init__(self, config, ops, tp: TPInfo, dtype):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (supported: silu)")
        self.ops = ops
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2,
                                                       bias=False, tp=tp, dtype=dtype)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=False, tp=tp,
                                           dtype=dtype)

    def forward(self, x, reduce: bool = True):
        h = self.gate_up_proj(x)
        return self.down_proj(self.ops.silu_and_mul_fp8(h) if self.fp8_act else self.ops.silu_and_mul(h),
                              reduce=reduce)


class DecoderLayer(nn.Module):
    residual_scale: float | None = None     # MiniCPM: each branch's output times this before the residual add

    def __init__(self, config, layer_idx, ops, tp, dtype, qkv_bias, qk_norm, rotary, mlp: nn.Module):
        super().__init__()
        self.self_attn = Attention(config, layer_idx, ops, tp, dtype, qkv_bias, qk_norm, rotary)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype)

    def forward(self, positions, x, residual, ctx, fuse: TPInfo | None = None):
        """fuse (DecoderModel.fused_reduce): each row-parallel projection's partial sum is all-reduced by the
        RMSNorm after it, in one kernel, so x comes in (residual set) and goes out as this rank's partial sum."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual, reduce=fuse)
        x = self.self_attn(positions, x, ctx, reduce=fuse is None)
        if self.residual_scale is not None:
            x = x * self.residual_scale
        x, residual = self.post_attention_layernorm(x, residual, reduce=fuse)
        x = self.mlp(x, reduce=False) if fuse is not None else self.mlp(x)
        if self.residual_scale is not None:
            x = x * self.residual_scale
        return x, residual

    def can_fuse_reduce(self) -> bool:
        """Can its all-reduces move into the RMSNorms after them (`fuse`)? Not where a branch is scaled
        between, a norm quantizes to FP8, or the feed-forward block is not the dense MLP."""
        return (self.residual_scale is None and type(self.mlp) is MLP
                and not (self.input_layernorm.fp8_out or self.post_attention_layernorm.fp8_out))


class DecoderModel(nn.Module):
    embed_scale: float | None = None        # MiniCPM: token embeddings times this
    # an EAGLE-3 head reads these layers' input hidden states (models/eagle3.py); () = none, no cost
    aux_layers: tuple[int, ...] = ()
    # set by fuse_reduced_norms: the TP whose all-reduces the RMSNorms do, fused (DecoderLayer.forward)
    fused_reduce: TPInfo | None = None

    def __init__(self, config, ops, tp, dtype, qkv_bias, qk_norm, make_mlp):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype)
        theta, scaling = rope_parameters(config)
        rotary = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings, theta, scaling)
        self.layers = nn.ModuleList(DecoderLayer(config, i, ops, tp, dtype, qkv_bias, qk_norm, rotary,
                                                 make_mlp(config, i, ops, tp, dtype))
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype)

    def fuse_reduced_norms(self) -> bool:
        """The all-reduce after each row-parallel projection done by the RMSNorm after it, in one kernel
        (models/layers/custom_all_reduce.install calls it once its all-reduce can); False where a layer cannot."""
        tp = self.embed_tokens.tp
        if tp.size > 1 and all(layer.can_fuse_reduce() for layer in self.layers) and not self.norm.fp8_out:
            self.fused_reduce = tp
        return self.fused_reduce is not None

    def forward(self, input_ids, positions, ctx):
        """[T, hidden]; with `aux_layers` set, [T, hidden * (1 + len(aux_layers))]: the normed output,
        then the residual stream entering each of those layers (the number of layers: after the last)."""
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        residual = None
        aux = {}
        fuse = self.fused_reduce if not self.aux_layers else None      # (the aux states need the sums)
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:
                aux[i] = x if residual is None else x + residual
            x, residual = layer(positions, x, residual, ctx, fuse) if fuse is not None else \
                layer(positions, x, residual, ctx)
        if len(self.layers) in self.aux_layers:
            aux[len(self.layers)] = x + residual
        x, _ = self.norm(x, residual, reduce=fuse)
        return torch.cat([x, *(aux[i] for i in self.aux_layers)], dim=-1) if aux else x


class DecoderForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, ops, dtype=None, tp: TPInfo | None = None):
        super().__init__()
        tp = tp or TPInfo()
        self.config = config
        self.model = DecoderModel(config, ops, tp, dtype, self.qkv_bias, self.qk_norm, self.make_mlp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, dtype)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        attn = self.model.layers[0].self_attn
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = attn.num_kv_heads
        self.head_dim = attn.head_dim

    def make_mlp(self, config, layer_idx: int, ops, tp: TPInfo, dtype) -> nn.Module:
        """Layer `layer_idx`'s feed-forward block (a MoE model picks per layer)."""
        return MLP(config, ops, tp, dtype)

    def remap_weight(self, name: str) -> tuple[str, object] | None:
        """(parameter, shard) for a checkpoint tensor that needs more than the packed mapping
        (a MoE model's per-expert tensors); None: the usual routing."""
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def fuse_fp8_inputs(model: nn.Module) -> int:
    """Where an RMSNorm or the MLP's SiLU-and-mul feeds nothing but an FP8 projection (a decoder
    layer's qkv_proj, a dense MLP's gate_up_proj and down_proj), that op writes the projection's
    e4m3 input and per-token scales itself (`LayerOps.rms_norm_fp8`, `silu_and_mul_fp8`: one
    kernel instead of two on CUDA; the numbers do not change). The o_proj keeps its own
    quantizer. For `Fp8Matmul`s that run a scaled GEMM; returns how many ops now quantize."""
    def fp8(linear) -> bool:
        return isinstance(linear.matmul, Fp8Matmul) and linear.matmul.mode == "scaled_mm"

    n = 0
    for module in model.modules():
        if isinstance(module, DecoderLayer):
            if fp8(module.self_attn.qkv_proj):
                module.input_layernorm.fp8_out = True
                n += 1
            if type(module.mlp) is MLP and fp8(module.mlp.gate_up_proj):
                module.post_attention_layernorm.fp8_out = True
                n += 1
        elif type(module) is MLP and fp8(module.down_proj):
            module.fp8_act = True
            n += 1
    return n
