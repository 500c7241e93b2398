"""Scheduler: continuous batching, chunked prefill, preemption, abort in every state."""
import pytest

from baton.engine.requests.sampling_params import SamplingParams
from baton.engine.scheduling.block_manager import BlockManager
from baton.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from baton.engine.scheduling.sequence import FinishReason, Sequence, SequenceStatus

EOS = 0


def make(num_blocks=64, block_size=4, max_seqs=8, budget=32, max_len=256):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(max_seqs, budget, max_len), bm, {EOS}), bm


def req(n, max_tokens=4, name="r", first=1, **kw):
    return Sequence(name, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens, **kw), 256)


def fake_step(sched, token=7):
    out = sched.schedule()
    sampled = [token if s.samples else None for s in out.scheduled]
    sched.postprocess(out, sampled)
    return out


def run_to_end(sched, limit=1000):
    for _ in range(limit):
        if not sched.has_work:
            return
        fake_step(sched)
    raise AssertionError("scheduler did not finish")


def test_prefill_is_chunked_under_the_token_budget():
    sched, _ = make(budget=16)
    s = req(40)
    sched.add(s)
    chunks = [fake_step(sched).scheduled[0].num_new_tokens for _ in range(3)]
    assert chunks == [16, 16, 8]
    assert s.num_completion_tokens == 1        # the token came only after the last chunk


def test_decodes_and_new_prefills_share_a_step():
    sched, _ = make(budget=32)
    a = req(8, name="a")
    sched.add(a)
    fake_step(sched)
    b = req(8, name="b", first=100)       # distinct tokens: no prefix-cache hit
    sched.add(b)
    out = fake_step(sched)
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 8)]


def test_all_blocks_free_after_requests_finish():
    sched, bm = make()
    for i in range(6):
        sched.add(req(5 + i * 3, max_tokens=6, name=str(i)))
    run_to_end(sched)
    assert bm.num_free_blocks == bm.num_blocks


def test_preemption_by_recompute_when_blocks_run_out():
    sched, bm = make(num_blocks=6, block_size=4, budget=64)
    a, b = req(8, max_tokens=12, name="a"), req(8, max_tokens=12, name="b")
    sched.add(a)
    sched.add(b)
    run_to_end(sched)
    assert a.num_preemptions + b.num_preemptions >= 1
    assert a.num_completion_tokens == 12 and b.num_completion_tokens == 12
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("state", ["waiting", "prefilling", "running"])
def test_abort_in_any_state_frees_every_block(state):
    sched, bm = make(budget=8)
    s = req(20, max_tokens=50)
    sched.add(s)
    if state == "prefilling":
        fake_step(sched)
        assert 0 < s.num_computed_tokens < s.num_tokens
    elif state == "running":
        for _ in range(4):
            fake_step(sched)
        assert s.num_completion_tokens > 0
    sched.abort(s)
    assert s.status is SequenceStatus.FINISHED and s.finish_reason is FinishReason.ABORT
    assert bm.num_free_blocks == bm.num_blocks
    assert not sched.has_work


def test_eos_stops_unless_ignored():
    sched, _ = make()
    s, t = req(4, max_tokens=10, name="s"), req(4, max_tokens=10, name="t", ignore_eos=True)
    sched.add(s)
    sched.add(t)
    fake_step(sched, token=EOS)
    assert s.finish_reason is FinishReason.STOP
    assert not t.is_finished


def test_max_tokens_and_context_length_give_length():
    sched, _ = make(max_len=10)
    s = req(4, max_tokens=100)
    s.max_model_len = 10
    sched.add(s)
    run_to_end(sched)
    assert s.finish_reason is FinishReason.LENGTH and s.num_tokens == 10


def test_prompt_over_max_model_len_is_refused():
    sched, _ = make(max_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(req(17))


def test_max_num_seqs_bounds_the_running_batch():
    sched, _ = make(max_seqs=2, budget=256)
    for i in range(5):
        sched.add(req(4, max_tokens=3, name=str(i)))
    out = sched.schedule()
    assert len(out.scheduled) == 2
