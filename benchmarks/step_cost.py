"""A step's time on one device, fitted to a profile (benchmarks/device_profile.py): linear in
what the step does, with one intercept for steps that carry prompt tokens and one for pure
decode steps (graph replay), so the planner can price any step its simulation schedules:

  seconds = prefill_step | decode_step + tokens x per_token + sampled x per_sampled_row
            + causal attention pairs of prompt chunks x per_pair + KV tokens decode rows read x per_kv

Fitted by least squares on relative error with every coefficient >= 0. A tensor-parallel
worker's steps take 1 / tp_speedup of one device's (an assumption: one device cannot measure
it; the planner records the factor it used).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from baton.benchmarks.roofline import StepShape

FEATURES = ("prefill_step", "decode_step", "per_token", "per_sampled_row", "per_attention_pair", "per_kv_token")


def features(shape: StepShape) -> list[float]:
    """One step's feature vector (what the coefficients multiply)."""
    decode = shape.is_decode
    pairs = sum(n * ctx + n * (n + 1) / 2 for ctx, n in shape.contexts if n > 1)
    kv = sum(ctx for ctx, n in shape.contexts if n == 1)
    return [0.0 if decode else 1.0, 1.0 if decode else 0.0, float(shape.tokens), float(shape.sampled), pairs, kv]


@dataclass(frozen=True, slots=True)
class StepCost:
    coef: tuple[float, ...]            # in FEATURES order, seconds per unit
    tp_speedup: float = 1.0

    def seconds(self, shape: StepShape) -> float:
        return sum(c * f for c, f in zip(self.coef, features(shape), strict=True)) / self.tp_speedup

    def step(self, decode_rows: int, kv_tokens: float, chunks: list[tuple[int, int]], sampled: int) -> float:
        """A step from aggregates (the simulation's fast path): `decode_rows` rows reading
        `kv_tokens` context tokens in all, prompt chunks (context before, new tokens)."""
        a_p, a_d, tok, row, pair, kv = self.coef
        new = sum(n for _, n in chunks)
        pairs = sum(n * ctx + n * (n + 1) / 2 for ctx, n in chunks)
        intercept = a_p if chunks else a_d
        return (intercept + tok * (new + decode_rows) + row * sampled + pair * pairs + kv * kv_tokens) / self.tp_speedup

    def with_tp(self, tp: int, speedup: float) -> StepCost:
        """This device's cost on a worker of `tp` devices (speedup at tp 2; 1 at tp 1)."""
        return self if tp <= 1 else StepCost(self.coef, self.tp_speedup * speedup ** (tp // 2))

    def to_json(self) -> dict:
        return dict(zip(FEATURES, self.coef, strict=True)) | {"tp_speedup": self.tp_speedup}

    @classmethod
    def from_json(cls, d: dict) -> StepCost:
        return cls(tuple(float(d[k]) for k in FEATURES), float(d.get("tp_speedup", 1.0)))

    @classmethod
    def fit(cls, rows: list[tuple[list[float], float]]) -> StepCost:
        """Coefficients from measurements: each the summed features of the steps it timed and
        their seconds."""
        if len(rows) < len(FEATURES):
            raise ValueError(f"a fit needs at least {len(FEATURES)} measurements, got {len(rows)}")
        x = np.array([f for f, _ in rows], dtype=float)
        y = np.array([s for _, s in rows], dtype=float)
        if (y <= 0).any():
            raise ValueError("every measurement must have taken some time (seconds > 0)")
        w = 1.0 / y                               # relative error: small steps count as much as big ones
        return cls(tuple(float(c) for c in _nonnegative_lstsq(x * w[:, None], y * w)))

    def relative_errors(self, rows: list[tuple[list[float], float]]) -> list[float]:
        """|predicted / measured - 1| of each measurement (how well the line fits)."""
        return [abs(sum(c * f for c, f in zip(self.coef, feats, strict=True)) / self.tp_speedup / s - 1)
                for feats, s in rows]


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: drop the most negative one and refit until none
    is (few features, so this simple active set suffices)."""
    active = list(range(a.shape[1]))
    out = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            out[active] = sol
            return out
        active.pop(int(np.argmin(sol)))
    return out
