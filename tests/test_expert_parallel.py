"""Expert parallelism (models/layers/expert_parallel.py) on the CPU over gloo: both dispatch modes
give a dense reference's MoE output on random tensors with uneven expert loads, a tiny Qwen3-MoE
decodes the same greedy tokens as tp_size 1 with EP=2, and bad combinations are refused at config
time."""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import in_triton_interpreter, save_tiny_checkpoint, tiny_hf_config

from baton.engine import LLM, SamplingParams
from baton.engine.config import EngineConfig
from baton.engine.platforms.base import LayerOps
from baton.models.layers.expert_parallel import ExpertPlacement, make_dispatch
from baton.models.layers.linear import TPInfo
from baton.models.layers.moe import SparseMoeBlock
from baton.models.loader import build_model

E, H, INTER, K = 8, 16, 12, 2


def _routings(g: torch.Generator) -> dict[str, torch.Tensor]:
    """Expert ids [T, k] of distinct experts per token: skewed, all to one expert (and its partner),
    one expert never hit, fewer tokens than ranks."""
    skewed = torch.stack([torch.multinomial(torch.tensor([8., 4, 2, 1, 1, 0, 1, 1]), K, generator=g)
                          for _ in range(13)])
    assert not (skewed == 5).any()          # expert 5 receives no token
    return {"skewed": skewed, "one_expert": torch.tensor([[3, 6]] * 9), "fewer_tokens_than_ranks": torch.tensor([[7, 0]])}


def _worker(rank: int, ranks: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
    try:
        g = torch.Generator().manual_seed(0)
        w13 = torch.randn(E, 2 * INTER, H, generator=g, dtype=torch.float64)
        w2 = torch.randn(E, H, INTER, generator=g, dtype=torch.float64)
        ops, tp = LayerOps(), TPInfo(rank, ranks, None)
        for redundant in ((), tuple(range(ranks)), (3, 6, 0, 1)[:ranks]):   # hot experts: none, one rank's, spread
            placement = ExpertPlacement(E, rank, ranks, redundant)
            local = _local_stacks(placement, w13, w2)
            for name, ids in _routings(g).items():
                x = torch.randn(ids.shape[0], H, generator=g, dtype=torch.float64)
                weights = torch.rand(ids.shape, generator=g, dtype=torch.float64)
                want = ops.moe_experts(x, w13, w2, ids, weights)          # every expert on one device
                for mode in ("allreduce", "alltoall"):
                    got = make_dispatch(mode, placement, ops, tp)(x, ids, weights, local)
                    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10,
                                               msg=f"{mode} {name} redundant {redundant} rank {rank}")
    finally:
        dist.destroy_process_group()


def _local_stacks(placement: ExpertPlacement, w13: torch.Tensor, w2: torch.Tensor):
    """This rank's slots as FusedExperts' weight loader fills them."""
    class Local:
        scales = None
    Local.w13 = torch.zeros(placement.num_local, *w13.shape[1:], dtype=w13.dtype)
    Local.w2 = torch.zeros(placement.num_local, *w2.shape[1:], dtype=w2.dtype)
    for e in range(w13.shape[0]):
        for slot in placement.local_slots(e):
            Local.w13[slot], Local.w2[slot] = w13[e], w2[e]
    return Local


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("ranks", [2, 4])
def test_dispatch_and_combine_match_a_dense_moe_on_uneven_loads(ranks):
    mp.spawn(_worker, args=(ranks, _free_port()), nprocs=ranks, join=True)


