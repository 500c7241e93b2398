"""The platform contract: every platform present against the CPU platform, the reference.

Parametrized over `cpu` (always), `cuda` (a GPU and triton), `npu` (torch_npu imports, i.e.
an Ascend host with CANN) and `npu-emulation` (always: the npu platform over
engine/platforms/npu_emulation.py, plain-torch stand-ins for the documented torch_npu ops,
which check every argument against the documented constraints). Kernel cases compare one
platform call with CpuPlatform run in float32 on the same bf16 inputs; engine cases compare
greedy tokens on the embedded model with chunked prefill and prefix-cache hits.
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from baton.engine import LLM, SamplingParams
from baton.engine.platforms import PlatformOptions, get_platform
from baton.engine.platforms.base import LayerOps
from baton.engine.platforms.cpu import CpuPlatform
from baton.models.attention_metadata import AttnMetadata


def _torch_npu_error() -> str | None:
    try:
        import torch_npu  # noqa: F401
    except Exception as exc:        # ImportError, or CANN's own errors on a half-installed host
        return f"torch_npu does not import here: no CANN / Ascend runtime ({type(exc).__name__}: {exc})"
    return None


def _cuda_error() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return None


NPU_ERROR = _torch_npu_error()
CUDA_ERROR = _cuda_error()
PLATFORMS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.device,
                                           pytest.mark.skipif(CUDA_ERROR is not None, reason=str(CUDA_ERROR))]),
    pytest.param("npu", id="npu", marks=[pytest.mark.device,
                                         pytest.mark.skipif(NPU_ERROR is not None, reason=str(NPU_ERROR))]),
    pytest.param("npu-emulation", id="npu-emulation"),
]
ACCELERATORS = [p for p in PLATFORMS if p.values[0] != "cpu"]          # checked against the cpu reference
NPU_PLATFORMS = [p for p in PLATFORMS if p.values[0] in ("npu", "npu-emulation")]
DEVICE = {"cpu": "cpu", "cuda": "cuda:0", "npu": "npu:0", "npu-emulation": "npu:0"}
BLOCK = 128                        # the one block size every platform takes (npu: 128..512, x128)
BF16_TOLERANCE = 1e-2              # relative (norm) error of a bf16 kernel against a float32 reference


def options(kind: str, **kw) -> dict:
    """The engine options a kind needs (the emulation for npu-emulation), plus `kw`."""
    return {"npu_emulation": kind == "npu-emulation", **kw}


def platform_for(kind: str, **kw):
    return get_platform(DEVICE[kind], PlatformOptions(**options(kind, **kw)))


@pytest.fixture(params=PLATFORMS)
def kind(request) -> str:
    return request.param


@pytest.fixture
def platform(kind):
    return platform_for(kind)


# -- kernel cases -------------------------------------------------------------------------------
def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().cpu().double(), ref.detach().cpu().double()
    return ((out - ref).norm() / ref.norm()).item()


def paged_step(platform, context_lens, query_lens, hq=9, hkv=3, dim=64, pad_rows=0, seed=0):
    """A step over a paged bf16 cache on the platform: new q/k/v (already stored, as
    ForwardContext does), random cached context in shuffled blocks, block tables padded with -1,
    and `pad_rows` graph-style padding rows (one token of block 0, slot -1)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + q) // BLOCK) for c, q in zip(context_lens, query_lens, strict=True)]
    num_blocks = sum(need) + 3
    order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()        # block 0: padding rows
    width = max(need) + 1
    tables, slots, starts = [], [], [0]
    for c, q, n in zip(context_lens, query_lens, need, strict=True):
        blocks, order = order[:n], order[n:]
        tables.append(blocks + [-1] * (width - n))
        slots += [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(c, c + q)]
        starts.append(starts[-1] + q)
    for _ in range(pad_rows):
        tables.append([0] + [-1] * (width - 1))
        slots.append(-1)
        starts.append(starts[-1] + 1)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)] + [1] * pad_rows
    dev = platform.device
    cache = platform.allocate_kv_cache(1, num_blocks, BLOCK, hkv, dim, torch.bfloat16)
    cache.copy_(torch.randn(cache.shape, generator=g).to(torch.bfloat16))
    t = starts[-1]
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(torch.bfloat16).to(dev)  # noqa: E731
    meta = AttnMetadata(
        is_decode=all(q == 1 for q in query_lens), slot_mapping=torch.tensor(slots, device=dev),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=dev), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), has_context=any(c > 0 for c in context_lens),
        query_start_loc_cpu=starts, seq_lens_cpu=seq_lens)
    q, k, v = rnd(t, hq, dim), rnd(t, hkv, dim), rnd(t, hkv, dim)
    k_cache, v_cache = cache[0, 0], cache[0, 1]
    platform.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return q, k, v, k_cache, v_cache, meta


