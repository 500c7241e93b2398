"""Qwen3-VL's vision tower: a ViT over 16x16 (x2 frames) patches with learned position
embeddings resampled to each image's grid, 2-D rotary, a 2x2 patch merger into the LLM's width,
and "deepstack" mergers whose outputs are added to the first LLM layers' hidden states.

It runs eagerly once per request on the prefill side (never in a decode graph), in plain torch:
no tensor parallelism, attention per image with SDPA.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from baton.models.multimodal import ImageInput, ImagePlaceholders, open_image


def preprocess_image(image: ImageInput, placeholders: ImagePlaceholders, index: int = 0
                     ) -> tuple[np.ndarray, tuple[int, int, int]]:
    """(pixel patches [h*w, C*T*P*P] float32 in merge-block order, grid (t, h, w)) as the
    model's image processor lays them out (resize: PIL bicubic to the smart_resize size; rescale,
    mean and std: the checkpoint's preprocessor_config.json, through `placeholders`)."""
    from PIL import Image
    im = open_image(image, index)
    t, gh, gw = placeholders.grid_thw(image, index)
    p, m, tp = placeholders.patch_size, placeholders.merge_size, placeholders.temporal_patch_size
    im = im.resize((gw * p, gh * p), Image.Resampling.BICUBIC)
    x = np.asarray(im, dtype=np.float32).transpose(2, 0, 1) * np.float32(placeholders.rescale_factor)
    mean = np.array(placeholders.image_mean, np.float32)[:, None, None]
    x = (x - mean) / np.array(placeholders.image_std, np.float32)[:, None, None]
    return patchify(x, p, m, tp), (t, gh, gw)


