"""Busy is not hung (engine/step_clock.py and its readers): a step is judged against its own
expected cost, learnt from the engine's recent steps, and a command waiting behind a long step
waits for it; a step far past its budget, or a silent core, is a hang. The real processes
(a long prompt on `baton serve`, a core held inside a step) are in test_long_prompts.py."""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from baton.engine import step_clock
from baton.engine.async_engine import AsyncEngine
from baton.engine.step_clock import CostModel, Pulse, StepClock

SMOLLM2 = SimpleNamespace(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                          intermediate_size=1536)


def test_cost_model_counts_the_layers_matrices_and_attention_over_the_context():
    cost = CostModel.of(SMOLLM2)
    # q, k, v, o: 576 x 64 x (9 + 9 + 3 + 3); gate, up, down: 3 x 576 x 1536; 30 layers, 2 FLOPs a MAC
    assert cost.per_token == 2 * 30 * (576 * 64 * 24 + 3 * 576 * 1536)
    assert cost.per_pair == 4 * 30 * 9 * 64
    one = cost.step_flops([(1, 0)])
    assert cost.step_flops([(1, 4000)]) > one                      # a decode row's cost grows with its context
    assert cost.step_flops([(4096, 0)]) > 4096 * one              # and a long prompt's faster than linearly
    assert CostModel.of(SimpleNamespace()).per_token == 1.0       # an unknown shape: tokens alone


def _measured(clock: StepClock, flops: float, seconds: float, n: int = 8) -> None:
    clock.recent.extend([(flops, seconds, 1)] * n)


def test_a_step_unlike_any_measured_gets_the_generous_unknown_budget():
    assert StepClock().budget(1e12) == step_clock.UNKNOWN_BUDGET_S


def test_budgets_scale_with_the_step_from_comparable_steps_and_keep_a_floor():
    clock = StepClock()
    _measured(clock, 1e9, 0.02)                                    # decode steps: 20 ms
    assert clock.budget(1e9) == step_clock.FLOOR_S                 # 10 x 20 ms is under the floor
    assert clock.expected(4e9) == pytest.approx(0.08)              # comparable: scaled
    assert clock.expected(1e12) == pytest.approx(20.0)             # far bigger: extrapolated, leaning long
    assert clock.budget(1e12) == pytest.approx(200.0)
    _measured(clock, 1e12, 4.0)                                    # a real long prompt measured since
    assert clock.expected(1e12) == pytest.approx(4.0) and clock.budget(1e12) == pytest.approx(40.0)
    assert clock.expected(1e9) == pytest.approx(0.02)              # decode still judged by decode steps


def test_the_pulse_says_what_the_engine_thread_does_and_when_it_overruns():
    clock = StepClock(CostModel.of(SMOLLM2))
    assert clock.pulse() == Pulse()
    clock.begin_step([(3, 0), (1, 40)], started=time.monotonic() - step_clock.UNKNOWN_BUDGET_S - 2)
    p = clock.pulse()
    assert p.busy == "step" and p.tokens == 4 and p.budget_s == step_clock.UNKNOWN_BUDGET_S
    assert p.overrun_s == pytest.approx(2, abs=0.5)
    clock.end()
    assert not clock.pulse().busy and len(clock.recent) == 1 and clock.pulse().seconds_per_token > 0


class _LongStepEngine:
    """An engine whose one step holds its thread for `step_s` (a long prompt on a CPU)."""

    def __init__(self, step_s: float, budget_s: float):
        self.clock = StepClock()
        self.step_s, self.budget_s = step_s, budget_s
        self.runner = SimpleNamespace(platform=SimpleNamespace(bind_thread=lambda: None))
        self.pending = threading.Event()
        self.pending.set()
        self.stepping = threading.Event()

    @property
    def has_work(self) -> bool:
        return self.pending.is_set()

    def step(self):
        self.clock._busy = step_clock._Busy("step", time.monotonic(), self.budget_s, 7000, 1.0)
        self.stepping.set()
        time.sleep(self.step_s)
        self.clock.end()
        self.pending.clear()
        return []


def _call_during_a_long_step(step_s: float, budget_s: float, timeout: float):
    async def main():
        core = _LongStepEngine(step_s, budget_s)
        engine = AsyncEngine(core, asyncio.get_running_loop())
        assert await asyncio.to_thread(core.stepping.wait, 5)     # the step is running
        t0 = time.monotonic()
        try:
            return await engine.call(lambda e: "done", timeout=timeout), time.monotonic() - t0
        finally:
            engine.shutdown()
    return asyncio.run(main())


def test_a_command_waits_behind_a_long_step_within_its_budget():
    """The false positive: a command's timeout does not run while the engine is in a step that is
    within its budget (an add behind a 7k-token prefill used to fail after 30 s)."""
    result, waited = _call_during_a_long_step(step_s=1.5, budget_s=30.0, timeout=0.3)
    assert result == "done" and waited >= 1.0


def test_a_command_behind_a_step_past_its_budget_times_out():
    with pytest.raises(TimeoutError):
        _call_during_a_long_step(step_s=3.0, budget_s=0.2, timeout=0.3)


def test_one_outlier_step_does_not_inflate_the_budget_of_the_next_ones():
    """A step measured while the process was stopped (SIGSTOP, a swap storm) is one of many: the
    budget follows the comparable steps' 90th percentile, not their maximum."""
    clock = StepClock()
    _measured(clock, 1e9, 0.02, n=40)
    clock.recent.append((1e9, 12.0, 1))
    assert clock.budget(1e9) == step_clock.FLOOR_S


def test_a_core_whose_engine_thread_died_is_dead_not_healthy():
    """A step loop that raised (a device out of memory) leaves a core process that still pulses and
    answers: it says FATAL instead, and the front ends the worker rather than flap healthy/unhealthy."""
    from baton.serving.worker.core_client import CoreClient
    from baton.serving.worker.core_protocol import Fatal
    from baton.serving.worker.worker_config import WorkerConfig

    deaths = []

    async def main():
        client = CoreClient(WorkerConfig(role="decode"), "x:Y", on_updates=print, on_metrics=print, on_death=deaths.append)
        client.info = {"model": "m"}
        client._message(Fatal("failed: its engine thread raised OutOfMemoryError()"))
        return client.dead
    assert asyncio.run(main()) == deaths[0] == "failed: its engine thread raised OutOfMemoryError()"


def test_stopping_does_not_wait_out_a_long_step_and_does_wait_a_short_one():
    """A core stopped after its front's drain: a step that outlasts the wait is left to the process's exit (its
    requests were drained or aborted: a CPU's long prompt chunk took the worker's whole 10 s grace); a short one
    (a GPU's) is waited for, and the thread ends."""
    async def stopped_after(step_s: float, wait_s: float):
        core = _LongStepEngine(step_s, 30.0)
        engine = AsyncEngine(core, asyncio.get_running_loop())
        assert await asyncio.to_thread(core.stepping.wait, 5)
        t0 = time.monotonic()
        ended = engine.shutdown(wait_s)
        return ended, time.monotonic() - t0
    ended, took = asyncio.run(stopped_after(step_s=4.0, wait_s=0.5))
    assert not ended and took < 2.0
    ended, took = asyncio.run(stopped_after(step_s=0.3, wait_s=5.0))
    assert ended and took < 2.0