def cpu_reference(fn_name: str, q, k, v, k_cache, v_cache, meta, scale):
    """CpuPlatform's own code in float32 on the same (bf16) values."""
    cpu = CpuPlatform(torch.device("cpu"))
    f = lambda t: t.detach().cpu().float()  # noqa: E731
    m = AttnMetadata(meta.is_decode, meta.slot_mapping.cpu(), meta.query_start_loc.cpu(), meta.seq_lens.cpu(),
                     meta.block_tables.cpu(), meta.max_query_len, meta.max_seq_len, meta.has_context,
                     meta.query_start_loc_cpu, meta.seq_lens_cpu)
    if fn_name == "decode":
        return cpu.decode_attention(f(q), f(k_cache), f(v_cache), m, scale)
    return cpu.prefill_attention(f(q), f(k), f(v), f(k_cache), f(v_cache), m, scale)


def test_store_kv_writes_each_slot_and_skips_padding(platform):
    g = torch.Generator().manual_seed(3)
    num_blocks, hkv, dim = 4, 3, 64
    cache = platform.allocate_kv_cache(1, num_blocks, BLOCK, hkv, dim, torch.bfloat16)
    cache.fill_(float("nan"))                                   # poison: untouched slots stay NaN
    k_cache, v_cache = cache[0, 0], cache[0, 1]
    slots = torch.randperm(num_blocks * BLOCK, generator=g)[:40]
    slots[[3, 17, 39]] = -1                                     # padding rows
    k = torch.randn(40, hkv, dim, generator=g).to(torch.bfloat16).to(platform.device)
    v = torch.randn(40, hkv, dim, generator=g).to(torch.bfloat16).to(platform.device)
    platform.store_kv(k, v, k_cache, v_cache, slots.to(platform.device))
    platform.synchronize()
    keep = slots >= 0
    flat_k = k_cache.reshape(-1, hkv, dim).cpu()
    flat_v = v_cache.reshape(-1, hkv, dim).cpu()
    assert torch.equal(flat_k[slots[keep]], k.cpu()[keep]) and torch.equal(flat_v[slots[keep]], v.cpu()[keep])
    written = torch.zeros(num_blocks * BLOCK, dtype=torch.bool)
    written[slots[keep]] = True
    assert flat_k[~written].isnan().all() and flat_v[~written].isnan().all(), "a slot it was not given changed"


@pytest.mark.parametrize("context_lens,query_lens", [
    ([0, 0, 0], [5, 129, 40]),                 # fresh prompts, one across a block boundary
    ([128, 130, 0, 300], [7, 126, 64, 1]),     # chunked / prefix-cached: history read via block tables
], ids=["no-context", "with-context"])
@pytest.mark.parametrize("hq,hkv,dim", [(9, 3, 64), (4, 4, 128)], ids=["gqa3-d64", "mha-d128"])
def test_prefill_attention_matches_cpu(platform, context_lens, query_lens, hq, hkv, dim):
    step = paged_step(platform, context_lens, query_lens, hq, hkv, dim)
    scale = dim ** -0.5
    out = platform.prefill_attention(*step, scale)
    platform.synchronize()
    assert out.shape == step[0].shape and not out.isnan().any()
    assert rel_err(out, cpu_reference("prefill", *step, scale)) < BF16_TOLERANCE


