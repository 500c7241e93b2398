"""B1's workload: nano-vllm's bench.py, draw for draw, so results line up with its numbers.

nano-vllm seeds Python's `random` with 0 and draws, per sequence, a prompt length in
[100, 1024] then that many token ids in [0, 10000]; then, per sequence, an output length
in [100, 1024]. Sampling is temperature 0.6 with ignore_eos.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

NANO_VLLM_MAX_TOKEN_ID = 10000
NANO_VLLM_TEMPERATURE = 0.6


@dataclass(slots=True)
class OfflineWorkload:
    prompts: list[list[int]]
    output_lens: list[int]
    temperature: float = NANO_VLLM_TEMPERATURE

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    def describe(self) -> dict:
        lens = [len(p) for p in self.prompts]
        return {"num_seqs": len(self.prompts), "prompt_tokens": self.prompt_tokens,
                "requested_output_tokens": self.output_tokens, "prompt_len_range": [min(lens), max(lens)],
                "output_len_range": [min(self.output_lens), max(self.output_lens)],
                "temperature": self.temperature, "ignore_eos": True}


def nano_vllm_workload(num_seqs: int = 256, min_input_len: int = 100, max_input_len: int = 1024,
                       min_output_len: int = 100, max_output_len: int = 1024, seed: int = 0,
                       vocab_size: int | None = None, temperature: float = NANO_VLLM_TEMPERATURE) -> OfflineWorkload:
    if num_seqs < 1:
        raise ValueError(f"--num-seqs must be >= 1, got {num_seqs}")
    if not 1 <= min_input_len <= max_input_len:
        raise ValueError(f"need 1 <= --min-input-len <= --max-input-len, got {min_input_len}, {max_input_len}")
    if not 1 <= min_output_len <= max_output_len:
        raise ValueError(f"need 1 <= --min-output-len <= --max-output-len, got {min_output_len}, {max_output_len}")
    top = NANO_VLLM_MAX_TOKEN_ID if vocab_size is None else min(NANO_VLLM_MAX_TOKEN_ID, vocab_size - 1)
    rng = random.Random(seed)          # the same Mersenne Twister stream as random.seed(seed)
    prompts = [[rng.randint(0, top) for _ in range(rng.randint(min_input_len, max_input_len))]
               for _ in range(num_seqs)]
    output_lens = [rng.randint(min_output_len, max_output_len) for _ in range(num_seqs)]
    return OfflineWorkload(prompts, output_lens, temperature)


def warmup_workload(workload: OfflineWorkload, seed: int) -> OfflineWorkload:
    """One short request with fresh random ids (sharing no prefix with the timed prompts)."""
    rng = random.Random(seed + 1_000_003)
    n = min(len(p) for p in workload.prompts)
    top = max(max(p) for p in workload.prompts)
    return OfflineWorkload([[rng.randint(0, top) for _ in range(n)]], [min(16, min(workload.output_lens))],
                           workload.temperature)
