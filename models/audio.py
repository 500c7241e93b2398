"""Audio in prompts: the request-side pieces every layer shares (torch-free: the router imports it).

- `AudioInput`: one clip as the client sent it (encoded bytes and their format), with a digest that
  keys the prefix cache.
- `decode_audio`: the bytes -> mono float32 samples at the model's rate (soundfile decodes WAV,
  MP3, FLAC and Ogg with the libsndfile its wheels bundle; soxr resamples).
- `AudioPlaceholders`: an audio-language model's placeholder token and its feature extractor's
  window, so the router and the engine agree on how many `<|AUDIO|>` tokens a clip takes.

The count is Qwen2-Audio's processor's: a clip of n samples is ceil(n / hop_length) mel frames,
halved by the encoder's strided convolution and again by its pooling. One clip fills one window of
the feature extractor (30 s for Qwen2-Audio); a longer one is refused, not cut.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
from dataclasses import dataclass, field

import numpy as np

AUDIO_MODEL_TYPES = ("qwen2_audio",)
AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg")
# the checkpoint's preprocessor_config.json (an image processor's or a feature extractor's settings), on its
# config (models/source.py sets it; the name is transformers' for the file's role)
PROCESSOR_ATTR = "image_processor"


@dataclass(frozen=True, slots=True)
class AudioInput:
    """An encoded audio clip exactly as the client sent it."""
    data: bytes
    format: str = ""                    # one of AUDIO_FORMATS, or "": the bytes decide

    def __post_init__(self):
        if not isinstance(self.data, (bytes, bytearray)) or not self.data:
            raise ValueError("an audio clip needs non-empty encoded bytes")
        if self.format not in AUDIO_FORMATS + ("",):
            raise ValueError(f"audio format {self.format!r} is not supported; supported: {', '.join(AUDIO_FORMATS)}")

    @property
    def digest(self) -> str:
        """sha256 hex of the bytes: what the prefix cache keys a clip's blocks by."""
        return hashlib.sha256(self.data).hexdigest()


def decode_base64_audio(data, fmt, index: int = 0) -> AudioInput:
    """OpenAI's `input_audio` ({"data": base64, "format": "wav" | "mp3"}) -> AudioInput."""
    if not isinstance(data, str) or not data:
        raise ValueError(f"audio {index}: input_audio needs the base64-encoded clip in 'data'")
    if not isinstance(fmt, str) or fmt.lower() not in AUDIO_FORMATS:
        raise ValueError(f"audio {index}: input_audio's 'format' must be one of {', '.join(AUDIO_FORMATS)} "
                         f"(got {fmt!r:.20})")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"audio {index}: bad base64 in input_audio's data: {e}") from e
    if not raw:
        raise ValueError(f"audio {index}: input_audio's data holds no bytes")
    return AudioInput(raw, fmt.lower())


def decode_audio(audio: AudioInput, sampling_rate: int, max_seconds: float, index: int = 0) -> np.ndarray:
    """Mono float32 samples at `sampling_rate`; ValueError naming the clip when it cannot be decoded,
    holds no samples or is longer than `max_seconds` (checked before the samples are read)."""
    import soundfile
    try:
        with soundfile.SoundFile(io.BytesIO(audio.data)) as f:
            rate = f.samplerate
            if f.frames > max_seconds * rate + 1:
                raise ValueError(f"it is {f.frames / rate:.1f} s long; this model takes at most {max_seconds:g} s "
                                 "per clip")
            samples = f.read(dtype="float32", always_2d=True)
    except ValueError as e:
        raise ValueError(f"audio {index} is refused: {e}") from e
    except (RuntimeError, TypeError, OSError) as e:        # soundfile.LibsndfileError is a RuntimeError
        raise ValueError(f"audio {index} could not be decoded ({audio.format or 'format unknown'}): {e}") from e
    if not len(samples):
        raise ValueError(f"audio {index} holds no samples")
    mono = samples.mean(axis=1)
    if not np.isfinite(mono).all():
        raise ValueError(f"audio {index} holds samples that are not finite numbers")
    if rate != sampling_rate:
        import soxr
        mono = soxr.resample(mono, rate, sampling_rate).astype(np.float32)
    return np.ascontiguousarray(mono, dtype=np.float32)


def _get(config, name: str, default=None):
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


