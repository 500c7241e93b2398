"""CUDA platform: every Triton kernel against the CPU platform's reference code.

The reference is CpuPlatform's own code run in float64 on upcast copies of the same inputs
(on the GPU, so multi-thousand-token cases stay quick). Inputs are random, never zero; kernel
outputs are poisoned with NaN first and must be fully overwritten. Skipped with a reason where
there is no CUDA GPU or no triton; the layout checks run everywhere.
"""
from __future__ import annotations

import collections
import importlib.util
import os
from dataclasses import dataclass

import pytest
import torch

from baton.engine.platforms.base import LayerOps
from baton.engine.platforms.cpu import CpuPlatform
from baton.engine.platforms.cuda import CudaPlatform
from baton.models.attention_metadata import AttnMetadata

HAS_GPU = torch.cuda.is_available()
TOKENIZER = os.environ.get("BATON_TOKENIZER")    # the GPU machine carries the embedded tokenizer
HAS_TRITON = importlib.util.find_spec("triton") is not None
_why_skip = "no CUDA GPU visible to torch" if not HAS_GPU else "triton is not installed"


def on_gpu(test):
    """Marks a test that runs kernels: skipped, with the reason, without a GPU or triton."""
    return pytest.mark.device(pytest.mark.skipif(not (HAS_GPU and HAS_TRITON), reason=_why_skip)(test))


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}
DEV = "cuda"

# (dtype, q heads per kv head, head_dim, block_size): each GQA ratio, head_dim and block size,
# in both precisions, without compiling the whole cartesian product
CASES = [
    (torch.float32, 1, 64, 16),
    (torch.float32, 4, 128, 32),
    (torch.bfloat16, 1, 128, 16),
    (torch.bfloat16, 2, 128, 16),
    (torch.bfloat16, 4, 64, 32),
    (torch.bfloat16, 8, 128, 32),
    (torch.float16, 2, 64, 16),
]
KV_HEADS = 2


def case_id(case) -> str:
    dtype, group, dim, bs = case
    return f"{str(dtype).removeprefix('torch.')}-gqa{group}-d{dim}-bs{bs}"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, float("nan"))


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any(), f"{int(out.isnan().sum())} outputs never written (still NaN)"
    err = rel_err(out, ref)
    assert err < TOLERANCE[dtype], f"relative error {err:.2e} over {TOLERANCE[dtype]:.0e}"