@pytest.mark.parametrize("hq,hkv,dim", [(9, 3, 64), (4, 4, 128)], ids=["gqa3-d64", "mha-d128"])
def test_decode_attention_matches_cpu(platform, hq, hkv, dim):
    step = paged_step(platform, [0, 127, 128, 300, 5], [1] * 5, hq, hkv, dim, pad_rows=2)
    scale = dim ** -0.5
    out = platform.decode_attention(step[0], step[3], step[4], step[5], scale)
    platform.synchronize()
    assert out.shape == step[0].shape and not out.isnan().any()
    assert rel_err(out[:5], cpu_reference("decode", *step, scale)[:5]) < BF16_TOLERANCE


def test_layer_ops_match_plain_torch_within_bf16(platform):
    """Fused layer ops (npu_rms_norm, npu_add_rms_norm, npu_rotary_mul, npu_swiglu; Triton on
    CUDA) against the plain-torch LayerOps they replace."""
    g = torch.Generator().manual_seed(5)
    dev = platform.device
    rnd = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16).to(dev)  # noqa: E731
    fused, plain = platform.ops, LayerOps()
    x, res, w, eps = rnd(37, 576), rnd(37, 576), rnd(576), 1e-5
    assert rel_err(fused.rms_norm(x, w, eps), plain.rms_norm(x, w, eps)) < BF16_TOLERANCE
    for got, want in zip(fused.add_rms_norm(x, res, w, eps), plain.add_rms_norm(x, res, w, eps), strict=True):
        assert rel_err(got, want) < BF16_TOLERANCE
    q, k = rnd(37, 9, 64), rnd(37, 3, 64)
    angles = torch.rand(37, 32, generator=g) * 6.0
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dev), torch.cat([angles.sin()] * 2, -1).to(dev)
    for got, want in zip(fused.rotary(q, k, cos, sin), plain.rotary(q, k, cos, sin), strict=True):
        assert rel_err(got, want) < BF16_TOLERANCE
    gate_up = rnd(37, 2 * 1536)
    assert rel_err(fused.silu_and_mul(gate_up), plain.silu_and_mul(gate_up)) < BF16_TOLERANCE


# -- engine cases on the embedded model ---------------------------------------------------------
SHARED = ("Baton is a serving system that splits prefill and decode across devices. The prefill worker "
          "computes the key and value cache of a prompt, then hands the blocks to a decode worker over gRPC, "
          "which streams tokens back to the router. Blocks are paged, hashed and shared between prompts "
          "that start the same way, so a long system prompt is computed once. ") * 2
FIRST = [SHARED + "Summarize this in one sentence:", "The quick brown fox", "def fibonacci(n):",
         "Once upon a time, in a small village by the sea, there lived an old fisherman who"]
SECOND = [SHARED + "Now list three of its parts:", "La capitale de la France est"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SHORT = FIRST[1:] + SECOND[1:]            # under one block: never prefix-cached, whatever ran before
SHORT_PARAMS = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (20, 6, 12, 12)]
ENGINE = dict(block_size=BLOCK, max_num_batched_tokens=BLOCK, max_num_seqs=4, num_kv_blocks=48)
PARITY_DTYPE = {"cuda": "float32", "npu": "bfloat16", "npu-emulation": "bfloat16"}


@pytest.fixture(scope="module")
def engines():
    """LLMs built once per (platform, dtype, eager) and shared by the engine cases."""
    built: dict[tuple, LLM] = {}

    def get(kind: str, dtype: str, enforce_eager: bool = False, fused_ops: bool = True) -> LLM:
        key = (kind, dtype, enforce_eager, fused_ops)
        if key not in built:
            built[key] = LLM(device=DEVICE[kind], dtype=dtype, enforce_eager=enforce_eager,
                             **options(kind, fused_ops=fused_ops), **ENGINE)
        return built[key]
    return get


