"""The MoE routing alignment (engine/platforms/triton_kernels/moe_align.py) is plain torch: its
invariants are checked here on the CPU; the grouped GEMMs that consume it run in
test_platform_cuda.py. Also: which layer ops let a MoE model capture decode graphs."""
from __future__ import annotations

import pytest
import torch

from baton.engine.platforms.base import LayerOps
from baton.engine.platforms.cuda import TritonLayerOps
from baton.engine.platforms.triton_kernels.moe_align import align_by_expert, max_blocks


def check_alignment(ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    t, k = ids.shape
    n = t * k
    b = align_by_expert(ids, num_experts, block_m)
    flat = ids.reshape(-1)
    assert b.sorted_slots.numel() == b.max_blocks * block_m == max_blocks(n, num_experts, block_m) * block_m
    rows = b.sorted_slots.long().view(-1, block_m)
    owner = b.block_expert.long()
    real = rows < n
    # every pair lands exactly once, in a block owned by its expert, in token order within the expert
    assert sorted(rows[real].tolist()) == list(range(n))
    assert torch.equal(flat[rows[real]], owner[:, None].expand_as(rows)[real])
    for e in range(num_experts):
        mine = rows[owner == e]
        mine = mine[mine < n]
        assert mine.tolist() == sorted(mine.tolist())
        want_blocks = -(-int((flat == e).sum()) // block_m)
        assert int((owner == e).sum()) == want_blocks          # no block for an expert nobody picked
    # blocks past the groups are marked num_experts and hold padding only; owners never decrease
    assert not real[owner == num_experts].any()
    assert torch.equal(owner, owner.sort().values)


@pytest.mark.parametrize("tokens,experts,top_k,block_m", [
    (1, 8, 2, 16), (1, 128, 8, 16), (7, 4, 2, 4), (64, 128, 8, 16), (300, 8, 2, 64), (33, 16, 3, 1)])
def test_alignment_groups_every_pair_by_expert(tokens, experts, top_k, block_m):
    g = torch.Generator().manual_seed(tokens * experts)
    ids = torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1).indices
    check_alignment(ids, experts, block_m)


def test_alignment_with_skewed_routing_fills_several_blocks_of_one_expert():
    ids = torch.tensor([[3, 1]] * 21 + [[0, 3]] * 5)      # expert 3: 26 pairs, 2 and 4..7 unhit
    check_alignment(ids, 8, 8)
    b = align_by_expert(ids, 8, 8)
    assert b.block_expert.tolist()[:8] == [0, 1, 1, 1, 3, 3, 3, 3]


def test_alignment_rejects_bad_input():
    with pytest.raises(ValueError, match="tokens, top_k"):
        align_by_expert(torch.zeros(4, dtype=torch.int64), 8, 16)
    with pytest.raises(ValueError, match="positive"):
        align_by_expert(torch.zeros(4, 2, dtype=torch.int64), 8, 0)


def test_only_capturable_moe_ops_let_a_moe_model_capture_graphs():
    assert LayerOps.moe_graph_safe is False           # host-synced grouping: eager
    assert TritonLayerOps.moe_graph_safe is True
