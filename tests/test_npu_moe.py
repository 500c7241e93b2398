"""Qwen3-MoE on the Ascend NPU platform: the torch_npu MoE ops it calls (gating top-k softmax,
init routing v2, grouped matmul, token unpermute) against direct references, the platform's
moe_route / moe_experts against the plain-torch LayerOps, graph replay, and the tiny Qwen3-MoE
model's greedy tokens against the CPU platform.

Parametrized over `emulation` (always: engine/platforms/npu_emulation, plain-torch stand-ins
for the documented semantics) and `torch_npu` (the real ops, only where torch_npu imports).
"""
from __future__ import annotations

import os

import pytest
import torch
from helpers import save_tiny_checkpoint
from test_platform_contract import NPU_ERROR

from baton.engine import LLM, SamplingParams
from baton.engine.platforms import PlatformOptions, get_platform
from baton.engine.platforms.base import LayerOps
from baton.engine.platforms.npu import NpuMoeOps

BACKENDS = [
    pytest.param("emulation", id="emulation"),
    pytest.param("torch_npu", id="torch_npu", marks=[pytest.mark.device,
                                                     pytest.mark.skipif(NPU_ERROR is not None, reason=str(NPU_ERROR))]),
]
# (tokens, experts, top k): one token, k = 1, k = E, and experts left without tokens (below)
SHAPES = [(1, 8, 2), (9, 8, 1), (5, 4, 4), (13, 8, 2)]
SHAPE_IDS = ["T1", "k1", "kE", "T13"]


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


def platform_for(backend: str):
    return get_platform("npu:0", PlatformOptions(npu_emulation=backend == "emulation"))


@pytest.fixture
def platform(backend):
    return platform_for(backend)