def run_two_batches(llm: LLM) -> tuple[list[list[int]], list]:
    """FIRST (long prompt chunked over several steps), then SECOND (its long prompt hits the
    prefix cache); returns all tokens and the second batch's outputs."""
    chunked = []
    launch = llm.engine.runner.launch

    def watching(out, prev=None):
        chunked.extend(item for item in out.scheduled if not item.samples)
        return launch(out, prev)
    llm.engine.runner.launch = watching
    try:
        first = llm.generate(FIRST, GREEDY)
        second = llm.generate(SECOND, GREEDY)
    finally:
        llm.engine.runner.launch = launch
    assert chunked, "no prefill was chunked: the test's max_num_batched_tokens no longer forces it"
    return [o.token_ids for o in first + second], second


@pytest.mark.parametrize("kind", ACCELERATORS)
def test_greedy_tokens_match_the_cpu_platform(kind, engines):
    """Token for token at the same dtype (bf16 for npu, which takes nothing wider). Layer ops are
    plain torch here: fused kernels round differently (within bf16 tolerance, see
    test_layer_ops_match_plain_torch_within_bf16), enough to flip a near-tie in 24 greedy steps."""
    dtype = PARITY_DTYPE[kind]
    want, _ = run_two_batches(engines("cpu", dtype))
    llm = engines(kind, dtype, fused_ops=False)
    hits = llm.engine.block_manager.num_hits
    got, second = run_two_batches(llm)
    assert len(llm.tokenizer(SHARED)["input_ids"]) > BLOCK
    assert second[0].cached_tokens >= BLOCK and llm.engine.block_manager.num_hits > hits, "no prefix-cache hit"
    if kind == "npu":       # the device's bf16 kernels round differently: agree on a prefix, not all 24
        assert all(g[:8] == w[:8] for g, w in zip(got, want, strict=True))
    else:
        assert got == want


@pytest.mark.parametrize("kind", ACCELERATORS)       # the cpu platform captures no graphs
def test_graph_decode_gives_the_eager_tokens(kind, engines):
    assert platform_for(kind).supports_graphs
    dtype = PARITY_DTYPE[kind]
    eager = engines(kind, dtype, enforce_eager=True)
    graphed = engines(kind, dtype)
    graphs = graphed.engine.runner.graphs
    assert graphs is not None
    replays = []
    run = graphs.run
    graphs.run = lambda *a: replays.append(a[2].num_seqs) or run(*a)
    try:
        got = [o.token_ids for o in graphed.generate(SHORT, SHORT_PARAMS)]
    finally:
        graphs.run = run
    assert {4, 3, 1} <= set(replays), f"decode batches {sorted(set(replays))} did not use the padded buckets"
    want = [o.token_ids for o in eager.generate(SHORT, SHORT_PARAMS)]
    if dtype == "bfloat16":
        # a graph replays at its padded batch: bf16 GEMMs of other row counts round differently on CPUs
        # without native bf16 (oneDNN picks another kernel), enough to flip a near-tie
        # (seen on a 2-core AVX-512 host without bf16 instructions: sequences part at tokens 7 and 17 of 12 and 20)
        assert all(g[:6] == w[:6] for g, w in zip(got, want, strict=True)), (got, want)
    else:
        assert got == want


# -- refused configurations ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A 2-layer random Qwen3 (head_dim 24) with the embedded tokenizer: quick to load."""
    from helpers import save_tiny_checkpoint

    from baton.models.source import resolve_model
    tokenizer_dir = os.environ.get("BATON_TOKENIZER") or resolve_model(None).tokenizer_path
    return save_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("tiny") / "qwen3-d24", tokenizer_dir, head_dim=24)