@dataclass
class PagedBatch:
    """A step over a paged cache: new tokens q/k/v (not yet stored) and their metadata."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttnMetadata

    def upcast(self) -> PagedBatch:
        """The same inputs in float64, for the reference."""
        d = torch.float64
        return PagedBatch(self.q.to(d), self.k.to(d), self.v.to(d), self.k_cache.to(d), self.v_cache.to(d),
                          self.meta)


def make_batch(context_lens: list[int], query_lens: list[int], group: int, dim: int, block_size: int,
               dtype: torch.dtype, pad_rows: int = 0, seed: int = 0, min_blocks: int = 0) -> PagedBatch:
    """Random sequences with shuffled, non-contiguous blocks; block tables padded with -1 (plus
    one spare -1 column); `pad_rows` graph-style padding rows (one token of block 0, slot -1)."""
    g = torch.Generator().manual_seed(seed)
    totals = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    need = [-(-n // block_size) for n in totals]
    num_blocks = max(sum(need) + 3, min_blocks)
    order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()     # block 0 stays for padding rows
    width = max(need) + 1
    tables, slots, starts = [], [], [0]
    for c, q, n in zip(context_lens, query_lens, need, strict=True):
        blocks, order = order[:n], order[n:]
        tables.append(blocks + [-1] * (width - n))
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(c, c + q)]
        starts.append(starts[-1] + q)
    for _ in range(pad_rows):
        tables.append([0] + [-1] * (width - 1))
        slots.append(-1)
        starts.append(starts[-1] + 1)
    seq_lens = totals + [1] * pad_rows
    t = starts[-1]
    hkv, hq = KV_HEADS, KV_HEADS * group
    kv = torch.randn(1, 2, num_blocks, block_size, hkv, dim, generator=g).to(dtype)   # the platform's layout
    meta = AttnMetadata(
        is_decode=all(q == 1 for q in query_lens), slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32), max_query_len=max(query_lens + [1] * pad_rows),
        max_seq_len=max(seq_lens), has_context=any(c > 0 for c in context_lens),
        query_start_loc_cpu=starts, seq_lens_cpu=seq_lens)
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        setattr(meta, name, getattr(meta, name).to(DEV))
    kv = kv.to(DEV)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(dtype).to(DEV)  # noqa: E731
    return PagedBatch(rnd(t, hq, dim), rnd(t, hkv, dim), rnd(t, hkv, dim), kv[0, 0], kv[0, 1], meta)


def reference_store(batch: PagedBatch) -> PagedBatch:
    ref = batch.upcast()
    CpuPlatform(torch.device("cpu")).store_kv(ref.k, ref.v, ref.k_cache, ref.v_cache, batch.meta.slot_mapping)
    return ref


def cuda_platform() -> CudaPlatform:
    return CudaPlatform(torch.device(DEV))


# -- layout checks (run everywhere) ---------------------------------------------------------
@pytest.mark.parametrize("block_size,head_dim,dtype,needle", [
    (16, 96, torch.bfloat16, "head_dim"),
    (16, 512, torch.bfloat16, "head_dim"),
    (24, 128, torch.bfloat16, "block_size"),
    (16, 128, torch.int8, "float16, bfloat16 or float32"),
])
def test_check_kv_layout_names_the_constraint(block_size, head_dim, dtype, needle):
    with pytest.raises(ValueError, match=needle):
        CudaPlatform(torch.device("cuda")).check_kv_layout(block_size, head_dim, dtype)


def test_check_kv_layout_accepts_common_models():
    for head_dim in (64, 128, 256):
        CudaPlatform(torch.device("cuda")).check_kv_layout(16, head_dim, torch.bfloat16)


def test_platform_identity():
    p = CudaPlatform(torch.device("cuda"))
    assert (p.name, p.dist_backend, p.supports_graphs, p.default_dtype()) == ("cuda", "nccl", True, torch.bfloat16)


# -- KV store -------------------------------------------------------------------------------
@on_gpu
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "qkv-view"])
def test_store_kv_writes_every_slot_and_skips_padding(case, strided):
    dtype, group, dim, bs = case
    batch = make_batch([0, 5, 40], [19, 1, 3], group, dim, bs, dtype, pad_rows=2)
    k, v = batch.k, batch.v
    if strided:     # k/v as column slices of one fused qkv projection
        fused = torch.cat([k.flatten(1), v.flatten(1), k.flatten(1)], dim=1)
        k = fused[:, :KV_HEADS * dim].view(-1, KV_HEADS, dim)
        v = fused[:, KV_HEADS * dim:2 * KV_HEADS * dim].view(-1, KV_HEADS, dim)
    ref = reference_store(batch)
    cuda_platform().store_kv(k, v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    assert torch.equal(batch.k_cache.double(), ref.k_cache)     # written rows exact, all others untouched
    assert torch.equal(batch.v_cache.double(), ref.v_cache)


# -- decode ---------------------------------------------------------------------------------
DECODE_CONTEXTS = [1, 2, 17, 600, 4100, 2049, 33, 1000]


@on_gpu
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("splits", ["auto", "one"])
def test_decode_matches_reference(case, splits):
    from baton.engine.platforms.triton_kernels import decode_attention as dk
    dtype, group, dim, bs = case
    ctx = [n - 1 for n in DECODE_CONTEXTS]
    batch = make_batch(ctx, [1] * len(ctx), group, dim, bs, dtype, pad_rows=2, seed=CASES.index(case))
    platform = cuda_platform()
    platform.store_kv(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    ref = reference_store(batch)
    scale = dim ** -0.5
    expected = CpuPlatform(torch.device("cpu")).decode_attention(ref.q, ref.k_cache, ref.v_cache, batch.meta, scale)
    cfg = dk.default_config(dim, dtype)
    if splits == "one":
        cfg = dk.DecodeConfig(cfg.block_n, cfg.num_warps, cfg.num_stages, max_splits=1)
    out = dk.paged_decode(batch.q, batch.k_cache, batch.v_cache, batch.meta.block_tables, batch.meta.seq_lens,
                          scale, platform.num_sms, cfg, out=poisoned(batch.q))
    assert_close(out, expected, dtype)
    if splits == "auto":   # the platform entry point is the same kernel
        assert torch.equal(platform.decode_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale), out)


def test_decode_split_count_depends_on_shapes_only():
    from baton.engine.platforms.triton_kernels import (
        decode_config as dk,  # host-side arithmetic: no GPU, no triton needed
    )
    cfg = dk.DecodeConfig(min_split_tokens=256, programs_per_sm=4, max_splits=64)
    assert dk.num_splits(1, 8, 4096, 132, cfg) == 16          # 4096 tokens / 256 per split
    assert dk.num_splits(1, 8, 40960, 132, cfg) == 64         # capped
    assert dk.num_splits(2, 8, 40960, 132, cfg) == 33         # 4 programs per SM reached
    assert dk.num_splits(256, 8, 40960, 132, cfg) == 1        # the batch fills the GPU
    assert dk.num_splits(4, 8, 16, 132, cfg) == 1             # nothing to split


# -- prefill --------------------------------------------------------------------------------
@on_gpu
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("with_cache", [False, True], ids=["no-cache", "cache"])
@pytest.mark.parametrize("longest", [1100, 2100])    # below / above the long-prompt tile config
def test_prefill_without_context_matches_reference(case, with_cache, longest):
    dtype, group, dim, bs = case
    batch = make_batch([0, 0, 0, 0], [1, 37, 300, longest], group, dim, bs, dtype, seed=7)
    platform = cuda_platform()
    scale = dim ** -0.5
    ref = batch.upcast()
    expected = CpuPlatform(torch.device("cpu")).prefill_attention(ref.q, ref.k, ref.v, None, None, batch.meta, scale)
    if with_cache:
        platform.store_kv(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
        out = platform.prefill_attention(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, scale)
    else:
        out = platform.prefill_attention(batch.q, batch.k, batch.v, None, None, batch.meta, scale)
    assert_close(out, expected, dtype)


@on_gpu
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("longest", [700, 2100])     # below / above the long-prompt tile config
def test_chunked_and_prefix_cached_prefill_reads_context_from_cache(case, longest):
    from baton.engine.platforms.triton_kernels import prefill_attention as pk
    dtype, group, dim, bs = case
    # a fresh prompt, a one-token chunk, a prefix hit, a long chunk over a long context, a short tail
    batch = make_batch([0, 16, 1000, 3000, 5], [7, 1, 256, longest, 64], group, dim, bs, dtype, seed=11)
    platform = cuda_platform()
    platform.store_kv(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    ref = reference_store(batch)
    scale = dim ** -0.5
    expected = CpuPlatform(torch.device("cpu")).prefill_attention(ref.q, ref.k, ref.v, ref.k_cache, ref.v_cache,
                                                                 batch.meta, scale)
    m = batch.meta
    out = pk.varlen_prefill(batch.q, batch.k, batch.v, m.query_start_loc, m.max_query_len, scale,
                            seq_lens=m.seq_lens, k_cache=batch.k_cache, v_cache=batch.v_cache,
                            block_tables=m.block_tables, out=poisoned(batch.q))
    assert_close(out, expected, dtype)
    assert torch.equal(platform.prefill_attention(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, m, scale),
                       out)


# -- decode under CUDA graphs ---------------------------------------------------------------
@on_gpu
@pytest.mark.parametrize("case", [CASES[0], CASES[5]], ids=case_id)
def test_decode_graph_replay_with_new_seq_lens_matches_eager(case):
    dtype, group, dim, bs = case
    max_len = 8192
    width = max_len // bs
    platform = cuda_platform()
    scale = dim ** -0.5

    def step(contexts, seed):
        b = make_batch(contexts, [1] * len(contexts), group, dim, bs, dtype, pad_rows=1, seed=seed,
                       min_blocks=2 * width)
        tables = torch.full((b.meta.num_seqs, width), -1, dtype=torch.int32, device=DEV)
        tables[:, :b.meta.block_tables.shape[1]] = b.meta.block_tables
        b.meta.block_tables = tables
        return b

    first = step([100, 3000, 0, 7000], seed=1)
    # static buffers, as the graph runner keeps them; the cache tensors are reused in place
    q, k, v = first.q.clone(), first.k.clone(), first.v.clone()
    slots, seq_lens, tables = (first.meta.slot_mapping.clone(), first.meta.seq_lens.clone(),
                               first.meta.block_tables.clone())
    meta = AttnMetadata(True, slots, first.meta.query_start_loc, seq_lens, tables, 1, max_len, True,
                        first.meta.query_start_loc_cpu, first.meta.seq_lens_cpu)
    k_cache, v_cache = first.k_cache, first.v_cache

    def forward():
        platform.store_kv(k, v, k_cache, v_cache, slots)
        return platform.decode_attention(q, k_cache, v_cache, meta, scale)

    forward()                                       # warm-up compiles outside the capture
    platform.synchronize()
    graph, graph_out = platform.capture_graph(forward)

    second = step([4500, 1, 250, 60], seed=2)       # other lengths, other blocks: same shapes
    assert second.k_cache.shape == k_cache.shape
    k_cache.copy_(second.k_cache)
    v_cache.copy_(second.v_cache)
    for dst, src in ((q, second.q), (k, second.k), (v, second.v), (slots, second.meta.slot_mapping),
                     (seq_lens, second.meta.seq_lens), (tables, second.meta.block_tables)):
        dst.copy_(src)
    graph_out.fill_(float("nan"))
    platform.before_replay(graph, second.meta, second.meta.num_seqs)
    graph.replay()
    platform.synchronize()
    replayed = graph_out.clone()
    eager = forward()
    assert torch.equal(replayed, eager)
    ref = reference_store(second)
    expected = CpuPlatform(torch.device("cpu")).decode_attention(ref.q, ref.k_cache, ref.v_cache, second.meta, scale)
    assert_close(replayed, expected, dtype)


# -- fused layer ops ------------------------------------------------------------------------
@on_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(7, 1024), (33, 4, 128), (3, 896)], ids=["hidden", "per-head", "odd-width"])
def test_fused_layer_ops_match_plain_torch(dtype, shape):
    fused, plain = cuda_platform().ops, LayerOps()
    g = torch.Generator().manual_seed(3)
    x, res = (torch.randn(*shape, generator=g).to(dtype).to(DEV) for _ in range(2))
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype).to(DEV)
    tol = {torch.float32: 1e-6, torch.bfloat16: 8e-3}[dtype]
    assert rel_err(fused.rms_norm(x, w, 1e-6), plain.rms_norm(x, w, 1e-6)) < tol
    y, s = fused.add_rms_norm(x, res, w, 1e-6)
    y_ref, s_ref = plain.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(s, s_ref) and rel_err(y, y_ref) < tol
    gate_up = torch.randn(shape[0], 2 * shape[-1], generator=g).to(dtype).to(DEV)
    assert rel_err(fused.silu_and_mul(gate_up), plain.silu_and_mul(gate_up)) < tol


@on_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3-qk-norm", "llama-no-norm"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fused_qk_norm_rotary_matches_plain_torch(dtype, qk_norm, head_dim):
    """Read straight out of a fused qkv row (strided views), as the model calls it."""
    from baton.models.layers.rotary import RotaryEmbedding
    fused, plain = cuda_platform().ops, LayerOps()
    g = torch.Generator().manual_seed(5)
    tokens, hq, hk = 37, 8, 2
    qkv = torch.randn(tokens, (hq + 2 * hk) * head_dim, generator=g).to(dtype).to(DEV)
    q = qkv[:, :hq * head_dim].view(tokens, hq, head_dim)
    k = qkv[:, hq * head_dim:(hq + hk) * head_dim].view(tokens, hk, head_dim)
    rope = RotaryEmbedding(head_dim, 4096, 1e6, None).to(DEV)
    positions = torch.randint(0, 4096, (tokens,), generator=g).to(DEV)
    qw, kw = ((1 + 0.1 * torch.randn(head_dim, generator=g)).to(dtype).to(DEV) for _ in range(2))
    weights = (qw, kw) if qk_norm else (None, None)
    q1, k1 = fused.qk_norm_rotary(q, k, *weights, 1e-6, rope.cos, rope.sin, positions)
    q0, k0 = plain.qk_norm_rotary(q, k, *weights, 1e-6, rope.cos, rope.sin, positions)
    tol = {torch.float32: 1e-6, torch.bfloat16: 8e-3}[dtype]
    assert q1.is_contiguous() and not q1.isnan().any() and not k1.isnan().any()
    assert rel_err(q1, q0) < tol and rel_err(k1, k0) < tol


@pytest.mark.device
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (tensor parallelism)")
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_tp2_gives_the_tp1_greedy_tokens_on_the_qwen3_0_6b_preset(eager):
    """Real checkpoint shapes (random weights), fp32 so reduction order cannot flip a token."""
    from baton.engine import LLM, SamplingParams
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 151_000, (n,), generator=g).tolist() for n in (9, 200, 700)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for tp in (1, 2):
        llm = LLM("qwen3-0.6b", device="cuda:0", dtype="float32", tp_size=tp, max_num_seqs=8, tokenizer=TOKENIZER,
                  max_model_len=1024, kv_cache_memory=2 << 30, enforce_eager=eager)
        try:
            outs[tp] = [o.token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.engine.runner.close()
        del llm
        torch.cuda.empty_cache()
    assert outs[2] == outs[1]


# -- device-direct KV over NCCL (issue 5) ---------------------------------------------------------
@pytest.mark.device
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU visible to torch")
def test_streamed_pieces_pack_and_unpack_on_the_gpu_bit_exact():
    """What a streamed transfer does to the bytes: pieces packed on the device (block indices
    uploaded without a device wait) and unpacked piece by piece into other blocks."""
    from baton.engine.runner.kv_blocks import Pieces, pack_blocks_on_device, unpack_blocks
    kv = torch.randn(3, 2, 40, 16, 4, 64, device="cuda").to(torch.bfloat16)
    src, into = [37, 2, 19, 5, 8, 30, 11], [0, 1, 2, 3, 4, 5, 6]
    parts, first = [], 0
    for n in (3, 1, 3):
        parts.append((first, n, pack_blocks_on_device(kv, src[first:first + n])))
        first += n
    dst = torch.zeros_like(kv)
    unpack_blocks(dst, into, Pieces(tuple(parts)))
    assert torch.equal(dst[:, :, into], kv[:, :, src])


@pytest.mark.device
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU visible to torch")
def test_the_kv_pack_kernel_matches_the_torch_path_on_the_gpu():
    """triton_kernels/kv_pack.py natively: the same bytes and checksum sums as the CPU's copy-then-read."""
    from test_kv_integrity import check_kv_pack_kernel
    check_kv_pack_kernel("cuda")


