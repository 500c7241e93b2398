"""Qwen2-Audio's audio tower: Whisper's encoder (two 1-D convolutions over the log-mel frames, learned
positions, pre-norm transformer layers) with a 2x average pool before its final norm; and the log-mel
features it reads, from transformers' WhisperFeatureExtractor (the model's own processor's).

Every clip is padded to the feature extractor's window (the encoder's fixed input length); the padded
frames are masked as keys, as transformers does, so a clip's tokens do not depend on the others'.
It runs eagerly once per request on the prefill side, in plain torch (no tensor parallelism).
"""
from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from baton.models.audio import AudioInput, AudioPlaceholders


def log_mel_features(clips: list[AudioInput], placeholders: AudioPlaceholders) -> tuple[np.ndarray, list[int]]:
    """(features [clips, mel bins, window frames] float32, each clip's frame count)."""
    p = placeholders
    samples = [p.decode(clip, k) for k, clip in enumerate(clips)]
    out = _extractor(p.num_mel_bins, p.sampling_rate, p.hop_length, p.n_fft, p.n_samples)(
        samples, sampling_rate=p.sampling_rate, padding="max_length", return_attention_mask=True, return_tensors="np")
    frames = [int(m.sum()) for m in out["attention_mask"]]
    return np.asarray(out["input_features"], dtype=np.float32), frames


@functools.lru_cache(maxsize=4)
def _extractor(mel_bins: int, rate: int, hop: int, n_fft: int, n_samples: int):
    """transformers' WhisperFeatureExtractor with the checkpoint's settings (its mel filters made once)."""
    from transformers import WhisperFeatureExtractor
    extractor = WhisperFeatureExtractor(feature_size=mel_bins, sampling_rate=rate, hop_length=hop, n_fft=n_fft)
    extractor.n_samples, extractor.nb_max_frames = n_samples, n_samples // hop     # the window, in samples
    return extractor


class AudioAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q_proj = nn.Linear(dim, dim, bias=True)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=True)
        self.out_proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """x [clips, T, dim]; key_mask [clips, 1, 1, T], True where a frame is the clip's."""
        b, t, _ = x.shape

        def heads(y):
            return y.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)),
                                             attn_mask=key_mask)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, -1))


class AudioEncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        if config.activation_function != "gelu":
            raise ValueError(f"audio encoder activation {config.activation_function!r} is not supported (gelu)")
        d = config.d_model
        self.self_attn = AudioAttention(d, config.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, config.encoder_ffn_dim)
        self.fc2 = nn.Linear(config.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), key_mask)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    """Checkpoint names as Qwen2-Audio's `audio_tower.*`."""

    def __init__(self, config):
        super().__init__()
        if getattr(config, "scale_embedding", False):
            raise ValueError("an audio encoder with scale_embedding is not supported")
        d = config.d_model
        self.max_source_positions = config.max_source_positions
        self.conv1 = nn.Conv1d(config.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(config.max_source_positions, d)
        self.layers = nn.ModuleList(AudioEncoderLayer(config) for _ in range(config.encoder_layers))
        self.layer_norm = nn.LayerNorm(d)

    def forward(self, features: torch.Tensor, frames: list[int]) -> list[torch.Tensor]:
        """features [clips, mel bins, 2 * max_source_positions]; each clip's output rows, [tokens, d]."""
        dtype = self.conv1.weight.dtype
        x = F.gelu(self.conv2(F.gelu(self.conv1(features.to(dtype)))))      # [clips, d, max_source_positions]
        x = x.transpose(1, 2) + self.embed_positions.weight
        kept = torch.tensor([(f - 1) // 2 + 1 for f in frames], device=x.device)
        key_mask = (torch.arange(x.shape[1], device=x.device) < kept[:, None])[:, None, None, :]
        for layer in self.layers:
            x = layer(x, key_mask)
        x = self.layer_norm(F.avg_pool1d(x.transpose(1, 2), 2, 2).transpose(1, 2))
        return [x[k, :(int(n) - 2) // 2 + 1] for k, n in enumerate(kept.tolist())]
