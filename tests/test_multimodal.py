"""models/multimodal.py: image placeholders, the resize rule and OpenAI content parts (no torch)."""
from __future__ import annotations

import base64
import io

import pytest

from baton.models.multimodal import ImageInput, ImagePlaceholders, smart_resize, split_content_parts

CONFIG = {"model_type": "qwen3_vl", "image_token_id": 7, "vision_start_token_id": 5, "vision_end_token_id": 6,
          "vision_config": {"patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2}}


def png(w: int, h: int, color=(200, 30, 30)) -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, format="PNG")
    return buf.getvalue()


def test_smart_resize_matches_the_rule():
    assert smart_resize(256, 256, 32, 65536, 16777216) == (256, 256)
    assert smart_resize(100, 50, 32, 65536, 16777216) == (384, 192)          # scaled up to min_pixels
    h, w = smart_resize(8000, 4000, 32, 65536, 1 << 20)                       # scaled down to max_pixels
    assert h % 32 == 0 and w % 32 == 0 and h * w <= 1 << 20
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 3000, 32, 65536, 16777216)


def test_placeholders_count_and_expand():
    ph = ImagePlaceholders.from_config(CONFIG, min_pixels=32 * 32)
    assert (ph.image_token_id, ph.vision_start_id, ph.vision_end_id) == (7, 5, 6)
    a, b = ImageInput(png(64, 64)), ImageInput(png(96, 32))
    assert ph.grid_thw(a) == (1, 4, 4) and ph.num_tokens(a) == 4
    assert ph.grid_thw(b) == (1, 2, 6) and ph.num_tokens(b) == 3
    ids = ph.expand([1, 5, 7, 6, 2, 5, 7, 6], [a, b])
    assert ids == [1, 5, 7, 7, 7, 7, 6, 2, 5, 7, 7, 7, 6]
    assert ph.spans(ids, [a, b]) == [(2, 6), (9, 12)]
    with pytest.raises(ValueError, match="2 image placeholders but 1 images"):
        ph.expand([7, 7], [a])
    with pytest.raises(ValueError, match="needs 3 placeholder tokens"):
        ph.spans([7, 7, 7, 7, 1, 7], [a, b])
    with pytest.raises(ValueError, match="image 1 could not be decoded"):
        ph.expand([7, 7], [a, ImageInput(b"not an image")])
    assert ImagePlaceholders.from_config({"model_type": "llama"}) is None
    assert a.digest != b.digest and len(a.digest) == 64


def test_split_content_parts():
    data = png(8, 8)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    msgs, images = split_content_parts([
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": "what?"}, {"type": "image", "image": b"xy"},
                                     {"type": "image_url", "image_url": url}]}])
    assert msgs[0] == {"role": "system", "content": "be brief"}
    assert msgs[1] == {"role": "user", "content": "a\nb"}
    assert msgs[2]["content"] == [{"type": "image"}, {"type": "text", "text": "what?"}, {"type": "image"},
                                  {"type": "image"}]
    assert [i.data for i in images] == [data, b"xy", data] and images[0].mime_type == "image/png"
    for bad, match in [({"type": "image_url", "image_url": {"url": "https://x/y.png"}}, "network"),
                       ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}, "base64"),
                       ({"type": "audio"}, "an audio part needs the encoded bytes"),
                       ({"type": "video"}, "unknown content part type")]:
        with pytest.raises(ValueError, match=match):
            split_content_parts([{"role": "user", "content": [bad]}])


def test_the_module_stays_torch_free():
    """The router imports it: no torch (nor PIL until an image is opened)."""
    import subprocess
    import sys
    code = "import sys, baton.models.multimodal; print('torch' in sys.modules, 'PIL' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_image_parts_through_a_text_only_chat_template_are_a_clear_error():
    """The random-weight presets (tiny-qwen3-vl too) carry SmolLM2's tokenizer, whose template
    cannot render image parts: a ValueError saying what is needed, not jinja's TypeError."""
    from baton.engine.requests.tokenizer import load_tokenizer, render_chat
    from baton.models.source import resolve_model
    tokenizer = load_tokenizer(resolve_model(None))
    with pytest.raises(ValueError, match="cannot render image or audio parts.*own tokenizer files"):
        render_chat(tokenizer, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}])
    assert render_chat(tokenizer, [{"role": "user", "content": "what?"}])        # text renders as before
