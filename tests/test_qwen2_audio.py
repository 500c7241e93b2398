"""Qwen2-Audio: greedy tokens equal transformers' Qwen2AudioForConditionalGeneration (tiny random
config, fp32, fed transformers' own Qwen2AudioProcessor's ids and features) through the offline
API: text only, one clip, two clips (WAV and MP3, one resampled) batched; bad audio refused with the
engine untouched; the decode side's view of an audio sequence.
"""
from __future__ import annotations

import base64
import os

import pytest
from audio_helpers import AUDIO_PAD, hf_audio_greedy, load_hf_audio, save_tiny_audio_checkpoint, sine

from baton import LLM, SamplingParams
from baton.engine.requests.tokenizer import render_chat
from baton.engine.scheduling.block_manager import BlockManager
from baton.engine.scheduling.multimodal import MultimodalPrompt
from baton.engine.scheduling.sequence import Sequence
from baton.models.audio import AudioInput, AudioPlaceholders
from baton.models.multimodal import split_content_parts

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
ONE_SECOND = sine(1.0)                                  # 16 kHz: 100 mel frames, 25 audio tokens
SHORT_MP3 = sine(0.6, hz=300, rate=8000, fmt="MP3")     # 8 kHz, resampled to 16 kHz


def nan_wav() -> bytes:
    """A float WAV of one second with a NaN in it."""
    import io

    import numpy as np
    import soundfile
    x = np.zeros(16000, np.float32)
    x[100] = np.nan
    buf = io.BytesIO()
    soundfile.write(buf, x, 16000, format="WAV", subtype="FLOAT")
    return buf.getvalue()


def clip(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from baton.models.source import resolve_model
    tokenizer_dir = os.environ.get("BATON_TOKENIZER") or resolve_model(None).tokenizer_path
    path = save_tiny_audio_checkpoint(tmp_path_factory.mktemp("audio") / "tiny-qwen2-audio", tokenizer_dir)
    return path, load_hf_audio(path)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt[0]), block_size=16, num_kv_blocks=64, dtype="float32")


def reference(llm: LLM, ckpt, conversation: list[dict]) -> list[int]:
    """transformers' greedy tokens for the conversation; its processor's expanded ids equal ours."""
    messages, clips = split_content_parts(conversation)
    text = llm.tokenizer.decode(render_chat(llm.tokenizer, messages))
    samples = [llm.engine.placeholders.decode(c) for c in clips]
    ids, tokens = hf_audio_greedy(ckpt[1], ckpt[0], text, samples, GREEDY.max_tokens)
    ours = render_chat(llm.tokenizer, messages)
    assert (llm.engine.placeholders.expand(ours, clips) if clips else ours) == ids
    return tokens


def test_text_one_clip_and_two_clips_batched_match_transformers(llm, ckpt):
    chats = [[{"role": "user", "content": "Tell me about the sea."}], user(clip(ONE_SECOND), "What is it?"),
             user("Compare", clip(ONE_SECOND), "with", clip(SHORT_MP3, "mp3"), "please.")]
    got = llm.chat(chats, GREEDY)
    assert [o.token_ids for o in got] == [reference(llm, ckpt, c) for c in chats]
    assert got[1].token_ids != got[0].token_ids


def test_chunked_prefill_splitting_a_clip_and_a_prefix_hit_through_it(ckpt):
    """Chunks of 16 tokens cut the clip's 25 tokens apart; the second run of the same chat (the clip
    as raw bytes this time) hits the prefix cache through the clip (same digest), same tokens."""
    llm = LLM(str(ckpt[0]), block_size=16, num_kv_blocks=32, max_num_batched_tokens=16, dtype="float32")
    chat = user("Listen:", clip(ONE_SECOND), "and answer.")
    want = reference(llm, ckpt, chat)
    first = llm.chat(chat, GREEDY)[0]
    second = llm.chat(user("Listen:", {"type": "audio", "audio": ONE_SECOND, "format": "wav"}, "and answer."),
                      GREEDY)[0]
    assert first.token_ids == want and second.token_ids == want
    assert first.cached_tokens == 0 and second.cached_tokens >= 32


def test_clip_token_counts_follow_the_processor(llm):
    p: AudioPlaceholders = llm.engine.placeholders
    assert p.n_samples == 32000 and p.token_id == AUDIO_PAD
    assert p.num_tokens(AudioInput(ONE_SECOND, "wav")) == 25
    assert p.num_tokens(AudioInput(sine(2.0, channels=2), "wav")) == 50      # stereo: averaged to mono


@pytest.mark.parametrize("part, error", [
    (clip(b"RIFF....WAVEfmt not really a wav"), "audio 0 could not be decoded"),
    (clip(sine(0.0)), "could not be decoded|holds no samples"),
    (clip(sine(0.005)), "too short for one audio token"),
    (clip(sine(2.5)), "2.5 s long; this model takes at most 2 s"),
    (clip(nan_wav()), "holds samples that are not finite numbers"),
    ({"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}}, "bad base64"),
    (clip(ONE_SECOND, "aiff"), "'format' must be one of wav, mp3"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "takes no images"),
])
def test_bad_audio_is_refused_and_changes_nothing(llm, part, error):
    free = llm.engine.block_manager.num_free_blocks
    with pytest.raises(ValueError, match=error):
        llm.chat(user(part, "What is it?"), GREEDY)
    assert not llm.engine.has_unfinished and llm.engine.block_manager.num_free_blocks == free


def test_a_text_only_model_refuses_audio():
    with pytest.raises(ValueError, match="model m takes no audio; send text only"):
        MultimodalPrompt.of([1, 2], [AudioInput(ONE_SECOND, "wav")], None, "m")


def test_decode_side_sequence_never_caches_audio_blocks():
    """Without its clips (decode worker) a sequence's blocks from the first audio token on stay out
    of the prefix cache; its positions are plain (offset 0)."""
    ids = list(range(100, 120)) + [AUDIO_PAD] * 20 + list(range(200, 220))
    seq = Sequence("r", ids, GREEDY, 1024)
    seq.mm = MultimodalPrompt.remote(ids, AUDIO_PAD, 0)
    assert seq.mm.spans == [(20, 40)] and not seq.mm.images_available
    bm = BlockManager(16, 8)
    bm.allocate(seq, len(ids))
    seq.num_computed_tokens = len(ids)
    bm.register_full_blocks(seq)
    assert seq.num_hashed_blocks == 2 and len(bm.cached) == 2
    assert seq.mm.rope_positions(60, 62).tolist() == [[60, 61]] * 3
