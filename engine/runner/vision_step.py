"""The device half of a multimodal prefill step: encode a sequence's images or audio clips (once, at
its first chunk that holds their tokens) and pick the embeddings of the step's pad rows. Any model
keeping models/vision_language.py's `VisionLanguageModel` protocol will do; an audio-language model
(Qwen2-Audio) brings `encode_audio` instead of `encode_images`, and no deepstack."""
from __future__ import annotations

import numpy as np
import torch

from baton.engine.scheduling.multimodal import ImageChunk, MultimodalPrompt
from baton.models.audio import AudioInput, AudioPlaceholders
from baton.models.layers.audio import log_mel_features
from baton.models.layers.vision import preprocess_image
from baton.models.multimodal import ImagePlaceholders
from baton.models.vision_language import MultimodalStep, VisionLanguageModel


def multimodal_step(model: VisionLanguageModel, hf_config, chunks: list[ImageChunk], mrope: np.ndarray,
                    device: torch.device) -> MultimodalStep:
    rows, embeds, deepstack = [], [], []
    for chunk in chunks:
        mm: MultimodalPrompt = chunk.seq.mm
        if mm.encoded is None:
            mm.encoded = _encode(model, hf_config, mm, device)
        emb, deep, where = mm.encoded
        pick = np.flatnonzero((where >= chunk.begin) & (where < chunk.end))
        rows.append(chunk.row + where[pick] - chunk.begin)
        index = torch.from_numpy(pick).to(device)
        embeds.append(emb.index_select(0, index))
        deepstack.append([d.index_select(0, index) for d in deep])
        if chunk.end >= mm.image_end:              # the prompt's images are all computed: let go
            mm.encoded = None
    hidden = model.image_embed_dim
    image_rows = torch.from_numpy(np.concatenate(rows) if rows else np.zeros(0, np.int64)).to(device)
    image_embeds = torch.cat(embeds) if embeds else torch.zeros(0, hidden, device=device)
    layers = len(deepstack[0]) if deepstack else 0
    deep = [torch.cat([d[k] for d in deepstack]) for k in range(layers)]
    return MultimodalStep(torch.from_numpy(mrope).to(device), image_rows, image_embeds, deep)


def _encode(model: VisionLanguageModel, hf_config, mm: MultimodalPrompt, device: torch.device):
    """(embeddings [image tokens, H], deepstack list, each token's prompt index) for all the
    sequence's images, in prompt order."""
    if not mm.images_available:
        raise RuntimeError("this sequence's images are not on this worker; it cannot be recomputed here")
    where = np.concatenate([np.arange(s, e) for s, e in mm.spans])
    if isinstance(mm.images[0], AudioInput):
        features, frames = log_mel_features(list(mm.images), AudioPlaceholders.from_config(hf_config))
        return model.encode_audio(torch.from_numpy(features).to(device), frames), [], where
    placeholders = ImagePlaceholders.from_config(hf_config)
    pixels, grids = [], []
    for k, image in enumerate(mm.images):
        p, grid = preprocess_image(image, placeholders, k)
        pixels.append(p)
        grids.append(grid)
    x = torch.from_numpy(np.concatenate(pixels)).to(device)
    emb, deep = model.encode_images(x, grids)
    return emb, deep, where
