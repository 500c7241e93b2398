"""Asynchronous scheduling (step N+1 scheduled and launched before step N's tokens are back)
gives exactly the tokens of synchronous stepping: greedy, seeded sampling, stop strings and
EOS (found one step late: the extra row is dropped), under preemption, with aborts; every
block comes back. On the CPU it gains nothing but runs the same code as on accelerators."""
from __future__ import annotations

import pytest

from baton.engine import LLM, SamplingParams

PROMPTS = ["The quick brown fox", "def quicksort(arr):", "La capitale de la France est", "1, 2, 3,",
           "Once upon a time there was a dragon who loved tea and", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def ahead(embedded_source):
    llm = LLM(embedded_source.name, async_scheduling=True, num_kv_blocks=256)
    assert llm.engine.look_ahead
    return llm


@pytest.fixture(scope="module")
def sync(embedded_source):
    llm = LLM(embedded_source.name, async_scheduling=False, num_kv_blocks=256)
    assert not llm.engine.look_ahead
    return llm


def same(a, b) -> None:
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]
    assert [o.text for o in a] == [o.text for o in b]


def test_greedy_tokens_and_eos_stops_are_the_synchronous_ones(ahead, sync):
    params = [SamplingParams(temperature=0, max_tokens=4 + 7 * i) for i in range(len(PROMPTS))]
    same(ahead.generate(PROMPTS, params), sync.generate(PROMPTS, params))
    assert ahead.engine.block_manager.num_free_blocks == ahead.engine.block_manager.num_blocks


def test_seeded_sampling_and_stop_strings_are_the_synchronous_ones(ahead, sync):
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=11 + i, max_tokens=24, stop=[" the", "\n"])
              for i in range(len(PROMPTS))]
    same(ahead.generate(PROMPTS, params), sync.generate(PROMPTS, params))


def test_preemption_under_memory_pressure_keeps_the_tokens(embedded_source, sync):
    tight = LLM(embedded_source.name, async_scheduling=True, num_kv_blocks=12, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    same(tight.generate(PROMPTS[:4], params), sync.generate(PROMPTS[:4], params))
    assert tight.engine.scheduler.num_preemptions > 0          # the pressure was real
    assert tight.engine.block_manager.num_free_blocks == tight.engine.block_manager.num_blocks


def test_an_abort_with_a_step_in_flight_frees_everything(ahead):
    e = ahead.engine
    e.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), request_id="gone")
    e.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), request_id="kept")
    e.step()
    e.step()
    assert e.in_flight is not None                            # a step of "gone" is on its way
    e.abort("gone")
    outs = []
    while e.has_unfinished or e.in_flight is not None:
        outs += e.step()
    assert {o.request_id for o in outs} == {"kept"} and outs[-1].finished and outs[-1].completion_tokens == 6
    assert e.block_manager.num_free_blocks == e.block_manager.num_blocks