def routing_ids(t: int, e: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Distinct experts per token, drawn from all but the last two experts when k allows: some
    experts get no token."""
    pool = e - 2 if k <= e - 2 else e
    return torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(t)])


# -- each op against a direct reference --------------------------------------------------------------
@pytest.mark.parametrize("t,e,k", SHAPES, ids=SHAPE_IDS)
def test_gating_top_k_softmax_is_softmax_then_top_k(platform, t, e, k):
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(t)).to(platform.device)
    y, ids, row_idx = platform.npu.npu_moe_gating_top_k_softmax(logits, k=k)
    want_y, want_ids = torch.topk(torch.softmax(logits.cpu(), dim=-1), k, dim=-1)
    assert ids.dtype == torch.int32 and row_idx.dtype == torch.int32
    assert torch.equal(ids.cpu().long(), want_ids)
    torch.testing.assert_close(y.cpu(), want_y)
    for tok in range(t):                                     # k-major: row_idx[t, j] = j * T + t
        assert row_idx[tok].cpu().tolist() == [j * t + tok for j in range(k)]


@pytest.mark.parametrize("t,e,k", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("row_idx_type,tokens_num_type", [(0, 1), (1, 0)], ids=["gather-counts", "scatter-cumsum"])
def test_init_routing_v2_sorts_rows_by_expert(platform, t, e, k, row_idx_type, tokens_num_type):
    g = torch.Generator().manual_seed(10 * t + k)
    x = torch.randn(t, 6, generator=g).to(platform.device)
    ids = routing_ids(t, e, k, g)
    rows, row_idx, tokens, _ = platform.npu.npu_moe_init_routing_v2(
        x, ids.to(torch.int32).to(platform.device), active_num=t * k, expert_num=e,
        expert_tokens_num_type=tokens_num_type, expert_tokens_num_flag=True, active_expert_range=[0, e],
        quant_mode=-1, row_idx_type=row_idx_type)
    flat = ids.reshape(-1).tolist()
    order = [j for expert in range(e) for j in range(t * k) if flat[j] == expert]     # stable, expert by expert
    counts = [flat.count(expert) for expert in range(e)]
    assert 0 in counts or k == e
    assert torch.equal(rows.cpu(), x.cpu()[[j // k for j in order]])
    gather = [order.index(j) for j in range(t * k)]
    assert row_idx.dtype == torch.int32 and row_idx.cpu().tolist() == (order if row_idx_type else gather)
    want = counts if tokens_num_type == 1 else torch.tensor(counts).cumsum(0).tolist()
    assert tokens.dtype == torch.int64 and tokens.cpu().tolist() == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["transposed", "contiguous"])
@pytest.mark.parametrize("group_list_type", [0, 1], ids=["cumsum", "counts"])
def test_grouped_matmul_multiplies_each_group_by_its_weight(platform, dtype, layout, group_list_type):
    g = torch.Generator().manual_seed(7)
    counts = [3, 0, 1, 0, 5, 0]                              # empty groups in the middle and at the end
    m, kdim, n = sum(counts), 16, 12
    x = torch.randn(m, kdim, generator=g).to(dtype)
    stored = torch.randn(len(counts), n, kdim, generator=g).to(dtype)       # nn.Linear's [E, N, K]
    weight = stored.transpose(1, 2) if layout == "transposed" else stored.transpose(1, 2).contiguous()
    group_list = torch.tensor(counts) if group_list_type == 1 else torch.tensor(counts).cumsum(0)
    dev = platform.device
    y = platform.npu.npu_grouped_matmul([x.to(dev)], [weight.to(dev)], group_list=group_list.to(dev), split_item=2,
                                        group_type=0, group_list_type=group_list_type)[0].cpu()
    start = 0
    for group, c in enumerate(counts):
        want = x[start:start + c].double() @ weight[group].double()
        torch.testing.assert_close(y[start:start + c].double(), want, **_tolerance(dtype))
        start += c
    assert y.shape == (m, n) and y.dtype == dtype


@pytest.mark.parametrize("t,k,with_probs", [(1, 2, True), (9, 1, True), (9, 1, False), (5, 4, True), (13, 2, True)],
                         ids=["T1", "k1", "k1-no-probs", "k4", "T13"])
def test_token_unpermute_sums_each_tokens_rows_weighted(platform, t, k, with_probs):
    g = torch.Generator().manual_seed(t + k)
    h = torch.randn(t * k, 8, generator=g).to(torch.bfloat16)
    gather = torch.randperm(t * k, generator=g).to(torch.int32)
    probs = torch.rand(t, k, generator=g).to(torch.bfloat16) if with_probs else None
    dev = platform.device
    out = platform.npu.npu_moe_token_unpermute(h.to(dev), gather.to(dev),
                                               probs=probs.to(dev) if with_probs else None).cpu()
    want = torch.zeros(t, 8, dtype=torch.float64)
    for tok in range(t):
        for j in range(k):
            p = probs[tok, j].double() if with_probs else 1.0
            want[tok] += p * h[gather[tok * k + j]].double()
    torch.testing.assert_close(out.double(), want, **_tolerance(torch.bfloat16))


def _tolerance(dtype) -> dict:
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)


def test_emulated_moe_ops_refuse_documented_misuse():
    from baton.engine.platforms.npu_emulation import NpuEmulationError, emulated_torch_npu
    npu = emulated_torch_npu()
    x, ids = torch.randn(4, 8), torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]], dtype=torch.int32)
    routing = dict(active_num=8, expert_num=4, expert_tokens_num_type=1, expert_tokens_num_flag=True)
    with pytest.raises(NpuEmulationError, match="int32"):
        npu.npu_moe_init_routing_v2(x, ids.long(), **routing)
    with pytest.raises(NpuEmulationError, match=r"expert ids must be in \[0, expert_num=4\)"):
        npu.npu_moe_init_routing_v2(x, ids + 1, **routing)
    with pytest.raises(NpuEmulationError, match="not emulated"):
        npu.npu_moe_init_routing_v2(x, ids, drop_pad_mode=1, **routing)
    w = torch.randn(4, 8, 6)
    gmm = dict(split_item=2, group_type=0, group_list_type=1)
    with pytest.raises(NpuEmulationError, match="sum to x's rows 4"):
        npu.npu_grouped_matmul([x], [w], group_list=torch.tensor([1, 1, 1, 0]), **gmm)
    with pytest.raises(NpuEmulationError, match="1-D int64"):
        npu.npu_grouped_matmul([x], [w], group_list=torch.tensor([1, 1, 1, 1], dtype=torch.int32), **gmm)
    with pytest.raises(NpuEmulationError, match="share"):
        npu.npu_grouped_matmul([x.bfloat16()], [w], group_list=torch.tensor([1, 1, 1, 1]), **gmm)
    h, gather = torch.randn(8, 6, dtype=torch.bfloat16), torch.arange(8, dtype=torch.int32)
    with pytest.raises(NpuEmulationError, match="permuted_tokens' dtype"):
        npu.npu_moe_token_unpermute(h, gather, probs=torch.rand(4, 2))
    with pytest.raises(NpuEmulationError, match="k must be"):
        npu.npu_moe_gating_top_k_softmax(x, k=9)


# -- the platform's layer ops -----------------------------------------------------------------------------
def moe_inputs(t: int, e: int, k: int, dtype, seed: int = 0, hidden: int = 32, inter: int = 16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * inter, hidden, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(e, hidden, inter, generator=g) * 0.2).to(dtype)
    logits = torch.randn(t, e, generator=g).to(dtype)
    logits[:, -2:] -= 30.0                                      # the last two experts are never picked (k < E - 1)
    return x, w13, w2, logits


@pytest.mark.parametrize("t,e,k", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "raw"])
def test_npu_moe_ops_equal_plain_layer_ops_in_float32(backend, platform, t, e, k, renormalize):
    """Only the order of the k-sum differs from LayerOps (slot order, not expert order); a device
    may also accumulate differently, hence its looser tolerance."""
    x, w13, w2, logits = moe_inputs(t, e, k, torch.float32)
    dev, plain = platform.device, LayerOps()
    ids, weights = platform.ops.moe_route(logits.to(dev), k, renormalize)
    want_ids, want_weights = plain.moe_route(logits, k, renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(weights.cpu(), want_weights)
    out = platform.ops.moe_experts(x.to(dev), w13.to(dev), w2.to(dev), ids, weights)
    tol = 1e-5 if backend == "emulation" else 1e-3
    torch.testing.assert_close(out.cpu(), plain.moe_experts(x, w13, w2, want_ids, want_weights), atol=tol, rtol=tol)


@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (9, 8, 1), (13, 8, 2)], ids=["T1", "k1", "T13"])
def test_emulated_moe_experts_round_as_the_cpu_platform_in_bfloat16(t, e, k):
    """With plain-torch SwiGLU (--no-fused-ops) and k <= 2 the emulated path is bit-identical to
    LayerOps (same matmul per expert, same bf16 roundings), which is why the model's greedy
    tokens can be compared exactly below. A device rounds differently."""
    ops = NpuMoeOps(platform_for("emulation").npu)
    x, w13, w2, logits = moe_inputs(t, e, k, torch.bfloat16, seed=1)
    ids, weights = ops.moe_route(logits, k, True)
    weights = weights.to(x.dtype)
    assert torch.equal(ops.moe_experts(x, w13, w2, ids, weights), LayerOps().moe_experts(x, w13, w2, ids, weights))


def test_moe_experts_replay_in_a_captured_graph_with_new_routing(backend, platform):
    """No host read of the per-expert counts: a captured step replayed over new tokens and new
    routing (other experts empty) gives the eager result."""
    t, e, k = 6, 8, 2
    dev = platform.device
    x, w13, w2, logits = (a.to(dev) for a in moe_inputs(t, e, k, torch.bfloat16, seed=2))

    def step():
        ids, weights = platform.ops.moe_route(logits, k, True)
        return platform.ops.moe_experts(x, w13, w2, ids, weights.to(x.dtype))
    graph, out = platform.capture_graph(step)
    x2, _, _, logits2 = moe_inputs(t, e, k, torch.bfloat16, seed=3)
    logits2 = logits2.roll(3, dims=1)                              # now experts 1 and 2 get no token
    x.copy_(x2.to(dev))
    logits.copy_(logits2.to(dev))
    graph.replay()
    platform.synchronize()
    eager = step().cpu()
    if backend == "emulation":
        assert torch.equal(out.cpu(), eager)
    else:
        torch.testing.assert_close(out.cpu(), eager, **_tolerance(torch.bfloat16))


# -- the tiny Qwen3-MoE model ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    from baton.models.source import resolve_model
    tokenizer_dir = os.environ.get("BATON_TOKENIZER") or resolve_model(None).tokenizer_path
    return save_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("moe") / "qwen3-moe", tokenizer_dir, seed=5)


def test_tiny_qwen3_moe_on_the_npu_platform_gives_the_cpu_greedy_tokens(backend, moe_checkpoint):
    """bf16, decode steps captured as graphs, layer ops other than MoE plain torch (as the
    platform contract's parity case). A device's bf16 kernels round differently: there the
    first tokens must agree, not all."""
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 23, 40)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (10, 4, 7)]
    engine = dict(dtype="bfloat16", block_size=128, num_kv_blocks=16, max_num_seqs=4, max_num_batched_tokens=128)
    want = [o.token_ids for o in LLM(str(moe_checkpoint), device="cpu", **engine).generate(prompts, params)]
    llm = LLM(str(moe_checkpoint), device="npu:0", npu_emulation=backend == "emulation", fused_ops=False, **engine)
    graphs = llm.engine.runner.graphs
    assert graphs is not None, "the MoE model was kept eager: NpuMoeOps.moe_graph_safe"
    replays, run = [], graphs.run
    graphs.run = lambda *a: replays.append(a[2].num_seqs) or run(*a)
    try:
        got = [o.token_ids for o in llm.generate(prompts, params)]
    finally:
        graphs.run = run
    assert replays, "no decode step replayed a captured graph"
    if backend == "torch_npu":
        assert all(a[:3] == b[:3] for a, b in zip(got, want, strict=True))
    else:
        assert got == want
