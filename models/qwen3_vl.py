"""Qwen3-VL: the vision tower (models/layers/vision.py) in front of the Qwen3 decoder.

What differs from Qwen3 in the text model, and how it is carried:
- image-pad tokens take the vision tower's embeddings instead of the token embedding;
- "deepstack": the outputs of the deepstack mergers are added, at the image positions, to the
  hidden states after the first len(deepstack) decoder layers;
- interleaved MRoPE: every token has (t, h, w) positions; rotary frequency column j rotates
  by the h position when j % 3 == 1 (and j < 3 * mrope_section[1]), by w when j % 3 == 2
  (j < 3 * mrope_section[2]), else by t. Text tokens have t = h = w, so for them (and for
  every decode token) this is plain 1-D rotary: decode steps and their graphs are unchanged.

The prefill step's MRoPE cos/sin are gathered once per step from the shared 1-D table, and
the layers then index that per-step table with 0..T-1: the same `qk_norm_rotary` call
(fused on CUDA) serves both.
"""
from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
from torch import nn

from baton.models.decoder import MLP, DecoderForCausalLM, DecoderModel
from baton.models.forward_context import ForwardContext
from baton.models.layers.embedding import ParallelLMHead
from baton.models.layers.linear import TPInfo
from baton.models.layers.vision import VisionTransformer
from baton.models.vision_language import MultimodalStep


def mrope_columns(head_dim: int, section: list[int]) -> torch.Tensor:
    """[head_dim] int64: which of (t, h, w) rotates each rotary column (interleaved layout)."""
    half = head_dim // 2
    axis = torch.zeros(half, dtype=torch.int64)
    j = torch.arange(half)
    axis[(j % 3 == 1) & (j < 3 * section[1])] = 1
    axis[(j % 3 == 2) & (j < 3 * section[2])] = 2
    return torch.cat([axis, axis])


class Qwen3VLModel(nn.Module):
    def __init__(self, config, ops, tp: TPInfo, dtype):
        super().__init__()
        text = config.text_config
        self.visual = VisionTransformer(config.vision_config)
        if dtype is not None:
            self.visual.to(dtype)
        self.language_model = DecoderModel(text, ops, tp, dtype, False, True,
                                           lambda c, i, o, t, d: MLP(c, o, t, d))