@pytest.mark.parametrize("overrides,constraint", [
    (dict(block_size=16, dtype="bfloat16"), "block_size 128, 256 or 512"),
    (dict(block_size=BLOCK, dtype="float32"), "float16 or bfloat16"),
    (dict(block_size=BLOCK, dtype="bfloat16"), "multiple of 16"),          # the checkpoint's head_dim 24
], ids=["block-16", "float32", "head-dim-24"])
@pytest.mark.parametrize("kind", NPU_PLATFORMS)     # these layout limits are the npu platform's
def test_npu_refuses_unsupported_layouts_at_start(kind, tiny_checkpoint, overrides, constraint):
    with pytest.raises(ValueError, match=constraint):
        LLM(str(tiny_checkpoint), device=DEVICE[kind], num_kv_blocks=8, **options(kind), **overrides)


@pytest.mark.parametrize("kind", NPU_PLATFORMS)
def test_npu_refuses_unknown_graph_mode_and_missing_torchair(kind):
    with pytest.raises(ValueError, match="aclgraph, torchair"):
        platform_for(kind, npu_graph_mode="cudagraph")
    if importlib.util.find_spec("torchair") is None:
        with pytest.raises(ValueError, match="needs torchair"):
            platform_for(kind, npu_graph_mode="torchair")


def test_emulation_refuses_documented_misuse():
    """The emulation holds npu.py to the docs: these calls would fail (or be undefined) on a device."""
    from baton.engine.platforms.npu_emulation import NpuEmulationError, emulated_torch_npu
    npu = emulated_torch_npu()
    fia = npu.npu_fused_infer_attention_score_v2
    q = torch.randn(2, 4, 9, 64, dtype=torch.bfloat16)
    cache = torch.randn(8, BLOCK, 3 * 64, dtype=torch.bfloat16)
    table = torch.arange(8, dtype=torch.int32).reshape(2, 4)
    mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    ok = dict(atten_mask=mask, block_table=table, actual_seq_qlen=[4, 3], actual_seq_kvlen=[300, 3],
              num_query_heads=9, num_key_value_heads=3, softmax_scale=0.125, input_layout="BSND", sparse_mode=3,
              block_size=BLOCK)
    fia(q, cache, cache, **ok)
    misuse = [
        ((q.float(), cache.float(), cache.float()), {}, "float16 or bfloat16"),
        ((q, cache[:, :16].contiguous(), cache[:, :16].contiguous()), dict(block_size=16), "multiple of 128"),
        ((q, cache, cache), dict(atten_mask=mask[:4, :300]), r"\(2048, 2048\)"),
        ((q, cache, cache), dict(atten_mask=~mask), "causal pattern"),
        ((q, cache, cache), dict(actual_seq_kvlen=[600, 3]), "block_table's second dim"),
        ((q, cache, cache), dict(num_key_value_heads=2), "must divide num_query_heads"),
        ((q, cache, cache), dict(block_table=table.long()), "int32"),
    ]
    for args, change, message in misuse:
        with pytest.raises(NpuEmulationError, match=message):
            fia(*args, **{**ok, **change})
    with pytest.raises(NpuEmulationError, match="int32"):
        k = torch.randn(2, 3, 64, dtype=torch.bfloat16)
        c = torch.zeros(2, BLOCK, 3, 64, dtype=torch.bfloat16)
        npu._npu_reshape_and_cache(k, k, c, c, torch.tensor([0, 1]))
    graph = npu.npu.NPUGraph()
    with pytest.raises(NpuEmulationError, match="tolist"), npu.npu.graph(graph):
        torch.arange(3).tolist()


def test_the_cpus_free_memory_counts_the_page_cache_the_kernel_gives_back():
    """The CPU's default KV cache is sized from free memory: MemAvailable (page cache included), not
    MemFree, or a long run's file I/O shrinks the cache and with it the context a worker serves."""
    import os

    from baton.engine.platforms.cpu import CpuPlatform
    free, total = CpuPlatform("cpu").memory_info()
    mem_free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    assert free >= mem_free and abs(free - available) < 256 << 20 and free <= total