@dataclass(frozen=True, slots=True)
class AudioPlaceholders:
    """An audio-language model's audio token, its feature extractor's settings (Whisper's log-mel),
    and how many tokens one clip becomes."""
    audio_token_id: int
    num_mel_bins: int = 128
    sampling_rate: int = 16000
    hop_length: int = 160
    n_fft: int = 400
    n_samples: int = 480000                 # one window: the longest clip, the length every clip is padded to
    kind = "audio"
    _lengths: dict = field(default_factory=dict, compare=False, repr=False)   # digest -> samples decoded

    @classmethod
    def from_config(cls, config) -> AudioPlaceholders | None:
        """From a HF config (object or dict) and its preprocessor_config.json where it carries one;
        None for a model that takes no audio. ValueError when the window does not fit the encoder."""
        if _get(config, "model_type") not in AUDIO_MODEL_TYPES:
            return None
        audio = _get(config, "audio_config") or {}
        proc = _get(config, PROCESSOR_ATTR) or {}
        hop = int(proc.get("hop_length") or 160)
        frames = 2 * int(_get(audio, "max_source_positions", 1500))          # the encoder's fixed input length
        rate = int(proc.get("sampling_rate") or 16000)
        n = int(proc.get("n_samples") or (proc.get("chunk_length") or 0) * rate or frames * hop)
        if n // hop != frames:
            raise ValueError(f"the feature extractor's window ({n} samples, hop {hop}) makes {n // hop} mel frames; "
                             f"the audio encoder takes {frames} (2 x max_source_positions)")
        token = _get(config, "audio_token_id", None)
        return cls(audio_token_id=int(token if token is not None else _get(config, "audio_token_index")),
                   num_mel_bins=int(proc.get("feature_size") or _get(audio, "num_mel_bins", 128)),
                   sampling_rate=rate, hop_length=hop, n_fft=int(proc.get("n_fft") or 400), n_samples=n)

    @property
    def token_id(self) -> int:
        return self.audio_token_id

    @property
    def max_seconds(self) -> float:
        return self.n_samples / self.sampling_rate

    def decode(self, audio: AudioInput, index: int = 0) -> np.ndarray:
        return decode_audio(audio, self.sampling_rate, self.max_seconds, index)

    def num_frames(self, num_samples: int) -> int:
        """Mel frames of a clip of `num_samples` (its feature attention mask's sum)."""
        return math.ceil(min(num_samples, self.n_samples) / self.hop_length)

    def num_tokens(self, audio: AudioInput, index: int = 0) -> int:
        """How many audio tokens `audio` takes in the prompt (ValueError: too short to make one)."""
        n = self._length(audio, index)
        frames = self.num_frames(n)
        tokens = ((frames - 1) // 2 + 1 - 2) // 2 + 1
        if tokens < 1:
            raise ValueError(f"audio {index} is {n / self.sampling_rate * 1000:.0f} ms long, too short for one "
                             f"audio token ({4 * self.hop_length / self.sampling_rate * 1000:.0f} ms at least)")
        return tokens

    def expand(self, token_ids: list[int], clips: list[AudioInput]) -> list[int]:
        """Each single audio token becomes num_tokens(clip) of them, clips in order."""
        return expand_pads(token_ids, self.audio_token_id, clips, self.num_tokens, "audio clips")

    def spans(self, token_ids: list[int], clips: list[AudioInput]) -> list[tuple[int, int]]:
        """(start, end) of each clip's run of audio tokens in an *expanded* prompt; ValueError unless
        there is one run per clip, each as long as the clip needs."""
        runs = token_runs(token_ids, self.audio_token_id)
        if len(runs) != len(clips):
            raise ValueError(f"the prompt has {len(runs)} runs of audio placeholders but {len(clips)} audio clips "
                             "were given (expand the prompt's placeholders per clip first)")
        for k, ((s, e), clip) in enumerate(zip(runs, clips, strict=True)):
            if e - s != self.num_tokens(clip, k):
                raise ValueError(f"audio {k} needs {self.num_tokens(clip, k)} placeholder tokens, the prompt has {e - s}")
        return runs

    def rope_positions(self, token_ids: list[int], spans, clips) -> tuple[np.ndarray, int]:
        """Plain 1-D rotary positions (as [3, n], each row the same) and no offset: audio tokens
        count like text."""
        n = len(token_ids)
        return np.ascontiguousarray(np.broadcast_to(np.arange(n, dtype=np.int64), (3, n))), 0

    def _length(self, audio: AudioInput, index: int) -> int:
        n = self._lengths.get(audio.digest)
        if n is None:
            if len(self._lengths) >= 1024:          # a small memo (each clip is counted more than once)
                self._lengths.clear()
            n = self._lengths[audio.digest] = len(self.decode(audio, index))
        return n


def expand_pads(token_ids: list[int], token: int, items: list, num_tokens, what: str) -> list[int]:
    """Each single `token` becomes num_tokens(item, k) of them for the k-th item, in order (images
    and audio clips alike); ValueError when the placeholders and the items differ in number."""
    pads = sum(1 for t in token_ids if t == token)
    if pads != len(items):
        kind = "image" if what == "images" else "audio"
        raise ValueError(f"the prompt has {pads} {kind} placeholders but {len(items)} {what} were given")
    out: list[int] = []
    k = 0
    for t in token_ids:
        if t == token:
            out += [t] * num_tokens(items[k], k)
            k += 1
        else:
            out.append(t)
    return out


def token_runs(token_ids: list[int], token: int) -> list[tuple[int, int]]:
    """[start, end) of each run of `token` in `token_ids`."""
    ids = np.asarray(token_ids)
    hit = np.concatenate([[False], ids == token, [False]])
    edges = np.flatnonzero(hit[1:] != hit[:-1])
    return [(int(s), int(e)) for s, e in zip(edges[::2], edges[1::2], strict=True)]
