"""The steps Baton's scheduler would run for a workload, without a model.

The scheduler and block manager are torch-free, so they can be driven with fake sampled
tokens. B1 uses this for the roofline of engines whose steps it cannot observe (the
transformers peer): the least time of the same workload under Baton's schedule.
"""
from __future__ import annotations

import math

from baton.benchmarks.roofline import StepShape
from baton.engine.requests.sampling_params import SamplingParams
from baton.engine.scheduling.block_manager import BlockManager
from baton.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from baton.engine.scheduling.sequence import Sequence


def simulate_steps(prompts: list[list[int]], output_lens: list[int], block_size: int = 16,
                   max_num_seqs: int = 256, max_num_batched_tokens: int = 4096,
                   num_blocks: int | None = None) -> list[StepShape]:
    """Every step's shape; KV blocks default to enough for all sequences at once."""
    lens = [len(p) + o for p, o in zip(prompts, output_lens, strict=True)]
    blocks = num_blocks or sum(math.ceil(n / block_size) + 1 for n in lens)
    max_len = max(lens) + 1
    sched = Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_len),
                      BlockManager(blocks, block_size, enable_prefix_caching=False), eos_token_ids=set())
    for i, (prompt, n) in enumerate(zip(prompts, output_lens, strict=True)):
        sched.add(Sequence(f"sim-{i}", prompt, SamplingParams(max_tokens=n, ignore_eos=True), max_len))
    steps = []
    while sched.has_work:
        out = sched.schedule()
        if out.is_empty:
            raise RuntimeError("the simulated scheduler made no progress: too few KV blocks for one sequence")
        steps.append(StepShape([(s.seq.num_computed_tokens, s.num_new_tokens) for s in out.scheduled],
                               sum(s.samples for s in out.scheduled)))
        sched.postprocess(out, [0 if s.samples else None for s in out.scheduled])
    return steps