@pytest.mark.device
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU visible to torch")
def test_a_proven_transfer_between_two_cuda_engines_decodes_like_one_and_refuses_a_flipped_byte():
    """KVCache.pack / land on the CUDA platform (the sums in the copies' pass), --kv-checksum on: a clean
    payload in pieces joins and decodes what a colocated engine does; a flipped byte is refused, blocks freed."""
    import test_kv_integrity as ki

    from baton.engine import LLMEngine
    from baton.engine.config import EngineConfig
    from baton.engine.runner.kv_blocks import Pieces
    config = dict(model="tiny-llama", num_kv_blocks=32, max_num_batched_tokens=16, device="cuda:0", kv_checksum="on",
                  tokenizer=TOKENIZER)
    prefill = LLMEngine(EngineConfig(**config), handoff=ki.Hook())
    decode = LLMEngine(EngineConfig(**config), handoff=ki.Hook())
    unrefs, unref = collections.Counter(), decode.block_manager._unref
    decode.block_manager._unref = lambda b: unrefs.update([b]) or unref(b)
    prompt = ki.fresh_prompt()
    payload, first, meta = ki.prefilled(prefill, prompt, "e1")
    assert len(payload.parts) > 1 and payload.parts[0][2].is_cuda
    outs, ticket = ki.decoded(decode, "a", prompt, "e1", payload, first, meta)
    assert ticket.refused is None
    assert [t for out in outs for t in out.new_token_ids] == ki.colocated(prefill, prompt)
    unrefs.clear()
    prefill.handoff = ki.Hook()
    payload, first, meta = ki.prefilled(prefill, ki.fresh_prompt(), "e1")
    first_block, n, data = payload.parts[1]
    spoiled = data.clone()
    spoiled[spoiled.numel() // 3] ^= 0x10
    payload = Pieces((payload.parts[0], (first_block, n, spoiled), *payload.parts[2:]))
    outs, ticket = ki.decoded(decode, "b", ki.fresh_prompt(), "e1", payload, first, meta)
    ki.assert_refused(outs, ticket, unrefs, "corrupt")


@pytest.mark.device
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU visible to torch")
def test_the_nccl_binding_moves_bytes_and_aborts():
    """kvtransfer.nccl, the direct KV backend's NCCL calls, on one GPU: a one-rank communicator
    sends 72 MiB to itself (one group), then is aborted and refuses more work."""
    from baton.kvtransfer.direct_backend import nccl
    comm = nccl.Communicator(nccl.unique_id(), 0, 1)
    stream = torch.cuda.Stream(priority=-1)
    src = (torch.arange(72 << 20, device="cuda") % 251).to(torch.uint8)
    dst = torch.zeros_like(src)
    torch.cuda.synchronize()
    with comm.group():
        comm.send(src, 0, stream)
        comm.recv(dst, 0, stream)
    stream.synchronize()
    assert torch.equal(src, dst)
    comm.abort()
    with pytest.raises(RuntimeError, match="aborted"):
        comm.send(src, 0, stream)


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (device-direct KV)")


@pytest.mark.device
@two_gpus
def test_direct_kv_over_nccl_is_bit_exact_between_two_gpus():
    from baton.benchmarks.kv_loopback import measure_direct
    r = measure_direct(64 << 20, "cuda:0", "cuda:1", repeats=3, overlap=False)   # checks the bytes itself
    assert r["collective"] == "nccl" and len(r["seconds"]) == 3
    assert "called directly" in r["communicator"]      # not through ProcessGroupNCCL


@pytest.mark.device
@two_gpus
def test_a_stalled_nccl_transfer_fails_frees_staging_aborts_the_pair_and_the_next_one_works(monkeypatch):
    import asyncio

    from baton.benchmarks.kv_loopback import direct_loopback
    from baton.kvtransfer.backend import KVTransferError, TransferDescriptor
    from baton.kvtransfer.direct_backend import receiver as direct_receiver

    monkeypatch.setattr(direct_receiver, "DRAIN_S", 2.0)     # the bytes never come: the pair closes 2 s on

    n = 8 << 20
    payload = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:0")

    async def main():
        landed, failed = {}, {}
        async with direct_loopback("cuda:0", "cuda:1") as (pending, sender, receiver):
            pending.expect("stalled", n, 2.0, lambda t, p, *_: landed.__setitem__(t, p),
                           lambda t, why: failed.__setitem__(t, why))
            sender.stall_s = 60
            with pytest.raises(KVTransferError):
                await sender.send(TransferDescriptor("stalled", nbytes=n), payload, 1, timeout=20)
            sender.stall_s = 0
            pairs_after_stall = len(receiver.pairs)
            pending.expect("after", n, 30, lambda t, p, *_: landed.__setitem__(t, p),
                           lambda t, why: failed.__setitem__(t, why))
            await sender.send(TransferDescriptor("after", nbytes=n), payload, 2, timeout=30)
            return landed, failed, pairs_after_stall, pending.stats()
    landed, failed, pairs_after_stall, stats = asyncio.run(main())
    assert "stalled" in failed and pairs_after_stall == 0
    assert torch.equal(landed["after"].cpu(), payload.cpu())
    assert stats.active == 0 and stats.staged_bytes == 0


@pytest.mark.device
@two_gpus
def test_1p1d_over_nccl_gives_the_colocated_engines_greedy_tokens(tmp_path):
    """Prefill on cuda:0, decode on cuda:1, KV device to device, streamed chunk by chunk (a
    32-token prefill budget splits the long prompt); fp32 so batching cannot flip a token."""
    import concurrent.futures as cf

    from cluster import Cluster

    from baton.engine import LLM, SamplingParams
    from baton.v1 import router_pb2
    prompts = ["The quick brown fox", "def quicksort(arr):", "Once upon a time there was a dragon who loved tea",
               "Summarize: " + "the river rose over the old stone bridge while the village slept, " * 6]
    common = ["--model", "qwen3-0.6b", "--dtype", "float32", "--kv-backend", "direct", "--num-kv-blocks", "512"]
    llm = LLM("qwen3-0.6b", device="cuda:0", dtype="float32", max_num_seqs=8, kv_cache_memory=1 << 30,
              tokenizer=TOKENIZER)
    want = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))]
    del llm
    torch.cuda.empty_cache()
    c = Cluster.launch(tmp_path, prefill=1, decode=1, worker_args=common, router_args=["--model", "qwen3-0.6b"],
                       extra={"prefill-0": ["--device", "cuda:0", "--max-num-batched-tokens", "32"],
                              "decode-0": ["--device", "cuda:1"]})
    try:
        stub = c.stub()
        sampling = router_pb2.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: [t for r in stub.Generate(router_pb2.GenerateRequest(
                text=p, sampling=sampling), timeout=300) for t in r.token_ids], prompts))
        assert got == want
        assert c.wait_workers_idle() == 0
    finally:
        c.stop()


