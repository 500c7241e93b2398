"""What the engine needs of a model that sees images: the `VisionLanguageModel` protocol and
the per-step record it takes (`MultimodalStep`). engine/runner/vision_step.py talks to this, never
to a particular model, so a second vision-language architecture is a model file, not an
engine change. Qwen3-VL (models/qwen3_vl.py) is the one today.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from baton.models.forward_context import ForwardContext


@dataclass(slots=True)
class MultimodalStep:
    """A prefill step's multimodal inputs, on the device. `image_rows`: rows of the step's
    flat token batch that hold image pads; `image_embeds` / each of `deepstack`: their
    embeddings, row for row; `mrope_positions` [3, T]: every row's (t, h, w) position."""
    mrope_positions: torch.Tensor
    image_rows: torch.Tensor
    image_embeds: torch.Tensor
    deepstack: list[torch.Tensor] = field(default_factory=list)


@runtime_checkable
class VisionLanguageModel(Protocol):
    """A causal LM whose prompts may hold images."""

    @property
    def image_embed_dim(self) -> int:
        """Width of the embeddings `encode_images` returns (the text model's hidden size)."""

    def encode_images(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]
                      ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The vision tower over preprocessed patches: (image-token embeddings [tokens, D],
        deepstack embeddings, each [tokens, D]), in prompt order."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                mm: MultimodalStep | None = None) -> torch.Tensor:
        """A step; `mm` carries its image rows (None: a text-only step, e.g. decode)."""
