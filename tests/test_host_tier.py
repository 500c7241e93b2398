"""The prefix cache's host-memory tier (issue 51, engine/runner/host_tier.py): blocks the device
evicts are kept in host memory and brought back when a prompt needs them; the output is token for
token the uncached run's, every block is freed once on both tiers, and the tier's own LRU bounds it."""
from __future__ import annotations

import itertools

import pytest
import torch

from baton.engine import LLMEngine, SamplingParams
from baton.engine.config import EngineConfig
from baton.engine.runner.host_tier import HostTier

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
_fresh = itertools.count(300, 60)


def prompt() -> list[int]:
    start = next(_fresh)
    return list(range(start, start + 50))            # 4 blocks of 16: 3 a later prompt may find


def engine(offload_gib: float = 0.0, prefix_caching: bool = True) -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny-llama", num_kv_blocks=12, max_num_batched_tokens=64,
                                  enable_prefix_caching=prefix_caching, kv_offloading_size=offload_gib))


def run(e: LLMEngine, ids: list[int]) -> tuple[list[int], int]:
    """(its tokens, its prompt tokens found cached)."""
    rid = e.add_request(ids, GREEDY)
    outs = []
    while e.has_unfinished:
        outs += [o for o in e.step() if o.request_id == rid]
    return [t for o in outs for t in o.new_token_ids], outs[-1].cached_tokens


@pytest.fixture(scope="module")
def tiered():
    return engine(offload_gib=0.01)


def test_a_prompt_evicted_from_the_device_comes_back_from_host_memory_token_for_token(tiered):
    e = tiered
    first = prompt()
    tokens, cached = run(e, first)
    assert cached == 0
    for _ in range(3):                                # 3 x 4 blocks through 12: the first prompt's are evicted
        run(e, prompt())
    assert e.runner.host_tier.offloaded >= 3
    loaded = e.runner.host_tier.loaded
    again, cached = run(e, first)
    assert cached == 48 and again == tokens           # its 3 full blocks from host memory, same tokens
    assert e.runner.host_tier.loaded - loaded == 3
    uncached, _ = run(engine(prefix_caching=False), first)
    assert again == uncached
    assert e.block_manager.num_free_blocks == e.block_manager.num_blocks      # every device block back, once


def test_without_the_tier_an_evicted_prompt_is_computed_again():
    e = engine()
    first = prompt()
    run(e, first)
    for _ in range(3):
        run(e, prompt())
    assert run(e, first)[1] == 0 and e.runner.host_tier is None


def test_the_tier_keeps_its_most_recent_blocks_and_trusts_a_hash_only_with_its_tokens():
    kv = torch.zeros(2, 2, 4, 16, 1, 8)             # [layers, K/V, blocks, block_size, heads, dim]
    block_bytes = kv[:, :, :1].numel() * kv.element_size()
    tier = HostTier(kv, block_bytes, 2 * block_bytes)
    for b in range(3):
        kv[:, :, b] = b + 1
        tier.offload(b, h=100 + b, parent=None, tokens=(b,))
    assert tier.num_blocks == 2 and not tier.find(100, None, (0,))           # the oldest went
    assert tier.find(102, None, (2,)) and not tier.find(102, None, (9,)) and not tier.find(102, 5, (2,))
    tier.load(102, 0)
    assert torch.equal(kv[:, :, 0], torch.full_like(kv[:, :, 0], 3))
    with pytest.raises(ValueError, match="holds no block"):
        HostTier(kv, block_bytes, block_bytes - 1)


def test_the_flag_is_refused_where_it_cannot_work():
    with pytest.raises(ValueError, match="kv-offloading-size"):
        EngineConfig(model="tiny-llama", kv_offloading_size=-1).validate()
    with pytest.raises(ValueError, match="tp-size"):
        EngineConfig(model="tiny-llama", kv_offloading_size=1, tp_size=2).validate()