@pytest.mark.device
@pytest.mark.skipif(not (HAS_GPU and HAS_TRITON), reason="needs a CUDA GPU and triton")
def test_the_one_pass_sampler_draws_what_the_torch_sampler_draws():
    """Seeded rows: the fused Gumbel-max kernel and the torch exponential race make the same
    draw from the same hashed noise (all but float near-ties); greedy rows take the argmax;
    unseeded rows follow softmax(logits / T); a seeded row's draw ignores its batch neighbours."""
    from baton.engine.platforms.triton_kernels.sampling import sample
    from baton.engine.runner.sampler import Sampler, SamplingBatch
    g = torch.Generator(device="cuda").manual_seed(0)
    n, vocab = 512, 151936
    logits = (torch.randn(n, vocab, device="cuda", generator=g) * 3).to(torch.bfloat16)
    temps = torch.where(torch.arange(n, device="cuda") % 8 == 0, 0.0, 0.7).float()
    seeds = torch.arange(n, device="cuda", dtype=torch.int64) * 7919 + 3
    has_seed = torch.ones(n, dtype=torch.bool, device="cuda")
    positions = torch.arange(n, device="cuda", dtype=torch.int64) + 100
    batch = SamplingBatch(temps, torch.zeros(n, dtype=torch.int64, device="cuda"), torch.ones(n, device="cuda"),
                          seeds, has_seed, positions, all_greedy=False, any_greedy=True, any_top_k=False,
                          any_top_p=False, any_seed=True)
    want = Sampler()(logits, batch)
    got = sample(logits, temps, seeds, has_seed, positions, step_seed=1)
    agree = (want == got).float().mean().item()
    assert agree >= 0.99, agree
    greedy = temps == 0
    assert torch.equal(got[greedy], logits[greedy].argmax(-1))
    alone = sample(logits[5:6], temps[5:6], seeds[5:6], has_seed[5:6], positions[5:6], step_seed=9)
    assert alone.item() == got[5].item()
    # unseeded: frequencies over a small vocabulary follow the distribution
    small = torch.tensor([[2.0, 1.0, 0.0, -1.0]], device="cuda").repeat(20000, 1)
    t = torch.full((20000,), 1.0, device="cuda")
    draws = sample(small, t, torch.zeros(20000, dtype=torch.int64, device="cuda"),
                   torch.zeros(20000, dtype=torch.bool, device="cuda"), torch.zeros(20000, dtype=torch.int64,
                                                                                   device="cuda"), step_seed=5)
    freq = torch.bincount(draws, minlength=4).float() / 20000
    assert torch.allclose(freq, torch.softmax(small[0], -1), atol=0.015), freq


