"""Images in prompts: the request-side pieces every layer shares (torch-free: the router imports it).

- `ImageInput`: one image as the client sent it (encoded bytes), with a digest that keys the prefix cache.
- `ImagePlaceholders`: a vision-language model's placeholder tokens and its resize rule, so the
  router and the engine agree on how many `<|image_pad|>` tokens an image takes in the prompt.
- `split_content_parts`: OpenAI-style chat content parts -> messages a HF chat template renders,
  plus the images (or audio clips: models/audio.py) in order.
- `media_placeholders`: a model's placeholders, whichever kind of media it takes.

The resize rule is Qwen2-VL / Qwen3-VL's `smart_resize`: both sides rounded to a multiple of
patch_size * merge_size, the pixel count kept within [min_pixels, max_pixels], aspect ratio kept.
The checkpoint's preprocessor_config.json, where it has one, sets the pixel limits, patch sizes,
rescale factor and the normalization's mean and std (models/source.py hands it over as
`config.image_processor`); Qwen3-VL's published values are the defaults.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
from dataclasses import dataclass, field

from baton.models.audio import PROCESSOR_ATTR, AudioInput, AudioPlaceholders, decode_base64_audio, expand_pads

# Qwen3-VL's preprocessor_config.json ("size": shortest_edge / longest_edge, in pixels)
QWEN3_VL_MIN_PIXELS = 65536
QWEN3_VL_MAX_PIXELS = 16777216
QWEN3_VL_MEAN = QWEN3_VL_STD = (0.5, 0.5, 0.5)
# Refuse to decode anything larger (a decompression bomb costs memory before any resize)
MAX_DECODED_PIXELS = 64 * 1024 * 1024
MAX_ASPECT_RATIO = 200
VL_MODEL_TYPES = ("qwen3_vl",)


@dataclass(frozen=True, slots=True)
class ImageInput:
    """An encoded image (PNG/JPEG/WebP/GIF bytes) exactly as the client sent it."""
    data: bytes
    mime_type: str = ""

    def __post_init__(self):
        if not isinstance(self.data, (bytes, bytearray)) or not self.data:
            raise ValueError("an image needs non-empty encoded bytes")

    @property
    def digest(self) -> str:
        """sha256 hex of the bytes: what the prefix cache keys an image's blocks by."""
        return hashlib.sha256(self.data).hexdigest()


