"""Qwen2-Audio: Whisper's encoder (models/layers/audio.py) and a linear projector in front of the
Qwen2 decoder. Audio-pad tokens (`<|AUDIO|>`) take the projected encoder outputs instead of the
token embedding; positions are plain 1-D, so everything after the prefill's embeddings (the
decoder, its KV, decode steps and their graphs) is Qwen2's own.

The engine drives it through the same seam as a vision-language model (models/vision_language.py's
`MultimodalStep`: rows of the step that hold pads, and their embeddings); `encode_audio` is its
encoder half, run by engine/runner/vision_step.py on the prefill (or colocated) worker.
Checkpoint names are the published ones: `audio_tower.*`, `multi_modal_projector.linear.*`,
`language_model.model.*`, `language_model.lm_head.*`.
"""
from __future__ import annotations

import torch
from torch import nn

from baton.models.decoder import DecoderForCausalLM
from baton.models.forward_context import ForwardContext
from baton.models.layers.audio import AudioEncoder
from baton.models.layers.linear import TPInfo
from baton.models.qwen2 import Qwen2ForCausalLM
from baton.models.vision_language import MultimodalStep


class AudioProjector(nn.Module):
    def __init__(self, audio_dim: int, hidden: int):
        super().__init__()
        self.linear = nn.Linear(audio_dim, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Qwen2AudioForConditionalGeneration(nn.Module):
    qk_norm = False
    qkv_bias = True
    packed_modules_mapping = DecoderForCausalLM.packed_modules_mapping

    def __init__(self, config, ops, dtype=None, tp: TPInfo | None = None):
        super().__init__()
        tp = tp or TPInfo()
        if tp.size > 1:
            raise ValueError("Qwen2-Audio runs without tensor parallelism for now (tp_size 1)")
        self.config = config
        self.audio_tower = AudioEncoder(config.audio_config)
        self.multi_modal_projector = AudioProjector(config.audio_config.d_model, config.text_config.hidden_size)
        if dtype is not None:
            self.audio_tower.to(dtype)
            self.multi_modal_projector.to(dtype)
        self.language_model = Qwen2ForCausalLM(config.text_config, ops, dtype, tp)
        self.tie_word_embeddings = self.language_model.tie_word_embeddings
        self.num_layers = self.language_model.num_layers
        self.num_kv_heads = self.language_model.num_kv_heads
        self.head_dim = self.language_model.head_dim

    @property
    def model(self):
        """The decoder (what prefill graphs and draft heads reach for in a text model)."""
        return self.language_model.model

    @property
    def image_embed_dim(self) -> int:
        """Width of the pad embeddings (the protocol's name, shared with vision-language models)."""
        return self.config.text_config.hidden_size

    def encode_audio(self, features: torch.Tensor, frames: list[int]) -> torch.Tensor:
        """Log-mel features [clips, mel bins, window] -> the audio tokens' embeddings [tokens, hidden],
        clips in prompt order."""
        return self.multi_modal_projector(torch.cat(self.audio_tower(features, frames)))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                mm: MultimodalStep | None = None) -> torch.Tensor:
        if mm is None:
            return self.language_model(input_ids, positions, ctx)
        lm = self.language_model.model
        x = lm.embed_tokens(input_ids)
        x = x.index_copy(0, mm.image_rows, mm.image_embeds.to(x.dtype))
        residual = None
        for layer in lm.layers:
            x, residual = layer(positions, x, residual, ctx)
        x, _ = lm.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def remap_weight(self, name: str):
        return None
