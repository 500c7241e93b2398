"""Qwen3-VL test helpers: a tiny random checkpoint, a tokenizer with image tokens and a chat
template that renders image parts, test images, and transformers' greedy reference."""
from __future__ import annotations

import inspect
import io
import shutil
from pathlib import Path

import torch
from helpers import TOKENIZER_FILES

# the embedded SmolLM2 tokenizer has ids 0..49151; the image tokens are added after them
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 49152, 49153, 49154, 49155
VL_SPECIAL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{% else %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

TINY_VL_TEXT = dict(vocab_size=49160, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                    rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                    rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [6, 5, 5],
                                     "mrope_interleaved": True})
TINY_VL_VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
                      temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
                      deepstack_visual_indexes=[0, 1], hidden_act="gelu_pytorch_tanh")


def tiny_vl_config():
    from transformers import Qwen3VLConfig
    return Qwen3VLConfig(text_config=dict(TINY_VL_TEXT), vision_config=dict(TINY_VL_VISION),
                         image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START,
                         vision_end_token_id=VISION_END, tie_word_embeddings=False,
                         architectures=["Qwen3VLForConditionalGeneration"])


def build_vl_tokenizer(src_dir: str, dst: Path) -> Path:
    """The embedded tokenizer plus <|vision_start|> (49152), <|vision_end|> (49153) and
    <|image_pad|> (49154), with a chat template that renders {"type": "image"} parts."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(src_dir)
    tok.add_special_tokens({"additional_special_tokens": VL_SPECIAL_TOKENS})
    ids = tok.convert_tokens_to_ids(VL_SPECIAL_TOKENS)
    if ids != [VISION_START, VISION_END, IMAGE_PAD]:
        raise AssertionError(f"image tokens got ids {ids}")
    tok.chat_template = VL_CHAT_TEMPLATE
    tok.save_pretrained(dst)
    return dst


def save_tiny_vl_checkpoint(path: Path, tokenizer_dir: str, seed: int = 0) -> Path:
    """A random tiny Qwen3-VL checkpoint (HF names) with the image-token tokenizer; returns
    the path (the transformers model is `load_hf_vl(path)`)."""
    from transformers import Qwen3VLForConditionalGeneration
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(tiny_vl_config()).eval()
    with torch.no_grad():                   # sharper logits than the default init: fewer near-ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    build_vl_tokenizer(tokenizer_dir, path)
    for name in TOKENIZER_FILES:             # what the tokenizer's save leaves out (generation_config.json)
        if (Path(tokenizer_dir) / name).exists() and not (path / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, path / name)
    return path


def load_hf_vl(path: Path, device: str = "cpu"):
    from transformers import Qwen3VLForConditionalGeneration
    return Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).to(device).eval()


def png(width: int, height: int, seed: int) -> bytes:
    """A noise image (every patch different), PNG-encoded."""
    from PIL import Image
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def hf_vl_greedy(model, ids: list[int], pixel_values, grids: list[tuple[int, int, int]], max_new_tokens: int
                 ) -> list[int]:
    """Greedy tokens of transformers' Qwen3-VL for one prompt, fed the processor's outputs
    (pixel_values, image_grid_thw, mm_token_type_ids) directly, with its own KV cache."""
    device = next(model.parameters()).device
    model.model.rope_deltas = None          # (kept between calls by the model: not this prompt's)
    x = torch.tensor([ids], device=device)
    # transformers 5.24 names the cache `cache` and takes mm_token_type_ids; 5.17 (the GPU image's)
    # names it `past_key_values` and finds image tokens by id
    accepted = inspect.signature(model.forward).parameters
    cache_name = "cache" if "cache" in accepted else "past_key_values"
    kw = {}
    if grids:
        kw = dict(pixel_values=torch.as_tensor(pixel_values).to(device),
                  image_grid_thw=torch.tensor(grids, device=device))
        if "mm_token_type_ids" in accepted:
            kw["mm_token_type_ids"] = (x == model.config.image_token_id).int()
    out, past = [], None
    with torch.no_grad():
        for _ in range(max_new_tokens):
            r = model(input_ids=x, use_cache=True, **{cache_name: past}, **kw)
            past, kw = getattr(r, cache_name), {}
            out.append(int(r.logits[0, -1].argmax()))
            x = torch.tensor([[out[-1]]], device=device)
    return out