def patchify(x: np.ndarray, patch: int, merge: int, temporal: int) -> np.ndarray:
    """[C, H, W] -> [H/p * W/p, C*temporal*p*p]: patches ordered merge block by merge block (the
    merger joins m*m consecutive rows), each patch's pixels channel-major, the single frame
    repeated `temporal` times."""
    c, h, w = x.shape
    gh, gw = h // patch, w // patch
    x = x.reshape(c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.transpose(1, 4, 2, 5, 0, 3, 6)                       # bh, bw, mh, mw, c, ph, pw
    x = np.broadcast_to(x[:, :, :, :, :, None], x.shape[:5] + (temporal, patch, patch))
    return np.ascontiguousarray(x).reshape(gh * gw, c * temporal * patch * patch)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim).unbind(1)
        c, s = cos[:, None].float(), sin[:, None].float()      # rotary in fp32, as the reference does
        q = (q.float() * c + _rotate_half(q.float()) * s).to(v.dtype)
        k = (k.float() * c + _rotate_half(k.float()) * s).to(v.dtype)
        outs = []
        for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True):
            o = F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1))
            outs.append(o.transpose(0, 1))                        # each image attends only to itself
        return self.proj(torch.cat(outs).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        if act not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"vision hidden_act {act!r} is not supported (gelu_pytorch_tanh, gelu)")
        self.approximate = "tanh" if act == "gelu_pytorch_tanh" else "none"
        self.linear_fc1 = nn.Linear(dim, hidden, bias=True)
        self.linear_fc2 = nn.Linear(hidden, dim, bias=True)

    def forward(self, x):
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.norm1 = nn.LayerNorm(vc.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(vc.hidden_size, eps=1e-6)
        self.attn = VisionAttention(vc.hidden_size, vc.num_heads)
        self.mlp = VisionMLP(vc.hidden_size, vc.intermediate_size, vc.hidden_act)

    def forward(self, x, cos, sin, lengths):
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """m*m neighbouring patches -> one LLM token. The main merger normalises each patch before
    joining them; the deepstack ones normalise the joined vector ("post-shuffle")."""

    def __init__(self, vc, post_shuffle_norm: bool):
        super().__init__()
        self.width = vc.hidden_size * vc.spatial_merge_size ** 2
        self.post_shuffle_norm = post_shuffle_norm
        self.norm = nn.LayerNorm(self.width if post_shuffle_norm else vc.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width, bias=True)
        self.linear_fc2 = nn.Linear(self.width, vc.out_hidden_size, bias=True)

    def forward(self, x):
        x = self.norm(x.reshape(-1, self.width)) if self.post_shuffle_norm else self.norm(x).reshape(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class PatchEmbed(nn.Module):
    def __init__(self, vc):
        super().__init__()
        kernel = (vc.temporal_patch_size, vc.patch_size, vc.patch_size)
        self.proj = nn.Conv3d(vc.in_channels, vc.hidden_size, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # each row is exactly one kernel-sized patch: the convolution is one matmul
        w = self.proj.weight
        return F.linear(pixels.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class VisionTransformer(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.merge = vc.spatial_merge_size
        self.patch_embed = PatchEmbed(vc)
        self.pos_embed = nn.Embedding(vc.num_position_embeddings, vc.hidden_size)
        self.side = int(vc.num_position_embeddings ** 0.5)
        self.blocks = nn.ModuleList(VisionBlock(vc) for _ in range(vc.depth))
        self.merger = PatchMerger(vc, post_shuffle_norm=False)
        self.deepstack_visual_indexes = list(vc.deepstack_visual_indexes)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(vc, post_shuffle_norm=True)
                                                   for _ in self.deepstack_visual_indexes)
        self.head_dim = vc.hidden_size // vc.num_heads
        self.theta = float((getattr(vc, "rope_parameters", None) or {}).get("rope_theta", 10000.0))

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixels [N, C*T*P*P] for the images of `grids` -> (LLM embeddings [N/m^2, H], one
        deepstack tensor [N/m^2, H] per deepstack layer)."""
        x = self.patch_embed(pixels)
        x = x + self._positions(grids).to(x.dtype)
        cos, sin = self._rotary(grids, x.device)
        lengths = [h * w for t, h, w in grids for _ in range(t)]
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, lengths)
            if i in self.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[self.deepstack_visual_indexes.index(i)](x))
        return self.merger(x), deepstack

    def _merge_order(self, t: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """[h, w, ...] in raster order -> [h*w, ...] in merge-block order."""
        m = self.merge
        t = t.reshape(h // m, m, w // m, m, *t.shape[2:]).transpose(1, 2)
        return t.reshape(h * w, *t.shape[4:])

    def _positions(self, grids) -> torch.Tensor:
        """The learned side x side position table resampled bilinearly (corners aligned) to each grid."""
        out = []
        table = self.pos_embed.weight
        for t, h, w in grids:
            rows, rw = self._taps(h, table.device)
            cols, cw = self._taps(w, table.device)
            idx = rows[:, None, :, None] * self.side + cols[None, :, None, :]           # [h, w, 2, 2]
            wt = rw[:, None, :, None] * cw[None, :, None, :]
            emb = (table[idx.reshape(h, w, 4)] * wt.reshape(h, w, 4, 1)).sum(2)
            out.append(self._merge_order(emb, h, w).repeat(t, 1))
        return torch.cat(out)

    def _taps(self, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """For n target positions along a side: the two source indices and their weights."""
        src = torch.arange(n, device=device, dtype=torch.float32) * (self.side - 1) / max(n - 1, 1)
        lo = src.floor()
        frac = src - lo
        idx = torch.stack([lo.long(), (lo.long() + 1).clamp(max=self.side - 1)], dim=1)
        return idx, torch.stack([1 - frac, frac], dim=1)

    def _rotary(self, grids, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [N, head_dim]: a patch's row rotates the first quarter of the frequencies'
        span, its column the second; the half is repeated (rotate-half layout)."""
        parts = []
        for t, h, w in grids:
            hw = torch.stack(torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device),
                                            indexing="ij"), dim=-1)                 # [h, w, 2]
            parts.append(self._merge_order(hw, h, w).repeat(t, 1))
        pos = torch.cat(parts).float()
        half = self.head_dim // 2          # (computed here, in fp32, whatever dtype the weights take)
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=device) / half))
        freqs = torch.cat([pos[:, :1] * inv_freq, pos[:, 1:] * inv_freq], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()