def test_a_hot_experts_tokens_split_between_its_copies():
    """Experts 0 (rank 0's) and 4 (rank 1's) are hot: each gets a second copy in the other rank's
    extra slot, and the pairs of every other token run there; cold experts keep their home slot."""
    ranks = [ExpertPlacement(8, r, 2, redundant=(0, 4)) for r in range(2)]
    assert ranks[0].num_local == 5 and ranks[0].local_slots(0) == [0] and ranks[1].local_slots(0) == [4]
    assert ranks[0].local_slots(4) == [4] and ranks[1].local_slots(4) == [0]
    assert ranks[0].local_slots(1) == [1] and ranks[1].local_slots(1) == []
    ids = torch.tensor([[0, 5]] * 6)
    owners = torch.div(ranks[0].slots(ids), 5, rounding_mode="floor")
    assert owners[:, 0].tolist() == [0, 1, 0, 1, 0, 1] and owners[:, 1].tolist() == [1] * 6
    assert (ranks[0].localize(ids) < 5).sum() == 3 and (ranks[1].localize(ids) < 5).sum() == 9


def test_the_hottest_experts_come_from_the_load_profile_and_are_counted_by_the_moe_block(tmp_path):
    from baton.models.layers.expert_parallel import hot_experts
    block = SparseMoeBlock(tiny_hf_config("qwen3_moe"), LayerOps(), TPInfo(), torch.float32)
    torch.nn.init.normal_(block.gate.weight)
    block.count_load()
    ids, _ = block.route(torch.randn(40, 64))
    assert block.expert_load.tolist() == torch.bincount(ids.reshape(-1), minlength=8).tolist()
    profile = tmp_path / "load.json"
    profile.write_text('{"tokens_per_expert": [5, 90, 7, 90, 1, 0, 60, 2]}')
    assert hot_experts(str(profile), 2) == (1, 3) and hot_experts(str(profile), 4) == (1, 3, 6, 2)
    profile.write_text('{"experts": [1, 2]}')
    with pytest.raises(ValueError, match="tokens_per_expert"):
        hot_experts(str(profile), 2)


def test_foreign_pairs_add_nothing_on_one_device():
    """The allreduce mode's building block: ids equal to E are another rank's, skipped."""
    g = torch.Generator().manual_seed(1)
    w13, w2 = torch.randn(4, 8, 6, generator=g), torch.randn(4, 6, 4, generator=g)
    x, ids = torch.randn(5, 6, generator=g), torch.tensor([[0, 4], [4, 4], [2, 1], [4, 3], [1, 4]])
    weights = torch.rand(5, 2, generator=g)
    kept = torch.where(ids < 4, weights, torch.zeros(()))
    want = LayerOps().moe_experts(x, w13, w2, ids.clamp(max=3), kept)
    torch.testing.assert_close(LayerOps().moe_experts(x, w13, w2, ids, weights, foreign=True), want)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    from baton.models.source import resolve_model
    tokenizer_dir = os.environ.get("BATON_TOKENIZER") or resolve_model(None).tokenizer_path
    return save_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("ep") / "qwen3_moe", tokenizer_dir)


@pytest.fixture(scope="module")
def single_device_tokens(moe_checkpoint):
    llm = LLM(str(moe_checkpoint), num_kv_blocks=64, dtype="float32")
    return [o.token_ids for o in llm.generate(_prompts(), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))]


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (7, 30, 4)]