@pytest.mark.device
@pytest.mark.skipif(not (HAS_GPU and HAS_TRITON), reason="needs a CUDA GPU and triton")
def test_the_one_pass_sampler_reads_a_token_bitmask_as_the_masked_logits():
    """Structured output's mask read inside the sampling kernel draws exactly what the kernel draws
    from logits masked first (engine/runner/logits_processing.apply_token_bitmask), greedy rows included,
    and never a disallowed token; a row of one allowed token draws it."""
    from baton.engine.platforms.triton_kernels.sampling import sample
    from baton.engine.runner.logits_processing import apply_token_bitmask
    g = torch.Generator(device="cuda").manual_seed(1)
    n, vocab = 64, 151936
    words = (vocab + 31) // 32
    logits = (torch.randn(n, vocab, device="cuda", generator=g) * 3).to(torch.bfloat16)
    bits = torch.rand(n, words * 32, device="cuda", generator=g) < 0.02
    bits[3] = False
    bits[3, 12345] = True
    packed = (bits.view(n, words, 32).int() << torch.arange(32, device="cuda", dtype=torch.int32)).sum(-1)
    mask = packed.to(torch.int64).where(packed < 2 ** 31, packed.to(torch.int64) - 2 ** 32).to(torch.int32)
    temps = torch.where(torch.arange(n, device="cuda") % 4 == 0, 0.0, 1.0).float()
    seeds = torch.arange(n, device="cuda", dtype=torch.int64) + 11
    has_seed = torch.arange(n, device="cuda") % 2 == 0
    positions = torch.arange(n, device="cuda", dtype=torch.int64)
    got = sample(logits, temps, seeds, has_seed, positions, 7, mask)
    want = sample(apply_token_bitmask(logits, mask), temps, seeds, has_seed, positions, 7)
    assert torch.equal(got, want)
    assert bits[torch.arange(n, device="cuda"), got].all()
    assert got[3].item() == 12345


# -- fused MoE experts (issue 21) -------------------------------------------------------------
# (tokens, experts, top_k, hidden, intermediate): each tile bucket of pick_tiles, T=1, an
# intermediate size that is no power of two, experts no token picks, and both alignments (one
# Triton program up to ONE_PROGRAM_ALIGN_MAX_PAIRS pairs, three launches over chunks of pairs above)
MOE_CASES = [(1, 16, 4, 128, 64), (5, 8, 2, 64, 32), (37, 16, 4, 128, 96), (300, 8, 2, 256, 128),
             (600, 8, 2, 128, 64), (2500, 8, 2, 128, 64)]


