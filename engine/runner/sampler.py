"""Token sampling on the device: greedy, temperature, top-k, top-p, per-request seeds.

Seeded rows draw their noise from a counter-based hash of (seed, position, token id), so a
request's tokens depend only on its own seed and history, never on its batch neighbours.
Unseeded rows use the device's ordinary generator.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from baton.engine.runner.logits_processing import apply_token_bitmask

_M64 = (1 << 64) - 1


def _i64(x: int) -> int:
    """An unsigned 64-bit constant as the signed int64 torch stores."""
    x &= _M64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2, _POS = (_i64(0x9E3779B97F4A7C15), _i64(0xBF58476D1CE4E5B9),
                               _i64(0x94D049BB133111EB), _i64(0xD6E8FEB86659FD93))


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def hashed_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, vocab] uniforms in (0, 1) from splitmix64 of (seed, position, token id): the top 23 bits
    n, as (n + 0.5) / 2^23, exact in float32, so never 0 or 1. (With 24 bits, n = 2^24 - 1 rounded
    to u = 1.0: noise -log(u) = 0, and the token won the draw whatever its probability; under a
    structured-output mask, 0 / 0, a disallowed token won.)"""
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    x = seeds[:, None] * _GOLDEN + positions[:, None] * _POS + ids[None, :]
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    x = x ^ _shr(x, 31)
    return (_shr(x, 41).float() + 0.5) * (1.0 / (1 << 23))


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling settings, as device tensors, for N rows of logits."""
    temperatures: torch.Tensor   # [N] float32; 0 = greedy
    top_ks: torch.Tensor         # [N] int64; 0 = off
    top_ps: torch.Tensor         # [N] float32
    seeds: torch.Tensor          # [N] int64 (only meaningful where has_seed)
    has_seed: torch.Tensor       # [N] bool
    positions: torch.Tensor      # [N] int64: index of the token being sampled
    all_greedy: bool
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_seed: bool


class Sampler:
    """`fused(logits, temperatures, seeds, has_seed, positions, step_seed)`: a platform's one-pass
    kernel for batches without top-k/top-p (the same draws; see triton_kernels/sampling.py)."""

    def __init__(self, fused=None, per_row: bool = False):
        self.fused = fused
        # deterministic mode: a row takes the fused or the plain path by its own settings, not by
        # whether some other row of the batch has top-k/top-p (the two round differently)
        self.per_row = per_row
        self._steps = random.Random(0x5EED)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch, bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """`bitmask`: structured output's allowed tokens ([N, words] int32, engine/runner/logits_processing.py's
        apply_token_bitmask); the fused kernel reads it in its one pass, other paths mask a copy first."""
        fused = self.fused is not None and not (batch.all_greedy or batch.any_top_k or batch.any_top_p)
        if bitmask is not None and not fused:
            logits, bitmask = apply_token_bitmask(logits, bitmask), None
        if batch.all_greedy:
            return logits.argmax(dim=-1)
        if fused:
            return self._fused(logits, batch, bitmask)
        sampled = self._plain(logits, batch)
        if self.per_row and self.fused is not None:
            filtered = (batch.top_ks > 0) | (batch.top_ps < 1)
            return torch.where(filtered, sampled, self._fused(logits, batch))
        return sampled

    def _fused(self, logits: torch.Tensor, batch: SamplingBatch, bitmask: torch.Tensor | None = None) -> torch.Tensor:
        args = (logits, batch.temperatures, batch.seeds, batch.has_seed, batch.positions, self._steps.getrandbits(31))
        return self.fused(*args) if bitmask is None else self.fused(*args, bitmask)

    def _plain(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        logits = logits.float()
        greedy = logits.argmax(dim=-1) if batch.any_greedy else None
        temps = torch.where(batch.temperatures > 0, batch.temperatures, torch.ones_like(batch.temperatures))
        logits = logits / temps[:, None]
        if batch.any_top_k or batch.any_top_p:
            logits = _apply_top_k_top_p(logits, batch)
        probs = torch.softmax(logits, dim=-1)
        # Exp(1) noise as -log(U): torch's own exponential_() is ~6x slower on the CPU (64 ms for 64 rows
        # of a 49k vocabulary, most of a tiny model's step: the offline API sampled 7x slower than greedy)
        noise = torch.rand_like(probs).log_().neg_()
        if batch.any_seed:
            seeded = -torch.log(hashed_uniform(batch.seeds, batch.positions, probs.shape[-1]))
            noise = torch.where(batch.has_seed[:, None], seeded, noise)
        sampled = (probs / noise).argmax(dim=-1)      # exponential race == multinomial draw
        return sampled if greedy is None else torch.where(batch.temperatures > 0, sampled, greedy)


def probabilities(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor,
                  top_ps: torch.Tensor) -> torch.Tensor:
    """[N, vocab] float32: the distribution a row with temperature > 0 draws from (the plain path's),
    what speculative decoding's rejection sampler compares a draft's with (engine/runner/draft_head.py)."""
    logits = logits.float() / torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))[:, None]
    any_top_p = bool((top_ps < 1).any())
    if any_top_p or bool((top_ks > 0).any()):
        logits = _top_k_top_p(logits, top_ks, top_ps, any_top_p)
    return torch.softmax(logits, dim=-1)


def _apply_top_k_top_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    return _top_k_top_p(logits, batch.top_ks, batch.top_ps, batch.any_top_p)


def _top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, any_top_p: bool) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_ks > 0, top_ks, torch.full_like(top_ks, vocab))
    drop = ranks >= k[:, None]
    if any_top_p:
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        before = probs.cumsum(dim=-1) - probs          # mass strictly above this token
        # always keeps the top token; rows without top-p keep all (a cumsum can reach 1.0 early)
        drop |= (before >= top_ps[:, None]) & (top_ps < 1)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