@pytest.mark.parametrize("dispatch,redundant", [(None, 0), ("allreduce", 0), ("alltoall", 0), ("allreduce", 2)])
def test_expert_parallel_ranks_give_the_single_device_tokens(moe_checkpoint, single_device_tokens, dispatch,
                                                             redundant, tmp_path):
    """EP=2 (each rank 4 of the 8 experts; with 2 redundant, a copy of the 2 hottest too) and plain
    TP=2 decode what tp_size 1 does."""
    ep = {} if dispatch is None else dict(enable_expert_parallel=True, expert_parallel_dispatch=dispatch)
    if redundant:
        (tmp_path / "load.json").write_text('{"tokens_per_expert": [1, 9, 1, 1, 1, 1, 8, 1]}')
        ep.update(ep_redundant_experts=redundant, ep_expert_load=str(tmp_path / "load.json"))
    llm = LLM(str(moe_checkpoint), num_kv_blocks=64, dtype="float32", tp_size=2, **ep)
    try:
        got = llm.generate(_prompts(), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        moe = llm.engine.runner.model.model.layers[0].mlp          # rank 0, in this process
        assert moe.experts.w13.shape[0] == (8 if dispatch is None else 4 + redundant // 2)
        assert (moe.dispatch is None) == (dispatch is None)
    finally:
        llm.engine.runner.close()
    assert [o.token_ids for o in got] == single_device_tokens


def test_each_rank_holds_only_its_whole_experts():
    config = tiny_hf_config("qwen3_moe")
    block = SparseMoeBlock(config, LayerOps(), TPInfo(1, 2, None, "allreduce"), torch.float32)
    assert block.experts.w13.shape == (4, 2 * config.moe_intermediate_size, config.hidden_size)
    full = torch.arange(config.moe_intermediate_size * config.hidden_size, dtype=torch.float32)
    full = full.view(config.moe_intermediate_size, config.hidden_size)
    block.experts.w13.data.zero_()
    block.experts.weight_loader(block.experts.w13, full, (2, "gate_proj"))      # rank 0's expert: skipped
    assert not block.experts.w13.any()
    block.experts.weight_loader(block.experts.w13, full, (5, "gate_proj"))      # rank 1's second expert
    assert torch.equal(block.experts.w13[1, :config.moe_intermediate_size], full)


@pytest.mark.parametrize("options,match", [
    (dict(tp_size=1, enable_expert_parallel=True), "--tp-size 2 or more"),
    (dict(tp_size=2, enable_expert_parallel=True, device="npu:0"), "Ascend"),
    (dict(tp_size=2, enable_expert_parallel=True, quantization="w8a8"), "w8a8"),
    (dict(tp_size=2, enable_expert_parallel=True, expert_parallel_dispatch="ring"), "allreduce, alltoall"),
    (dict(tp_size=2, ep_redundant_experts=2, ep_expert_load="load.json"), "--ep-redundant-experts 2"),
    (dict(tp_size=2, enable_expert_parallel=True, ep_redundant_experts=2), "--ep-redundant-experts 2"),
    (dict(tp_size=2, enable_expert_parallel=True, ep_redundant_experts=3, ep_expert_load="l.json"), "multiple"),
])
def test_bad_expert_parallel_options_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**options).validate()


def test_experts_not_divisible_by_the_ranks_are_refused():
    with pytest.raises(ValueError, match="8 experts .* over the 3 ranks"):
        SparseMoeBlock(tiny_hf_config("qwen3_moe"), LayerOps(), TPInfo(0, 3, None, "allreduce"), torch.float32)


def test_a_dense_model_is_refused():
    config = tiny_hf_config("qwen3", architectures=["Qwen3ForCausalLM"])
    with pytest.raises(ValueError, match="has none"):
        build_model(config, torch.float32, "cpu", LayerOps(), tp_rank=0, tp_size=2, expert_parallel="allreduce")


def check_fused_foreign() -> None:
    """Run under TRITON_INTERPRET=1: the CUDA platform's fused experts (one-program and chunked
    alignment) skip another rank's pairs as the base ops do; all of a token's pairs foreign gives 0."""
    from baton.engine.platforms.triton_kernels.moe import fused_experts
    g = torch.Generator().manual_seed(0)
    place = ExpertPlacement(16, 1, 2)
    for tokens in (1, 5, 300):                    # 1200 pairs: past ONE_PROGRAM_ALIGN_MAX_PAIRS
        x = torch.randn(tokens, 32, generator=g)
        w13, w2 = torch.randn(8, 64, 32, generator=g) / 6, torch.randn(8, 32, 32, generator=g) / 6
        ids, weights = LayerOps().moe_route(torch.randn(tokens, 16, generator=g), 4, True)
        ids = place.localize(ids)
        if tokens == 1:
            ids.fill_(place.num_local)
        want = LayerOps().moe_experts(x, w13, w2, ids, weights, foreign=True)
        torch.testing.assert_close(fused_experts(x, w13, w2, ids, weights, foreign=True), want, rtol=1e-4, atol=1e-5)
        mine = ids.clamp(max=place.num_local - 1)                     # no foreign pairs: the plain path
        torch.testing.assert_close(fused_experts(x, w13, w2, mine, weights),
                                   LayerOps().moe_experts(x, w13, w2, mine, weights), rtol=1e-4, atol=1e-5)
    print("fused foreign ok")


def test_fused_experts_skip_foreign_pairs_in_the_triton_interpreter():
    in_triton_interpreter("import test_expert_parallel; test_expert_parallel.check_fused_foreign()",
                          "fused foreign ok", "the fused experts")


# -- CUDA: the fused kernels skip another rank's pairs; EP=2 over NCCL with decode graphs --------
on_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible to torch")


@pytest.mark.device
@on_gpu
@pytest.mark.parametrize("tokens", [1, 37, 600])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_fused_experts_skip_foreign_pairs_like_the_base_ops_also_from_a_graph(tokens, fp8):
    from baton.engine.platforms.cuda import CudaPlatform
    from baton.models.layers.quantization import ExpertScales, quantize_stacked
    cuda = CudaPlatform(torch.device("cuda:0"))
    g = torch.Generator().manual_seed(tokens)
    place = ExpertPlacement(16, 1, 2)                                   # rank 1 of 2: experts 8..15
    x = torch.randn(tokens, 128, generator=g).bfloat16().cuda()
    w13 = (torch.randn(8, 128, 128, generator=g) / 11).bfloat16().cuda()
    w2 = (torch.randn(8, 128, 64, generator=g) / 8).bfloat16().cuda()
    scales = None
    if fp8:
        (w13, s13), (w2, s2) = quantize_stacked(w13), quantize_stacked(w2)
        scales = ExpertScales(s13, s2)
    ids, weights = LayerOps().moe_route(torch.randn(tokens, 16, generator=g), 4, True)
    ids, weights = place.localize(ids).cuda(), weights.bfloat16().cuda()
    dots = False if fp8 else None                                        # FP8: weight-only, as the reference
    out = cuda.ops.moe_experts(x, w13, w2, ids, weights, scales=scales, fp8_dots=dots, foreign=True)
    d = torch.float64
    wide = (w13, w2) if fp8 else (w13.to(d), w2.to(d))
    ref = LayerOps().moe_experts(x.to(d), *wide, ids, weights.to(d), scales=scales, fp8_dots=dots, foreign=True)
    assert (out.double() - ref).norm() <= 1e-2 * ref.norm()      # on cuda:0 both (0 = 0: all pairs foreign)
    graph, replayed = cuda.capture_graph(lambda: cuda.ops.moe_experts(x, w13, w2, ids, weights, scales=scales,
                                                                      foreign=True))
    ids.copy_(torch.flip(ids, dims=[0]))                                 # another routing, replayed
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, cuda.ops.moe_experts(x, w13, w2, ids, weights, scales=scales, foreign=True))
    assert replayed.isfinite().all()


@pytest.mark.device
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (expert parallelism)")
def test_ep2_gives_the_tp1_greedy_tokens_on_cuda_with_decode_graphs():
    """The tiny Qwen3-MoE preset in fp32: TP=1, and EP=2 with both dispatches (allreduce under
    decode graphs, alltoall eager), decode the same greedy tokens."""
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (1, 9, 40, 3, 17)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for name, extra in (("tp1", {}), ("allreduce", dict(tp_size=2, enable_expert_parallel=True)),
                        ("alltoall", dict(tp_size=2, enable_expert_parallel=True, expert_parallel_dispatch="alltoall"))):
        llm = LLM("tiny-qwen3-moe", device="cuda:0", dtype="float32", max_num_seqs=8, max_model_len=512,
                  num_kv_blocks=128, tokenizer=os.environ.get("BATON_TOKENIZER"), **extra)
        try:
            assert (llm.engine.runner.graphs is None) == (name == "alltoall")
            outs[name] = [o.token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.engine.runner.close()
        del llm
        torch.cuda.empty_cache()
    assert outs["allreduce"] == outs["tp1"] and outs["alltoall"] == outs["tp1"]