def moe_inputs(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype, seed: int):
    """Random x, weights and a top-k routing that never picks the first and the last expert."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype).to(DEV)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype).to(DEV)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5).to(dtype).to(DEV)
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, [0, experts - 1]] = -1e9
    ids, weights = LayerOps().moe_route(logits, top_k, renormalize=True)
    return x, w13, w2, ids.to(DEV), weights.to(dtype).to(DEV)


@on_gpu
@pytest.mark.parametrize("shape", [(1, 16, 4, True), (37, 128, 8, True), (300, 60, 6, True), (5, 8, 3, False)],
                         ids=lambda s: "T{}-E{}-k{}-{}".format(*s))
def test_moe_routing_in_one_kernel_picks_what_torch_picks(shape):
    """The CUDA platform's gating (moe_routing.route: softmax, top-k and renormalisation in one program a
    token) against the base ops' torch gating on the same logits (float32: no ties, whose order torch
    leaves open): the same experts in the same order, weights within float32 rounding; a graph replay
    on new logits gives eager's."""
    from baton.engine.platforms.triton_kernels import moe_routing
    t, e, k, renormalize = shape
    g = torch.Generator().manual_seed(t)
    logits = (torch.randn(t, e, generator=g) * 3).to(DEV)
    logits[:, 0] = -1e4                                  # an expert no token picks
    ids, weights = cuda_platform().ops.moe_route(logits, k, renormalize)
    want_ids, want_weights = LayerOps().moe_route(logits, k, renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32 and ids.shape == (t, k)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)
    graph, (g_ids, g_weights) = cuda_platform().capture_graph(lambda: moe_routing.route(logits, k, renormalize))
    logits.copy_((torch.randn(t, e, generator=g) * 3).to(DEV))
    graph.replay()
    torch.cuda.synchronize()
    e_ids, e_weights = moe_routing.route(logits, k, renormalize)
    assert torch.equal(g_ids, e_ids) and torch.equal(g_weights, e_weights)


def moe_reference(x, w13, w2, ids, weights) -> torch.Tensor:
    """The base (host-grouped) moe_experts in float64 on upcast copies."""
    d = torch.float64
    return LayerOps().moe_experts(x.to(d), w13.to(d), w2.to(d), ids, weights.to(d))


@on_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", MOE_CASES, ids=lambda c: "T{}-E{}-k{}-H{}-I{}".format(*c))
def test_fused_moe_experts_match_the_base_ops(dtype, case):
    x, w13, w2, ids, weights = moe_inputs(*case, dtype, seed=case[0])
    ops = cuda_platform().ops
    assert ops.moe_graph_safe and not LayerOps.moe_graph_safe
    out = ops.moe_experts(x, w13, w2, ids, weights)
    assert out.shape == x.shape and out.dtype == dtype
    assert_close(out, moe_reference(x, w13, w2, ids, weights), dtype)
    assert torch.equal(ops.moe_experts(x, w13, w2, ids, weights), out)       # deterministic


@on_gpu
@pytest.mark.parametrize("tokens,experts,top_k,block_m", [(1, 128, 8, 16), (64, 128, 8, 16), (300, 8, 2, 64),
                                                         (100, 128, 8, 16)])
def test_moe_one_program_alignment_equals_the_torch_alignment(tokens, experts, top_k, block_m):
    from baton.engine.platforms.triton_kernels.moe_align import align_by_expert
    from baton.engine.platforms.triton_kernels.moe_routing import _align_one_program
    g = torch.Generator().manual_seed(tokens)
    ids = torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1).indices.to(DEV)
    ids[: tokens // 2, 0] = 1                                       # one crowded expert
    fast, plain = _align_one_program(ids, experts, block_m), align_by_expert(ids, experts, block_m)
    assert torch.equal(fast.sorted_slots, plain.sorted_slots)
    assert torch.equal(fast.block_expert, plain.block_expert)


@on_gpu
@pytest.mark.parametrize("tokens,experts,top_k,block_m", [(129, 128, 8, 32), (600, 128, 8, 128), (2500, 8, 2, 64),
                                                         (4096, 128, 8, 16), (20, 8, 2, 16), (17, 128, 8, 16)])
def test_moe_chunked_alignment_equals_the_torch_alignment(tokens, experts, top_k, block_m):
    """The alignment above ONE_PROGRAM_ALIGN_MAX_PAIRS (three launches over chunks of pairs): the
    torch alignment's rows and owners exactly, also across chunk borders and with a crowded expert."""
    from baton.engine.platforms.triton_kernels.moe import ONE_PROGRAM_ALIGN_MAX_PAIRS, _align_chunked, align
    from baton.engine.platforms.triton_kernels.moe_align import align_by_expert
    g = torch.Generator().manual_seed(tokens)
    ids = torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1).indices.to(DEV)
    ids[: tokens // 2, 0] = 1
    plain = align_by_expert(ids, experts, block_m)
    fasts = [_align_chunked(ids, experts, block_m)]
    if tokens * top_k > ONE_PROGRAM_ALIGN_MAX_PAIRS:
        fasts.append(align(ids, experts, block_m))
    for fast in fasts:
        assert torch.equal(fast.sorted_slots, plain.sorted_slots)
        assert torch.equal(fast.block_expert, plain.block_expert)


@on_gpu
def test_fused_moe_replays_from_a_graph_with_new_routing():
    """Captured once, replayed on other tokens and another routing (other experts hit, other
    group sizes): the same result as an eager call, and right against the reference."""
    from baton.engine.platforms.triton_kernels.moe import fused_experts
    shape = (48, 16, 4, 128, 64)
    x, w13, w2, ids, weights = moe_inputs(*shape, torch.bfloat16, seed=1)
    fused_experts(x, w13, w2, ids, weights)                         # compile outside the capture
    torch.cuda.synchronize()
    graph, out = cuda_platform().capture_graph(lambda: fused_experts(x, w13, w2, ids, weights))
    x2, _, _, ids2, weights2 = moe_inputs(*shape, torch.bfloat16, seed=2)
    ids2[:24] = 3                                                   # a crowded expert: several blocks
    ids2[:24, 1:] = torch.tensor([4, 5, 6], device=DEV)
    for dst, src in ((x, x2), (ids, ids2), (weights, weights2)):
        dst.copy_(src)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fused_experts(x, w13, w2, ids, weights))
    assert_close(out, moe_reference(x, w13, w2, ids, weights), torch.bfloat16)


