"""--scheduling-policy: fcfs keeps arrival order; priority runs the most urgent first, lets an urgent
request preempt less urgent running ones, and frees every block either way. The router's own
admission queue orders waiting requests by priority too."""
import asyncio

import pytest
from test_scheduler import fake_step, run_to_end

from baton.engine.requests.limits import ModelLimits
from baton.engine.requests.sampling_params import SamplingParams
from baton.engine.scheduling.block_manager import BlockManager
from baton.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from baton.engine.scheduling.sequence import Sequence
from baton.router.admission import Admission


def make(policy, num_blocks=64, max_seqs=8, budget=64):
    bm = BlockManager(num_blocks, 4)
    return Scheduler(SchedulerConfig(max_seqs, budget, 256, policy), bm, {0}), bm


def req(name, priority=0, n=8, max_tokens=4, first=1):
    return Sequence(name, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens, priority=priority), 256)


def admitted_order(sched):
    order = []
    while sched.has_work:
        for item in fake_step(sched).scheduled:
            if item.seq.request_id not in order:
                order.append(item.seq.request_id)
    return order


@pytest.mark.parametrize("policy,expected", [("fcfs", ["low", "high", "mid", "high2"]),
                                             ("priority", ["high", "high2", "mid", "low"])])
def test_waiting_requests_start_in_policy_order(policy, expected):
    sched, bm = make(policy, max_seqs=1)                  # one at a time: the start order is the queue's
    for i, (name, priority) in enumerate([("low", 5), ("high", -1), ("mid", 0), ("high2", -1)]):
        sched.add(req(name, priority, first=1 + 10 * i))
    assert admitted_order(sched) == expected
    assert bm.num_free_blocks == bm.num_blocks


def test_an_urgent_request_preempts_a_less_urgent_running_one():
    sched, bm = make("priority", num_blocks=6, budget=64)   # 24 token slots: one 16-token request fits
    low = req("low", priority=1, n=16, max_tokens=6)
    sched.add(low)
    fake_step(sched)
    assert low.num_completion_tokens == 1
    urgent = req("urgent", priority=0, n=16, max_tokens=3, first=100)
    sched.add(urgent)
    out = fake_step(sched)
    assert out.preempted == [low]                          # gave way at once, not after finishing
    finished = []
    while sched.has_work:
        out = fake_step(sched)
        finished += [s.seq.request_id for s in out.scheduled if s.seq.is_finished]
    assert finished == ["urgent", "low"]                   # low resumed (recomputed) afterwards
    assert low.num_completion_tokens == 6 and urgent.num_completion_tokens == 3
    assert bm.num_free_blocks == bm.num_blocks


def test_equal_priority_never_preempts_and_fcfs_never_does():
    for policy, priority in (("priority", 1), ("fcfs", 0)):
        sched, bm = make(policy, num_blocks=6, budget=64)
        first = req("first", priority=priority, n=16, max_tokens=6)
        sched.add(first)
        fake_step(sched)
        sched.add(req("second", priority=0 if policy == "fcfs" else 1, n=16, max_tokens=3, first=100))
        assert not fake_step(sched).preempted
        run_to_end(sched)
        assert first.num_preemptions == 0 and bm.num_free_blocks == bm.num_blocks


def test_under_kv_pressure_the_least_urgent_running_request_gives_way():
    sched, bm = make("priority", num_blocks=7, budget=64)
    seqs = [req("b", priority=2, n=7, max_tokens=12, first=1), req("a", priority=0, n=7, max_tokens=12, first=50)]
    for s in seqs:
        sched.add(s)
    run_to_end(sched)
    assert seqs[0].num_preemptions >= 1 and seqs[1].num_preemptions == 0
    assert bm.num_free_blocks == bm.num_blocks


def test_priority_is_refused_where_the_policy_is_fcfs():
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        ModelLimits(1000, 256).validate([1, 2, 3], SamplingParams(priority=3))
    ModelLimits(1000, 256, "priority").validate([1, 2, 3], SamplingParams(priority=3))
    with pytest.raises(ValueError, match="32-bit"):
        SamplingParams(priority=2**40).validate()


def test_the_router_admits_queued_requests_by_priority():
    async def main():
        admission = Admission(max_inflight=1, max_queued=8, queue_timeout=5)
        started, release = [], asyncio.Event()
        deadline = asyncio.get_running_loop().time() + 10

        async def request(name, priority):
            async with admission.slot(name, deadline, priority):
                started.append(name)
                await release.wait()

        first = asyncio.create_task(request("first", 0))
        await asyncio.sleep(0.01)
        tasks = [asyncio.create_task(request(name, p)) for name, p in (("low", 3), ("urgent", -2), ("mid", 0))]
        await asyncio.sleep(0.01)
        assert started == ["first"] and len(admission.queue) == 3
        release.set()
        await asyncio.wait_for(asyncio.gather(first, *tasks), 5)
        assert started == ["first", "urgent", "mid", "low"]
        assert admission.inflight == 0 and not admission.queue
    asyncio.run(main())


def test_the_engine_runs_requests_in_priority_order_with_the_same_tokens(tmp_path):
    """--scheduling-policy priority through a real engine (tiny qwen3, one sequence at a time):
    requests finish most urgent first, each with the tokens it gets alone, and every block is free."""
    import os

    from helpers import save_tiny_checkpoint

    from baton.engine.llm import LLM
    from baton.models.source import resolve_model
    tokenizer_dir = os.environ.get("BATON_TOKENIZER") or resolve_model(None).tokenizer_path
    path = str(save_tiny_checkpoint("qwen3", tmp_path / "qwen3", tokenizer_dir))
    prompts = {"low": [5, 6, 7, 8], "urgent": [9, 10, 11], "mid": [12, 13, 14, 15, 16]}
    priority = {"low": 4, "urgent": -3, "mid": 0}
    llm = LLM(path, num_kv_blocks=32, max_num_seqs=1, scheduling_policy="priority")
    alone = {name: llm.generate([p], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].token_ids
             for name, p in prompts.items()}
    for name, p in prompts.items():
        llm.engine.add_request(p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                 priority=priority[name]), request_id=name)
    finished, tokens = [], {}
    for _ in range(200):
        for out in llm.engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished.append(out.request_id)
        if len(finished) == 3:
            break
    assert finished == ["urgent", "mid", "low"]
    assert tokens == alone
    assert llm.engine.block_manager.num_free_blocks == 32
