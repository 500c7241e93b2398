"""What the engine thread is doing right now, and how long that should take: the hang
detector's evidence that a busy core is busy, not hung.

The engine marks each step (with its FLOPs, counted from the model's shape and the step's
tokens and contexts) and each command between steps; any thread may read `pulse()` while it
runs. A step's budget is its expected time, from the engine's own recent steps of comparable
size, times a generous factor, with a floor: a 7k-token prompt on a CPU gets minutes, a decode
step seconds. Torch-free.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass

WINDOW = 128                 # recent steps the expected cost is taken from
FACTOR = 10.0                # a step may take this many times its expected cost...
FLOOR_S = 5.0                # ...and never less than this (a loaded 2-core box, a GC pause)
UNKNOWN_BUDGET_S = 300.0     # a step unlike any measured yet (the first ones; kernels may compile)
COMMAND_BUDGET_S = 60.0      # a command between steps (admit, abort, a grammar's compile, landed KV)
COMPARABLE = 8.0             # steps within this factor of FLOPs predict each other
QUANTILE = 0.9               # ...by the 90th percentile of their scaled times


@dataclass(frozen=True, slots=True)
class Pulse:
    """The engine thread's activity as of now: `busy` is "" (idle), "step" or "command"."""
    busy: str = ""
    busy_s: float = 0.0          # seconds in it so far
    budget_s: float = 0.0        # what it may take before it counts as stuck
    tokens: int = 0              # a step's tokens
    seconds_per_token: float = 0.0   # recent steps' time per token (what routing weighs queued work by)

    @property
    def overrun_s(self) -> float:
        """Seconds past its budget (0 while within it or idle)."""
        return max(0.0, self.busy_s - self.budget_s) if self.busy else 0.0


@dataclass(frozen=True, slots=True)
class _Busy:
    what: str
    started: float
    budget_s: float
    tokens: int = 0
    flops: float = 0.0


@dataclass(frozen=True, slots=True)
class CostModel:
    """FLOPs of a step by the model's shape: per token in the layers' matrices, and per (query
    token, context token) pair in attention. Relative work is what matters: the clock calibrates
    seconds per FLOP against measured steps."""
    per_token: float = 1.0
    per_pair: float = 0.0

    @classmethod
    def of(cls, hf_config) -> CostModel:
        hf = getattr(hf_config, "text_config", None) or hf_config
        try:
            hidden, layers = hf.hidden_size, hf.num_hidden_layers
            heads = hf.num_attention_heads
            kv_heads = getattr(hf, "num_key_value_heads", None) or heads
            head_dim = getattr(hf, "head_dim", None) or hidden // heads
            experts = getattr(hf, "num_experts_per_tok", None)
            inter = (getattr(hf, "moe_intermediate_size", None) if experts else None) or hf.intermediate_size
        except (AttributeError, TypeError):
            return cls()                 # an unknown shape: tokens alone
        attn = hidden * head_dim * (2 * heads + 2 * kv_heads)
        mlp = 3 * hidden * inter * (experts or 1)
        return cls(per_token=2.0 * layers * (attn + mlp), per_pair=4.0 * layers * heads * head_dim)

    def step_flops(self, rows: list[tuple[int, int]]) -> float:
        """rows: (new tokens, tokens already in the context) of each sequence in the step."""
        return sum(new * self.per_token + new * (context + (new + 1) / 2) * self.per_pair for new, context in rows)


class StepClock:
    def __init__(self, cost: CostModel | None = None):
        self.cost = cost or CostModel()
        self.recent: collections.deque[tuple[float, float, int]] = collections.deque(maxlen=WINDOW)
        self._busy: _Busy | None = None          # replaced whole (readers on other threads see one record)

    # -- the engine thread -------------------------------------------------------------------
    def begin_step(self, rows: list[tuple[int, int]], started: float | None = None) -> None:
        """rows: (new tokens, tokens already in the context) of each sequence the step runs;
        `started`: when the step began, if before its rows were known (time.monotonic())."""
        flops = self.cost.step_flops(rows)
        self._busy = _Busy("step", time.monotonic() if started is None else started, self.budget(flops),
                           sum(n for n, _ in rows), flops)

    def begin_command(self) -> None:
        self._busy = _Busy("command", time.monotonic(), COMMAND_BUDGET_S)

    def end(self) -> None:
        busy, self._busy = self._busy, None
        if busy is not None and busy.what == "step" and busy.flops > 0:
            self.recent.append((busy.flops, time.monotonic() - busy.started, busy.tokens))

    # -- what it predicts --------------------------------------------------------------------
    def expected(self, flops: float) -> float | None:
        """Seconds a step of `flops` should take, from the recent steps nearest it in size;
        None before any step was measured. Leans long wherever it must extrapolate."""
        if not self.recent:
            return None
        near = sorted(s * flops / f for f, s, _ in self.recent if f / COMPARABLE <= flops <= f * COMPARABLE)
        if near:                        # a high quantile: one stopped or preempted step must not set the bar
            return near[int(QUANTILE * (len(near) - 1))]
        smaller = [(f, s) for f, s, _ in self.recent if f < flops]
        if smaller:                     # small steps carry overheads: their rate overstates a big one's time
            f, s = max(smaller)
            return s * flops / f
        return min(s for f, s, _ in self.recent if f > flops)     # only bigger ones: not scaled down

    def budget(self, flops: float) -> float:
        expected = self.expected(flops)
        return UNKNOWN_BUDGET_S if expected is None else max(FLOOR_S, FACTOR * expected)

    def seconds_per_token(self) -> float:
        steps = list(self.recent)
        tokens = sum(t for _, _, t in steps)
        return sum(s for _, s, _ in steps) / tokens if tokens else 0.0

    # -- any thread --------------------------------------------------------------------------
    def pulse(self) -> Pulse:
        busy = self._busy
        per_token = self.seconds_per_token()
        if busy is None:
            return Pulse(seconds_per_token=per_token)
        return Pulse(busy.what, time.monotonic() - busy.started, busy.budget_s, busy.tokens, per_token)