@on_gpu
def test_qwen3_moe_decode_under_graphs_gives_the_eager_tokens():
    """The tiny Qwen3-MoE preset (a dense layer between sparse ones) in fp32: decode replayed from
    CUDA graphs (the fused experts captured) gives the greedy tokens of eager decode."""
    from baton.engine import LLM, SamplingParams
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (1, 9, 40, 3, 17)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = LLM("tiny-qwen3-moe", device="cuda:0", dtype="float32", max_num_seqs=8, tokenizer=TOKENIZER,
                  max_model_len=512, num_kv_blocks=128, enforce_eager=eager)
        assert (llm.engine.runner.graphs is None) == eager
        outs[eager] = [o.token_ids for o in llm.generate(prompts, params)]
        del llm
        torch.cuda.empty_cache()
    assert outs[False] == outs[True]


# -- FP8 experts (--quantization fp8): e4m3 stacks, scales per (expert, output channel), bf16 activations --
def fp8_experts(w13: torch.Tensor, w2: torch.Tensor):
    from baton.models.layers.quantization import ExpertScales, quantize_stacked
    q13, s13 = quantize_stacked(w13)
    q2, s2 = quantize_stacked(w2)
    return q13, q2, ExpertScales(s13, s2)


@on_gpu
@pytest.mark.parametrize("case", MOE_CASES, ids=lambda c: "T{}-E{}-k{}-H{}-I{}".format(*c))
def test_fused_moe_with_fp8_experts_matches_the_base_ops_on_widened_weights(case):
    """The kernels read e4m3 weights, widen them in registers and scale the sums per output
    channel: the base ops' numbers (float64, the same e4m3 weights and scales), in every tile
    bucket, deterministic; and half-quantized stacks or missing scales are refused. (Weight-only
    forced: the rule picks FP8 x FP8 for the larger cases, whose own test follows.)"""
    from baton.engine.platforms.triton_kernels.moe import fused_experts
    x, w13, w2, ids, weights = moe_inputs(*case, torch.bfloat16, seed=case[0])
    q13, q2, scales = fp8_experts(w13, w2)
    ops = cuda_platform().ops
    out = ops.moe_experts(x, q13, q2, ids, weights, scales=scales, fp8_dots=False)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    d = torch.float64
    ref = LayerOps().moe_experts(x.to(d), q13, q2, ids, weights.to(d), scales=scales, fp8_dots=False)
    assert_close(out, ref, torch.bfloat16)
    assert torch.equal(ops.moe_experts(x, q13, q2, ids, weights, scales=scales, fp8_dots=False), out)
    with pytest.raises(ValueError, match="need both stacks in e4m3 and their scales"):
        fused_experts(x, q13, q2, ids, weights)
    with pytest.raises(ValueError, match="need both stacks in e4m3 and their scales"):
        fused_experts(x, q13, w2, ids, weights, scales=scales)


def replayed_fp8_experts(shape, crowd: bool = False, fp8_dots=None):
    """(a capture of the FP8-experts step on seed-1 inputs, replayed on seed-2 tokens and routing;
    eager's result on those). `crowd`: the first 200 tokens routed to two experts (several blocks
    each); `fp8_dots`: the path eager is forced to (None: the rule's pick)."""
    from baton.engine.platforms.triton_kernels.moe import fused_experts
    x, w13, w2, ids, weights = moe_inputs(*shape, torch.bfloat16, seed=1)
    q13, q2, scales = fp8_experts(w13, w2)
    fused_experts(x, q13, q2, ids, weights, scales=scales)
    torch.cuda.synchronize()
    graph, out = cuda_platform().capture_graph(lambda: fused_experts(x, q13, q2, ids, weights, scales=scales))
    x2, _, _, ids2, weights2 = moe_inputs(*shape, torch.bfloat16, seed=2)
    if crowd:
        ids2[:200] = torch.tensor([3, 4], device=DEV)
    for dst, src in ((x, x2), (ids, ids2), (weights, weights2)):
        dst.copy_(src)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return out, fused_experts(x, q13, q2, ids, weights, scales=scales, fp8_dots=fp8_dots)


@on_gpu
def test_fused_moe_with_fp8_experts_replays_from_a_graph_with_new_routing():
    shape = (48, 16, 4, 128, 64)
    out, eager = replayed_fp8_experts(shape)
    assert torch.equal(out, eager)


# -- FP8 x FP8 expert dots (prefill sizes: activations quantized per token, e4m3 x e4m3 tl.dot) --
@on_gpu
@pytest.mark.parametrize("case", MOE_CASES, ids=lambda c: "T{}-E{}-k{}-H{}-I{}".format(*c))
def test_fused_moe_with_fp8_dots_matches_float64_on_the_same_roundings(case):
    """FP8 x FP8 forced in every tile bucket (FP8 tiles; the rule would pick weight-only below 24
    pairs an expert): within bf16's 1e-2 (relative L2) of a float64 mirror that rounds where the
    kernels do (helpers.fp8_expert_dots_mirror), and within 2.5e-2 of the base ops' FP8 x FP8 in
    float64 (which quantize the SiLU product unrounded: e4m3 steps flip where the kernel's bf16
    copy of it crosses a rounding midpoint; ~1e-2 on the CPU's emulation), where weight-only is
    3-5e-2 away. The default follows quantization.fp8_expert_dots; deterministic."""
    from helpers import fp8_expert_dots_mirror

    from baton.engine.platforms.triton_kernels.moe import fused_experts
    from baton.models.layers.quantization import fp8_expert_dots
    x, w13, w2, ids, weights = moe_inputs(*case, torch.bfloat16, seed=case[0])
    q13, q2, scales = fp8_experts(w13, w2)
    out = fused_experts(x, q13, q2, ids, weights, scales=scales, fp8_dots=True)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert_close(out, fp8_expert_dots_mirror(x, q13, q2, ids, weights, scales), torch.bfloat16)
    d = torch.float64
    base = LayerOps().moe_experts(x.to(d), q13, q2, ids, weights.to(d), scales=scales, fp8_dots=True)
    weight_only = LayerOps().moe_experts(x.to(d), q13, q2, ids, weights.to(d), scales=scales, fp8_dots=False)
    err, apart = rel_err(out, base), rel_err(weight_only, base)
    print(f"[fp8-dots] {case}: {rel_err(out, fp8_expert_dots_mirror(x, q13, q2, ids, weights, scales)):.1e} "
          f"from the mirror, {err:.1e} from the base ops (weight-only: {apart:.1e})")
    assert err < 2.5e-2 and err < 0.6 * apart, (err, apart)
    assert torch.equal(fused_experts(x, q13, q2, ids, weights, scales=scales, fp8_dots=True), out)
    by_rule = fp8_expert_dots(ids.numel(), case[1])
    assert torch.equal(cuda_platform().ops.moe_experts(x, q13, q2, ids, weights, scales=scales),
                       fused_experts(x, q13, q2, ids, weights, scales=scales, fp8_dots=by_rule))


