"""BlockManager: paged allocation, ref counts, prefix cache hits, LRU reuse, collisions."""
import pytest

from baton.engine.requests.sampling_params import SamplingParams
from baton.engine.scheduling.block_manager import BlockManager, KVCacheFull
from baton.engine.scheduling.sequence import Sequence


def seq(tokens, max_len=1000):
    return Sequence("r", list(tokens), SamplingParams(), max_len)


def computed(bm, s):
    """Pretend the model ran over every token of s."""
    bm.allocate(s, s.num_uncomputed_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.register_full_blocks(s)


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(10, 4)
    a, b = seq(range(9)), seq(range(100, 105))
    computed(bm, a)
    computed(bm, b)
    assert len(a.block_table) == 3 and len(b.block_table) == 2
    assert bm.num_free_blocks == 5
    bm.free_sequence(a)
    bm.free_sequence(b)
    assert bm.num_free_blocks == 10 and all(blk.ref_count == 0 for blk in bm.blocks)


def test_prefix_hit_shares_blocks_and_leaves_one_token_to_compute():
    bm = BlockManager(10, 4)
    a = seq(range(8))
    computed(bm, a)
    b = seq(range(8))                     # identical prompt: all 8 tokens cached, but one must run
    assert bm.match_prefix(b) == 4
    assert b.block_table == a.block_table[:1]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    c = seq(list(range(8)) + [99])
    assert bm.match_prefix(c) == 8


def test_freed_cached_blocks_are_reused_least_recent_first_and_still_hit():
    bm = BlockManager(4, 4)
    a = seq(range(8))
    computed(bm, a)
    bm.free_sequence(a)
    assert bm.num_free_blocks == 4
    b = seq(list(range(8)) + [1])
    assert bm.match_prefix(b) == 8        # cached after free
    bm.free_sequence(b)
    c = seq(range(50, 66))                # needs all 4 blocks: evicts the cached ones
    computed(bm, c)
    d = seq(list(range(8)) + [1])
    assert bm.match_prefix(d) == 0


def test_hash_collision_never_returns_wrong_kv():
    bm = BlockManager(8, 4, hash_fn=lambda parent, tokens: 42)   # everything collides
    a = seq([1, 2, 3, 4, 5])
    computed(bm, a)
    b = seq([9, 9, 9, 9, 5])
    assert bm.match_prefix(b) == 0        # same hash, different tokens: a miss
    c = seq([1, 2, 3, 4, 7])
    assert bm.match_prefix(c) == 4        # same tokens: a real hit


def test_parent_chain_is_part_of_the_match():
    bm = BlockManager(8, 2)
    a = seq([1, 2, 3, 4, 0])
    computed(bm, a)
    b = seq([5, 6, 3, 4, 0])              # second block's tokens equal, parent differs
    assert bm.match_prefix(b) == 0


def test_double_free_is_an_error():
    bm = BlockManager(4, 4)
    ids = bm.allocate_blocks(2)
    bm.free_blocks(ids)
    with pytest.raises(RuntimeError):
        bm.free_blocks(ids)


def test_allocating_more_than_free_raises_and_changes_nothing():
    bm = BlockManager(2, 4)
    with pytest.raises(KVCacheFull):
        bm.allocate_blocks(3)
    assert bm.num_free_blocks == 2


def test_prefix_caching_off_never_hits():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a = seq(range(9))
    computed(bm, a)
    assert bm.match_prefix(seq(range(9))) == 0
