"""A sequence's images (or audio clips), as the engine keeps them (torch-free, like the rest above
the runner). An audio-language model's clips travel the same road as images: their pads, spans and
digests alike; their positions are plain 1-D (AudioPlaceholders.rope_positions) and offset 0.

- Prefill side (and colocated): the images themselves, the token span each fills, the
  prompt's 3-D MRoPE positions and the offset generated tokens sit at. The vision encoder's
  output is held in `encoded` from the first chunk that needs it until the prompt's last image
  is computed; a recompute after preemption encodes again from the images.
- Decode side: only the spans (from the placeholder runs) and `position_offset` (from the
  landed KV's meta); the images stayed with the prefill worker, so such a sequence cannot be
  recomputed (the engine ends it with an error if it is preempted) and its image blocks are
  never put in the prefix cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from baton.models.audio import AudioInput, AudioPlaceholders, token_runs
from baton.models.multimodal import ImagePlaceholders, MediaInput

POSITION_OFFSET_META = "position_offset"        # the KV piece meta key (the VL contract)


@dataclass(slots=True)
class MultimodalPrompt:
    spans: list[tuple[int, int]]                 # [start, end) of each image's (or clip's) pads in the prompt
    position_offset: int                         # generated token i sits at rotary position i + offset
    images: tuple[MediaInput, ...] = ()   # () where they are not here (decode side)
    positions: np.ndarray | None = None          # [3, num_prompt_tokens] int64 (prefill side)
    encoded: object = None                       # the encoder's output, on the device, while needed

    @classmethod
    def of(cls, token_ids: list[int], images: list[MediaInput],
           placeholders: ImagePlaceholders | AudioPlaceholders | None, model: str) -> MultimodalPrompt | None:
        """A prompt's images (or audio clips) and rotary positions (None: a text prompt); ValueError
        when the placeholders and the media disagree or the model takes no such media."""
        check_kinds(images, placeholders, model)
        if placeholders is None or (not images and placeholders.token_id not in token_ids):
            return None
        return cls.for_prompt(token_ids, images, placeholders)

    @classmethod
    def for_prompt(cls, token_ids: list[int], images: list[MediaInput],
                   placeholders: ImagePlaceholders | AudioPlaceholders) -> MultimodalPrompt:
        """Prefill side: validates pads vs media (ValueError) and computes the positions."""
        spans = placeholders.spans(token_ids, images)
        positions, offset = placeholders.rope_positions(token_ids, spans, images)
        return cls(spans, offset, tuple(images), positions)

    @classmethod
    def remote(cls, token_ids: list[int], pad_token_id: int, position_offset: int) -> MultimodalPrompt | None:
        """Decode side: the pad spans of a prompt whose images (or clips) were encoded elsewhere (None: none)."""
        spans = pad_runs(token_ids, pad_token_id)
        if not spans and not position_offset:
            return None
        return cls(spans, position_offset)

    @property
    def images_available(self) -> bool:
        return bool(self.images) or not self.spans

    @property
    def image_end(self) -> int:
        """The end of the last image's span: past it, the prompt needs no embeddings."""
        return self.spans[-1][1] if self.spans else 0

    def overlapping(self, begin: int, end: int) -> list[int]:
        return [k for k, (s, e) in enumerate(self.spans) if s < end and e > begin]

    def block_key(self, begin: int, end: int, tokens: tuple[int, ...]) -> tuple | None:
        """A prefix-cache key for the block [begin, end): its tokens, plus the digest of every
        image it holds part of (the pads alone are the same for any image of that size).
        None: it holds image tokens of unknown images; never cache it."""
        images = self.overlapping(begin, end)
        if not images:
            return tokens
        if not self.images:
            return None
        return tokens + tuple(self.images[k].digest for k in images)

    def rope_positions(self, begin: int, end: int) -> np.ndarray:
        """[3, end - begin] positions of tokens begin..end-1 (prompt: MRoPE; after it: i + offset)."""
        n = 0 if self.positions is None else self.positions.shape[1]
        head = self.positions[:, begin:min(end, n)] if begin < n else np.zeros((3, 0), np.int64)
        tail = np.arange(max(begin, n), end, dtype=np.int64) + self.position_offset
        return np.concatenate([head, np.broadcast_to(tail, (3, len(tail)))], axis=1)


def check_kinds(images: list[MediaInput], placeholders: ImagePlaceholders | AudioPlaceholders | None,
                model: str) -> None:
    """ValueError unless the model takes every kind of media in `images`."""
    taken = placeholders.kind if placeholders is not None else None
    refused = sorted({media_kind(m) for m in images} - {taken})
    if refused:
        raise ValueError(f"model {model} takes no {'images' if refused[0] == 'image' else 'audio'}; "
                         + ("send text only" if taken is None else f"send text and {taken} parts only"))


def pad_runs(token_ids: list[int], pad: int) -> list[tuple[int, int]]:
    return token_runs(token_ids, pad)


def media_kind(item: MediaInput) -> str:
    return "audio" if isinstance(item, AudioInput) else "image"


@dataclass(slots=True)
class ImageChunk:
    """A prefill chunk that holds image tokens: its sequence, its rows in the step's flat batch
    (from `row`), and the prompt range [begin, end) it covers."""
    seq: object
    row: int
    begin: int
    end: int


def step_positions(items, begins: np.ndarray, ends: np.ndarray, positions: np.ndarray, starts: np.ndarray,
                   is_decode: bool) -> tuple[np.ndarray, np.ndarray | None, list[ImageChunk]]:
    """(1-D rotary positions, [3, T] MRoPE positions or None, the chunks that need image
    embeddings) for a step. Untouched when no sequence has images; a decode step stays 1-D
    (i + offset)."""
    mms = [item.seq.mm for item in items]
    if all(mm is None for mm in mms):
        return positions, None, []
    if is_decode:
        offsets = np.fromiter((0 if mm is None else mm.position_offset for mm in mms), np.int64, len(mms))
        return positions + offsets, None, []
    parts, chunks = [], []
    for i, (item, mm) in enumerate(zip(items, mms, strict=True)):
        b, e = int(begins[i]), int(ends[i])
        if mm is None:
            parts.append(np.broadcast_to(np.arange(b, e, dtype=np.int64), (3, e - b)))
            continue
        parts.append(mm.rope_positions(b, e))
        if mm.overlapping(b, e):
            chunks.append(ImageChunk(item.seq, int(starts[i]), b, e))
    mrope = np.ascontiguousarray(np.concatenate(parts, axis=1))
    return mrope[0].copy(), mrope, chunks
