"""Sampling parameters: the same fields and defaults as `baton.v1.SamplingParams`, and `n` (the
offline API's samples per prompt; served requests take the OpenAI API's `n` at the router).

Plain Python (no torch) so the router, scheduler and tests can use it anywhere.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from baton.engine.requests.structured_output import StructuredOutput

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGPROBS = 20                   # top alternatives per token, as vLLM's default --max-logprobs
MAX_LOGIT_BIAS = 300                # entries of logit_bias (OpenAI's limit)
MAX_N = 128                         # samples of one prompt (offline `n`, the OpenAI API's `n`)
_SEED_MIX = 0x9E3779B97F4A7C15


def sample_seed(seed: int, j: int) -> int:
    """The seed of sample `j` of a prompt sent with `seed`: sample 0 keeps it, the others get one of
    their own derived from it, so the samples differ yet each is reproducible."""
    return (seed + j * _SEED_MIX) % 2**64


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
    # penalties and masks (engine/logits_processing.py), applied to the logits in this order before
    # temperature: logit_bias, min_tokens, repetition, frequency and presence penalties; then min_p
    presence_penalty: float = 0.0   # in [-2, 2]: subtracted once from each token the output holds
    frequency_penalty: float = 0.0  # in [-2, 2]: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # > 0, 1 = off: logits of tokens in prompt or output / (or *) it
    min_p: float = 0.0              # in [0, 1]: drop tokens under min_p x the top token's probability
    min_tokens: int = 0             # eos and stop_token_ids cannot end the output before this many tokens
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> added to its logit, [-100, 100]
    # a resumed (migrated) request: the prompt's last N tokens are its earlier output, counted as
    # output by the penalties (max_tokens and min_tokens count past the prompt: the router lowers them)
    prior_output_tokens: int = 0
    # log-probabilities (engine/logprobs.py): of each sampled token, with its N most likely
    # alternatives; of each prompt token after the first (for `echo`). None: none
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # scheduling (engine/scheduling_policy.py, --scheduling-policy priority): lower runs first, as
    # vLLM's; ties in arrival order. Anything but 0 is refused where the policy is fcfs
    priority: int = 0
    # structured output (engine/structured_output.py): a JSON schema, regex, choice or grammar the
    # output must match; e.g. SamplingParams(structured=StructuredOutput.json(schema))
    structured: StructuredOutput | None = None
    # the offline API's samples per prompt (LLM.generate / chat: CompletionOutput.outputs), as vLLM's
    # `n`; served requests ask for several with the OpenAI API's `n` (the router runs one request each)
    n: int = 1

    def __post_init__(self):
        # as vLLM's SamplingParams takes them: one stop string alone, and None for "none"
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.logit_bias is None:
            self.logit_bias = {}

    @property
    def processes_logits(self) -> bool:
        """Whether its logits need more than temperature / top-k / top-p (logits_processing.py)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.min_p or self.min_tokens or self.logit_bias)

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
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
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
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}] (samples per prompt), got {self.n!r}")
        self._validate_processing(vocab_size)

    def _validate_processing(self, vocab_size: int | None) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _finite(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty}")
        if not _finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        for t, bias in self.logit_bias.items():
            if not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
                raise ValueError(f"logit_bias: token id {t} is outside the vocabulary [0, {vocab_size})")
            if not _finite(bias) or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias: the bias of token {t} must be in [-100, 100], got {bias}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and (not isinstance(n, int) or not 0 <= n <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}] (the number of alternatives), got {n}")
        if self.prior_output_tokens < 0:
            raise ValueError(f"prior_output_tokens must be >= 0, got {self.prior_output_tokens}")
        if not isinstance(self.priority, int) or not -2**31 <= self.priority < 2**31:
            raise ValueError(f"priority must be a 32-bit integer (lower runs first), got {self.priority!r}")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise ValueError(f"structured must be a StructuredOutput, got {type(self.structured).__name__}")
            self.structured.validate()


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
