"""Qwen2-Audio test helpers: a tiny random checkpoint in the published on-disk format (config.json,
safetensors, preprocessor_config.json, a tokenizer with the audio tokens and a chat template that
renders audio parts), test clips made here (sine waves, written by soundfile), and transformers'
greedy reference fed its own processor's outputs."""
from __future__ import annotations

import inspect
import io
import shutil
from pathlib import Path

import numpy as np
import torch
from helpers import TOKENIZER_FILES

# the embedded SmolLM2 tokenizer has ids 0..49151; the audio tokens are added after them
AUDIO_BOS, AUDIO_PAD, AUDIO_EOS = 49152, 49153, 49154
AUDIO_SPECIAL_TOKENS = ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]
AUDIO_CHAT_TEMPLATE = (           # Qwen2-Audio-Instruct's, without its default system turn
    "{% set audio_count = namespace(value=0) %}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'audio' %}"
    "{% set audio_count.value = audio_count.value + 1 %}"
    "{{ 'Audio ' + audio_count.value|string + ': <|audio_bos|><|AUDIO|><|audio_eos|>\\n' }}"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
WINDOW_SECONDS = 2          # the feature extractor's window: 200 mel frames, max_source_positions 100
TINY_AUDIO_TEXT = dict(model_type="qwen2", vocab_size=49160, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=2048, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                       tie_word_embeddings=False)
TINY_AUDIO_ENCODER = dict(num_mel_bins=16, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
                          d_model=32, max_source_positions=100)


def tiny_audio_config():
    from transformers import Qwen2AudioConfig
    return Qwen2AudioConfig(text_config=dict(TINY_AUDIO_TEXT), audio_config=dict(TINY_AUDIO_ENCODER),
                            audio_token_index=AUDIO_PAD, architectures=["Qwen2AudioForConditionalGeneration"])


def save_tiny_audio_checkpoint(path: Path, tokenizer_dir: str, seed: int = 0) -> Path:
    """A random tiny Qwen2-Audio checkpoint, its feature extractor and the audio-token tokenizer."""
    from transformers import AutoTokenizer, Qwen2AudioForConditionalGeneration, WhisperFeatureExtractor
    torch.manual_seed(seed)
    model = Qwen2AudioForConditionalGeneration(tiny_audio_config()).eval()
    with torch.no_grad():                   # sharper logits than the default init: fewer near-ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    WhisperFeatureExtractor(feature_size=TINY_AUDIO_ENCODER["num_mel_bins"], chunk_length=WINDOW_SECONDS,
                            return_attention_mask=True).save_pretrained(path)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": AUDIO_SPECIAL_TOKENS})
    if tok.convert_tokens_to_ids(AUDIO_SPECIAL_TOKENS) != [AUDIO_BOS, AUDIO_PAD, AUDIO_EOS]:
        raise AssertionError("the audio tokens got other ids")
    tok.chat_template = AUDIO_CHAT_TEMPLATE
    tok.save_pretrained(path)
    for name in TOKENIZER_FILES:             # what the tokenizer's save leaves out (generation_config.json)
        if (Path(tokenizer_dir) / name).exists() and not (path / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, path / name)
    return path


def load_hf_audio(path: Path):
    from transformers import Qwen2AudioForConditionalGeneration
    return Qwen2AudioForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def sine(seconds: float, hz: float = 440.0, rate: int = 16000, fmt: str = "WAV", channels: int = 1) -> bytes:
    """A sine wave (with a second tone, so clips differ in more than length), encoded by soundfile."""
    import soundfile
    t = np.arange(int(seconds * rate)) / rate
    x = 0.4 * np.sin(2 * np.pi * hz * t) + 0.2 * np.sin(2 * np.pi * hz * 2.7 * t)
    if channels > 1:
        x = np.stack([x] * channels, axis=1)
    buf = io.BytesIO()
    soundfile.write(buf, x.astype(np.float32), rate, format=fmt)
    return buf.getvalue()


def hf_audio_greedy(model, path: Path, text: str, samples: list[np.ndarray], max_new_tokens: int
                    ) -> tuple[list[int], list[int]]:
    """(the expanded prompt ids, greedy tokens) of transformers' Qwen2-Audio for a rendered prompt (one
    <|AUDIO|> per clip) and the clips' samples (16 kHz), through its own processor (expansion, log-mel)."""
    from transformers import AutoFeatureExtractor, AutoTokenizer, Qwen2AudioProcessor
    processor = Qwen2AudioProcessor(AutoFeatureExtractor.from_pretrained(path), AutoTokenizer.from_pretrained(path))
    kw = dict(audio=samples) if samples else {}
    inputs = processor(text=[text], return_tensors="pt", **kw)
    accepted = inspect.signature(model.forward).parameters
    cache_name = "cache" if "cache" in accepted else "past_key_values"
    x = inputs["input_ids"]
    extra = {k: inputs[k] for k in ("input_features", "feature_attention_mask") if k in inputs}
    out, past = [], None
    with torch.no_grad():
        for _ in range(max_new_tokens):
            r = model(input_ids=x, use_cache=True, **{cache_name: past}, **extra)
            past, extra = getattr(r, cache_name), {}
            out.append(int(r.logits[0, -1].argmax()))
            x = torch.tensor([[out[-1]]])
    return inputs["input_ids"][0].tolist(), out