MediaInput = ImageInput | AudioInput      # what a multimodal prompt carries besides its tokens


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor` with the pixel count in [min, max]."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} is over "
                         f"{MAX_ASPECT_RATIO}")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def open_image(image: ImageInput, index: int = 0):
    """The decoded PIL image (RGB), or ValueError naming the image."""
    from PIL import Image
    try:
        with Image.open(io.BytesIO(image.data)) as im:
            if im.width * im.height > MAX_DECODED_PIXELS:
                raise ValueError(f"{im.width}x{im.height} is over {MAX_DECODED_PIXELS} pixels")
            return im.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"image {index} could not be decoded: {e}") from e


def _get(config, name: str, default=None):
    """An attribute of a transformers config or a key of its dict form."""
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


@dataclass(frozen=True, slots=True)
class ImagePlaceholders:
    """A vision-language model's image tokens and how many pads one image becomes."""
    image_token_id: int
    vision_start_id: int
    vision_end_id: int
    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = QWEN3_VL_MIN_PIXELS
    max_pixels: int = QWEN3_VL_MAX_PIXELS
    image_mean: tuple[float, ...] = QWEN3_VL_MEAN
    image_std: tuple[float, ...] = QWEN3_VL_STD
    rescale_factor: float = 1 / 255
    kind = "image"
    _sizes: dict = field(default_factory=dict, compare=False, repr=False)  # digest -> (h, w) decoded

    @classmethod
    def from_config(cls, config, min_pixels: int | None = None,
                    max_pixels: int | None = None) -> ImagePlaceholders | None:
        """From a HF config (object or dict), with its checkpoint's image processor settings where
        it carries them (`image_processor`: preprocessor_config.json); None for a text-only model."""
        if _get(config, "model_type") not in VL_MODEL_TYPES:
            return None
        vision = _get(config, "vision_config") or {}
        proc = _get(config, PROCESSOR_ATTR) or {}
        size = proc.get("size") or {}
        return cls(image_token_id=int(_get(config, "image_token_id")),
                   vision_start_id=int(_get(config, "vision_start_token_id")),
                   vision_end_id=int(_get(config, "vision_end_token_id")),
                   patch_size=int(proc.get("patch_size") or _get(vision, "patch_size", 16)),
                   merge_size=int(proc.get("merge_size") or _get(vision, "spatial_merge_size", 2)),
                   temporal_patch_size=int(proc.get("temporal_patch_size") or _get(vision, "temporal_patch_size", 2)),
                   min_pixels=int(min_pixels or size.get("shortest_edge") or proc.get("min_pixels")
                                  or QWEN3_VL_MIN_PIXELS),
                   max_pixels=int(max_pixels or size.get("longest_edge") or proc.get("max_pixels")
                                  or QWEN3_VL_MAX_PIXELS),
                   image_mean=tuple(map(float, proc.get("image_mean") or QWEN3_VL_MEAN)),
                   image_std=tuple(map(float, proc.get("image_std") or QWEN3_VL_STD)),
                   rescale_factor=float(proc.get("rescale_factor") or 1 / 255))

    @property
    def token_id(self) -> int:
        return self.image_token_id

    def rope_positions(self, token_ids: list[int], spans: list[tuple[int, int]], images: list[ImageInput]):
        """([3, n] MRoPE positions, offset of the generated tokens) of an expanded prompt."""
        grids = [self.grid_thw(im, k) for k, im in enumerate(images)]
        return mrope_positions(token_ids, spans, grids, self.merge_size)

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        return smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)

    def grid_thw(self, image: ImageInput, index: int = 0) -> tuple[int, int, int]:
        """(t, h, w) in patches of the resized image, as the vision encoder sees it."""
        h, w = self._decoded_size(image, index)
        try:
            rh, rw = self.resized_size(h, w)
        except ValueError as e:
            raise ValueError(f"image {index} could not be decoded: {e}") from e
        return 1, rh // self.patch_size, rw // self.patch_size

    def num_tokens(self, image: ImageInput, index: int = 0) -> int:
        """How many image-pad tokens `image` takes in the prompt."""
        t, h, w = self.grid_thw(image, index)
        return t * h * w // (self.merge_size ** 2)

    def expand(self, token_ids: list[int], images: list[ImageInput]) -> list[int]:
        """Each single image pad becomes num_tokens(image) pads, images in order."""
        return expand_pads(token_ids, self.image_token_id, images, self.num_tokens, "images")

    def spans(self, token_ids: list[int], images: list[ImageInput]) -> list[tuple[int, int]]:
        """(start, end) of each image's run of pads in an *expanded* prompt; ValueError unless
        there is exactly one run per image, each as long as the image needs."""
        runs: list[tuple[int, int]] = []
        i, n = 0, len(token_ids)
        while i < n:
            if token_ids[i] == self.image_token_id:
                j = i
                while j < n and token_ids[j] == self.image_token_id:
                    j += 1
                runs.append((i, j))
                i = j
            else:
                i += 1
        if len(runs) != len(images):
            raise ValueError(f"the prompt has {len(runs)} runs of image placeholders but {len(images)} "
                             "images were given (expand the prompt's placeholders per image first)")
        for k, ((s, e), image) in enumerate(zip(runs, images, strict=True)):
            if e - s != self.num_tokens(image, k):
                raise ValueError(f"image {k} needs {self.num_tokens(image, k)} placeholder tokens, "
                                 f"the prompt has {e - s}")
        return runs

    def _decoded_size(self, image: ImageInput, index: int) -> tuple[int, int]:
        size = self._sizes.get(image.digest)
        if size is None:
            im = open_image(image, index)
            if len(self._sizes) >= 1024:          # a small memo (each image is sized more than once)
                self._sizes.clear()
            size = self._sizes[image.digest] = (im.height, im.width)
        return size


def media_placeholders(config) -> ImagePlaceholders | AudioPlaceholders | None:
    """The placeholders of a model that takes images or audio (a HF config, object or dict); None: text only."""
    return ImagePlaceholders.from_config(config) or AudioPlaceholders.from_config(config)


# ---- OpenAI-style chat content parts ----

def split_content_parts(messages: list[dict]) -> tuple[list[dict], list[MediaInput]]:
    """OpenAI-style messages (content: str, or a list of text / image_url / image / input_audio /
    audio parts) -> (messages for the chat template, images and audio clips in order). A message
    without media gets its text parts joined into one string, so text-only templates render it too."""
    out, images = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"chat message {i} is not an object")
        content = m.get("content")
        if content is None or isinstance(content, str):
            out.append(dict(m))
            continue
        if not isinstance(content, list):
            raise ValueError(f"chat message {i}: content must be a string or a list of parts")
        parts = [_template_part(p, i, images) for p in content]
        if any(p["type"] != "text" for p in parts):
            out.append({**m, "content": parts})
        else:
            out.append({**m, "content": "\n".join(p["text"] for p in parts)})
    return out, images


def _template_part(part, msg: int, images: list[MediaInput]) -> dict:
    if not isinstance(part, dict):
        raise ValueError(f"chat message {msg}: each content part must be an object")
    kind = part.get("type")
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"chat message {msg}: a text part needs a string 'text'")
        return {"type": "text", "text": text}
    if kind == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        images.append(decode_data_url(url, len(images)))
        return {"type": "image"}
    if kind == "image":
        data = part.get("image")
        if not isinstance(data, (bytes, bytearray)) or not data:
            raise ValueError(f"chat message {msg}: an image part needs the encoded bytes in 'image'")
        images.append(ImageInput(bytes(data)))
        return {"type": "image"}
    if kind == "input_audio":
        clip = part.get("input_audio")
        if not isinstance(clip, dict):
            raise ValueError(f"chat message {msg}: an input_audio part needs {{'data': base64, 'format': 'wav'}}")
        images.append(decode_base64_audio(clip.get("data"), clip.get("format"), _clips(images)))
        return {"type": "audio"}
    if kind == "audio":
        data = part.get("audio")
        if not isinstance(data, (bytes, bytearray)) or not data:
            raise ValueError(f"chat message {msg}: an audio part needs the encoded bytes in 'audio'")
        images.append(AudioInput(bytes(data), part.get("format") or ""))
        return {"type": "audio"}
    raise ValueError(f"chat message {msg}: unknown content part type {kind!r} "
                     "(supported: text, image_url, image, input_audio, audio)")


def _clips(media: list) -> int:
    return sum(isinstance(m, AudioInput) for m in media)


def decode_data_url(url, index: int = 0) -> ImageInput:
    """A `data:image/...;base64,...` URL -> ImageInput. Other URLs are refused: the server
    fetches nothing from the network."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"image {index}: image_url needs a 'url' string")
    if not url.startswith("data:"):
        raise ValueError(f"image {index}: only data: URLs (base64) are accepted; this server does not "
                         f"fetch images from the network (got {url[:40]!r})")
    header, sep, payload = url[5:].partition(",")
    if not sep or not header.endswith(";base64"):
        raise ValueError(f"image {index}: the data URL must be base64 (data:image/png;base64,...)")
    mime = header[:-len(";base64")]
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"image {index}: bad base64 in the data URL: {e}") from e
    if not data:
        raise ValueError(f"image {index}: the data URL holds no bytes")
    return ImageInput(data, mime)


# ---- Qwen3-VL's 3-D (t, h, w) rotary positions ----

def mrope_positions(token_ids: list[int], spans: list[tuple[int, int]], grids: list[tuple[int, int, int]],
                    merge_size: int):
    """(positions [3, len(token_ids)] int64 numpy, delta) as Qwen3-VL's get_rope_index: text
    tokens count on from the previous position on all three axes; an image's tokens take
    (start + t, start + row, start + col) on its merged grid, and the text after it resumes at
    start + max(rows, cols). Token i >= len(token_ids) (generated) sits at i + delta."""
    import numpy as np
    n = len(token_ids)
    pos = np.empty((3, n), np.int64)
    cur, prev_end = 0, 0
    for (s, e), (t, h, w) in zip(spans, grids, strict=True):
        pos[:, prev_end:s] = np.arange(s - prev_end) + cur
        cur += s - prev_end
        gh, gw = h // merge_size, w // merge_size
        if t * gh * gw != e - s:
            raise ValueError(f"image span of {e - s} tokens does not match its grid {t}x{gh}x{gw}")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        pos[:, s:e] = np.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)]) + cur
        cur += max(gh, gw)
        prev_end = e
    pos[:, prev_end:] = np.arange(n - prev_end) + cur
    delta = int(pos.max()) + 1 - n if n else 0
    return pos, delta