@on_gpu
def test_fused_moe_with_fp8_dots_replays_from_a_graph_with_new_routing(monkeypatch):
    """A prefill-sized step (100 pairs an expert: the rule, at its meant bound of 24, picks FP8 x
    FP8) captured once, replayed on other tokens and routing: eager's result exactly (the two row
    quantizers captured too)."""
    from baton.models.layers import quantization
    monkeypatch.setattr(quantization, "FP8_EXPERT_DOTS_ABOVE", 24)
    shape = (400, 8, 2, 128, 64)
    assert quantization.fp8_expert_dots(400 * 2, 8)
    out, eager = replayed_fp8_experts(shape, crowd=True, fp8_dots=True)
    assert torch.equal(out, eager)


@on_gpu
def test_fused_moe_with_swapped_fp8_dots_replays_from_a_graph_with_new_routing(monkeypatch):
    """A decode-sized step (3 pairs an expert) with the rule on for every size: the swapped FP8 x FP8
    kernels (the weights as wgmma's A), captured once, replayed on other tokens and routing: eager's
    result exactly."""
    from baton.engine.platforms.triton_kernels.moe import pick_tiles
    from baton.models.layers import quantization
    monkeypatch.setattr(quantization, "FP8_EXPERT_DOTS_ABOVE", 0)
    shape = (24, 16, 2, 128, 64)
    assert quantization.fp8_expert_dots(24 * 2, 16) and pick_tiles(24 * 2, 16, 128, 64, quantization.FP8).swap
    out, eager = replayed_fp8_experts(shape, fp8_dots=True)
    assert torch.equal(out, eager)


@on_gpu
@pytest.mark.parametrize("dots_above", [None, 24, 0], ids=["weight-only", "fp8-dots-above-24", "fp8-dots-always"])
def test_qwen3_moe_with_fp8_experts_under_graphs_gives_the_eager_tokens_and_tracks_the_cpu(tmp_path, monkeypatch,
                                                                                           dots_above):
    """A tiny Qwen3-MoE checkpoint with --quantization fp8 on cuda:0 in bf16: captured decode (the
    e4m3 experts inside) gives eager's greedy tokens, and the prompt's logprobs stay near the CPU's
    FP8 run of the same weights. (A checkpoint, not a preset: a preset's random weights come from
    the device's own generator, so cuda:0 and the CPU would hold different models.) Both with the
    default rule and with FP8 x FP8 dots above 24 pairs an expert (the prefill step's)."""
    from helpers import save_tiny_checkpoint

    from baton.engine import LLM, SamplingParams
    from baton.models.layers import quantization
    from baton.models.source import resolve_model
    monkeypatch.setattr(quantization, "FP8_EXPERT_DOTS_ABOVE", dots_above)
    path = str(save_tiny_checkpoint("qwen3_moe", tmp_path / "moe", TOKENIZER or resolve_model(None).tokenizer_path,
                                    seed=3))
    g = torch.Generator().manual_seed(6)
    # (the prefill step's 187 tokens route 47 pairs an expert: FP8 x FP8 dots above 24, on both devices)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (1, 9, 40, 17, 120)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=0)
    kw = dict(dtype="bfloat16", max_num_seqs=8, max_model_len=256, num_kv_blocks=64, quantization="fp8")
    outs = {}
    for eager in (True, False):
        llm = LLM(path, device="cuda:0", enforce_eager=eager, **kw)
        assert (llm.engine.runner.graphs is None) == eager
        assert llm.engine.runner.model.model.layers[0].mlp.experts.w13.dtype == torch.float8_e4m3fn
        outs[eager] = llm.generate(prompts, sp)
        del llm
        torch.cuda.empty_cache()
    assert [o.token_ids for o in outs[False]] == [o.token_ids for o in outs[True]]
    cpu = LLM(path, **kw).generate(prompts, sp)
    for x, y in list(zip(outs[False], cpu, strict=True))[1:]:       # (the 1-token prompt has no logprobs to compare)
        lx = torch.tensor([e.logprob for e in x.prompt_logprobs[1:]])
        ly = torch.tensor([e.logprob for e in y.prompt_logprobs[1:]])
        assert float((lx - ly).abs().mean()) < 0.1


@pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU visible to torch")
def test_the_capture_stream_sees_what_the_current_stream_queued_before_it():
    """Prefill graphs are captured on a side stream over buffers zeroed on the current stream just
    before. The side stream must wait for that work: here the current stream sleeps ~0.5 s before it
    fills the buffer, and the side stream's first read must still see the fill."""
    platform = CudaPlatform(torch.device("cuda:0"))
    torch.cuda.Stream("cuda:0")                 # the stream pool made now, not inside the timed part
    x = torch.zeros(1 << 16, dtype=torch.int64, device="cuda:0")
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)           # ~0.5 s of a busy current stream
    x.fill_(7)
    with platform.capture_stream():
        seen = x.clone()
    torch.cuda.synchronize()
    assert bool((seen == 7).all())