class Qwen3VLForConditionalGeneration(nn.Module):
    qk_norm = True
    qkv_bias = False
    packed_modules_mapping = DecoderForCausalLM.packed_modules_mapping

    def __init__(self, config, ops, dtype=None, tp: TPInfo | None = None):
        super().__init__()
        tp = tp or TPInfo()
        if tp.size > 1:
            raise ValueError("Qwen3-VL runs without tensor parallelism for now (tp_size 1)")
        text = config.text_config
        if getattr(text, "attention_bias", False):
            raise ValueError("Qwen3-VL with attention_bias is not supported")
        self.config = config
        self.model = Qwen3VLModel(config, ops, tp, dtype)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(text.vocab_size, text.hidden_size, tp, dtype)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.language_model.embed_tokens.weight
        attn = self.model.language_model.layers[0].self_attn
        self.num_layers = text.num_hidden_layers
        self.num_kv_heads = attn.num_kv_heads
        self.head_dim = attn.head_dim
        self.rotary = attn.rotary
        section = (text.rope_parameters or {}).get("mrope_section", [24, 20, 20])
        self.register_buffer("mrope_axis", mrope_columns(self.head_dim, section), persistent=False)

    @property
    def visual(self) -> VisionTransformer:
        return self.model.visual

    @property
    def image_embed_dim(self) -> int:
        return self.config.text_config.hidden_size

    def encode_images(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]
                      ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The vision tower: (image-token embeddings, deepstack embeddings) in prompt order."""
        return self.visual(pixels, grids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                mm: MultimodalStep | None = None) -> torch.Tensor:
        lm = self.model.language_model
        x = lm.embed_tokens(input_ids)
        if mm is None:
            return self._layers(x, positions, ctx, None)
        x = x.index_copy(0, mm.image_rows, mm.image_embeds.to(x.dtype))
        with self._step_rotary(mm.mrope_positions):
            rows = torch.arange(x.shape[0], device=x.device)
            return self._layers(x, rows, ctx, mm)

    def _layers(self, x, positions, ctx, mm: MultimodalStep | None) -> torch.Tensor:
        lm = self.model.language_model
        residual = None
        for i, layer in enumerate(lm.layers):
            x, residual = layer(positions, x, residual, ctx)
            if mm is not None and i < len(mm.deepstack) and len(mm.image_rows):
                # the layer's output is x + residual: add to x, at the image rows only
                x = x.index_add(0, mm.image_rows, mm.deepstack[i].to(x.dtype))
        x, _ = lm.norm(x, residual)
        return x

    @contextmanager
    def _step_rotary(self, mrope_positions: torch.Tensor):
        """Point the shared rotary tables at this step's gathered MRoPE rows, then restore them."""
        rot = self.rotary
        cos, sin = rot.cos, rot.sin
        cols = torch.arange(cos.shape[1], device=cos.device)
        pos = mrope_positions[self.mrope_axis].T                                  # [T, D]
        rot.cos, rot.sin = cos[pos, cols], sin[pos, cols]
        try:
            yield
        finally:
            rot.cos, rot.sin = cos, sin

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def remap_weight(self, name: str):
        return None

    @staticmethod
    def checkpoint_shapes(config) -> list[tuple[str, tuple[int, ...]]]:
        """Every tensor of an HF checkpoint of this config, with its shape (random presets)."""
        from baton.models.loader import checkpoint_shapes
        text = copy.copy(config.text_config)        # the text part is a Qwen3 checkpoint's, renamed
        text.architectures = ["Qwen3ForCausalLM"]
        text.tie_word_embeddings = bool(config.tie_word_embeddings)
        out = [(n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n, s)
               for n, s in checkpoint_shapes(text)]
        return out + vision_shapes(config.vision_config)


def vision_shapes(vc) -> list[tuple[str, tuple[int, ...]]]:
    e, i, p, tp = vc.hidden_size, vc.intermediate_size, vc.patch_size, vc.temporal_patch_size
    wide = e * vc.spatial_merge_size ** 2
    v = "model.visual."
    out = [(v + "patch_embed.proj.weight", (e, vc.in_channels, tp, p, p)), (v + "patch_embed.proj.bias", (e,)),
           (v + "pos_embed.weight", (vc.num_position_embeddings, e))]
    for b in range(vc.depth):
        q = f"{v}blocks.{b}."
        out += [(q + "norm1.weight", (e,)), (q + "norm1.bias", (e,)), (q + "norm2.weight", (e,)),
                (q + "norm2.bias", (e,)), (q + "attn.qkv.weight", (3 * e, e)), (q + "attn.qkv.bias", (3 * e,)),
                (q + "attn.proj.weight", (e, e)), (q + "attn.proj.bias", (e,)),
                (q + "mlp.linear_fc1.weight", (i, e)), (q + "mlp.linear_fc1.bias", (i,)),
                (q + "mlp.linear_fc2.weight", (e, i)), (q + "mlp.linear_fc2.bias", (e,))]
    mergers = ["merger."] + [f"deepstack_merger_list.{k}." for k in range(len(vc.deepstack_visual_indexes))]
    for k, m in enumerate(mergers):
        norm = e if k == 0 else wide
        out += [(v + m + "norm.weight", (norm,)), (v + m + "norm.bias", (norm,)),
                (v + m + "linear_fc1.weight", (wide, wide)), (v + m + "linear_fc1.bias", (wide,)),
                (v + m + "linear_fc2.weight", (vc.out_hidden_size, wide)),
                (v + m + "linear_fc2.bias", (vc.out_hidden_size,))]
    return out
