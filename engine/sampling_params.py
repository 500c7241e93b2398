"""Sampling parameters: the same fields and defaults as `baton.v1.SamplingParams`.

Plain Python (no torch) so the router, scheduler and tests can use it anywhere.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0        # 0 = greedy
    top_p: float = 1.0              # in (0, 1]
    top_k: int = 0                  # 0 = off
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None         # same seed + same request = same tokens
    speculative: bool = True        # may the engine speculate for it (--speculative-method); False: opt out

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError saying what to fix."""
        if not _finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}")
        for s in self.stop:
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop strings must be 1..{MAX_STOP_STRING_CHARS} characters, got {s!r:.40}")
        for t in self.stop_token_ids:
            if t < 0 or (vocab_size is not None and t >= vocab_size):
                raise ValueError(f"stop token id {t} is outside the vocabulary [0, {vocab_size})")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2^64), got {self.seed}")


# generation_config.json field -> SamplingParams field: what `--generation-config auto` applies
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                            "max_new_tokens": "max_tokens"}


def sampling_defaults(generation_config: dict) -> dict:
    """The sampling defaults a model's generation_config.json sets, as SamplingParams fields;
    a request's own values win over them. As in vLLM, the fields it names are applied; an
    explicit `"do_sample": false` means greedy, as it does to transformers' generate()."""
    out = {}
    for key, name in GENERATION_CONFIG_FIELDS.items():
        value = generation_config.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = int(value) if name in ("top_k", "max_tokens") else float(value)
    if generation_config.get("do_sample") is False:
        out = {"temperature": 0.0, **({"max_tokens": out["max_tokens"]} if "max_tokens" in out else {})}
    SamplingParams(**out).validate()       # a broken config fails at start, not per request
    return out


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and x == x and abs(x) != float("inf")
