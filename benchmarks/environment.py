"""The benchmarks' own variables, each named once and read through baton/environment.py (the one
module that touches the environment): the synthetic core's step interval, the stack dumps of a
stuck KV benchmark, and the tokenizer a script without a --tokenizer flag uses."""
from __future__ import annotations

from baton import environment

SYNTHETIC_STEP_MS = "BATON_SYNTHETIC_STEP_MS"    # the synthetic core's milliseconds per step
SYNTHETIC_STEP_MS_DEFAULT = 5.0
STACKS_S = "BATON_BENCH_STACKS_S"                # N: a KV benchmark's processes print their stacks every N s
TOKENIZER = environment.twin("--tokenizer")      # the services' --tokenizer variable, for the same directory


def synthetic_step_ms() -> float:
    raw = environment.get(SYNTHETIC_STEP_MS)
    return SYNTHETIC_STEP_MS_DEFAULT if raw is None else float(raw)


def stacks_after_s() -> float:
    """0: never."""
    return float(environment.get(STACKS_S) or 0)


def tokenizer() -> str | None:
    return environment.get(TOKENIZER)
