"""Prefill and mixed steps replayed piecewise (engine/runner/prefill_graphs.py).

On the CPU: the bucket ladder, and the seam it cuts at (every attention call of a decoder model goes
through `ForwardContext.pieces`, in layer order, and attending there changes nothing). On a GPU: the
replayed forward against eager, bit for bit at a bucket's own size and within rounding below it, in
bf16 with FP8 weights and KV; and greedy tokens with and without the graphs.
"""
from __future__ import annotations

import torch

from baton.engine.runner.prefill_graphs import SMALLEST, buckets
from baton.models.forward_context import ForwardContext
from tests.test_platform_cuda import TOKENIZER, on_gpu


def test_buckets_cover_every_step_size_with_little_padding():
    for budget in (256, 1000, 4096, 8192, 16384):
        ladder = buckets(budget)
        assert ladder == sorted(set(ladder)) and ladder[0] == min(SMALLEST, budget) and ladder[-1] == budget
        for t in range(1025, budget + 1, 97):
            n = next(b for b in ladder if b >= t)
            assert n - t < (t / 4 if t <= 2048 else t / 8), (budget, t, n)
    assert buckets(4096) == list(range(256, 4097, 256))
    assert buckets(5000)[-3:] == [4096, 4608, 5000] and buckets(9000)[-3:] == [7680, 8192, 9000]


class _Recorder:
    """What PrefillGraphs' capturing pass is to the model, without the captures."""

    def __init__(self):
        self.layers = []

    def attend(self, ctx, layer_idx, q, k, v):
        self.layers.append(layer_idx)
        return ctx.attend_now(layer_idx, q, k, v)


def test_every_attention_call_reaches_the_pieces_in_layer_order():
    from baton.engine import LLM
    llm = LLM("tiny-qwen3-moe", device="cpu", dtype="float32", max_num_seqs=2, max_model_len=64, num_kv_blocks=16,
              tokenizer=TOKENIZER)
    r = llm.engine.runner
    assert r.prefill_graphs is None                  # the CPU captures nothing
    t = 11
    ids = torch.randint(3, 1000, (t,), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(t)
    outs = []
    for pieces in (None, _Recorder()):
        meta = r.dummy_prompt(t)[2]
        ctx = ForwardContext(meta, r.kv_caches, r.attention, r.scale, r.kv_scales, pieces=pieces)
        outs.append(r.model(ids, pos, ctx))
    assert pieces.layers == list(range(r.model.num_layers))
    assert torch.equal(outs[0], outs[1])


@on_gpu
def test_replayed_prefill_matches_eager_with_fp8_weights_and_kv():
    """tiny-qwen3-moe in bf16, FP8 weights and experts, FP8 KV: at a bucket's size the pieces replay
    eager's kernels on eager's shapes (equal); below it the padded GEMMs may tile otherwise (close)."""
    from baton.engine import LLM
    llm = LLM("tiny-qwen3-moe", device="cuda:0", dtype="bfloat16", quantization="fp8", kv_cache_dtype="fp8",
              max_num_seqs=8, max_num_batched_tokens=1024, tokenizer=TOKENIZER, max_model_len=2048,
              num_kv_blocks=256)
    r = llm.engine.runner
    pg = r.prefill_graphs
    assert pg is not None and pg.buckets == [256, 512, 768, 1024]
    assert len(pg.pieces[1024].graphs) == r.model.num_layers + 1
    g = torch.Generator().manual_seed(3)
    for t in (1024, 512, 700, 300):
        ids = torch.randint(3, 49152, (t,), generator=g).to("cuda:0")
        pos = torch.arange(t, device="cuda:0")
        meta = r.dummy_prompt(t)[2]
        eager = r.model(ids, pos, ForwardContext(meta, r.kv_caches, r.attention, r.scale, r.kv_scales)).clone()
        replayed = pg.run(ids, pos, ForwardContext(meta, r.kv_caches, r.attention, r.scale, r.kv_scales)).clone()
        assert replayed.shape == eager.shape
        if t in pg.buckets:
            assert torch.equal(replayed, eager), t
        else:
            err = ((replayed.float() - eager.float()).norm() / eager.float().norm()).item()
            assert err < 2e-2, (t, err)
    del llm
    torch.cuda.empty_cache()


@on_gpu
def test_greedy_tokens_with_prefill_graphs_are_eagers(monkeypatch):
    """fp32 tiny-qwen3-moe: prompts long enough for prefill-kind steps (chunked at 512 tokens, some
    with decode rows beside them) give the same greedy tokens replayed as eager, and they did replay."""
    from baton.engine import LLM, SamplingParams
    from baton.engine.runner.prefill_graphs import PrefillGraphs
    replays = []
    run = PrefillGraphs.run
    monkeypatch.setattr(PrefillGraphs, "run", lambda self, ids, *a: replays.append(ids.shape[0]) or run(self, ids, *a))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (300, 9, 1200, 700, 40)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = {}
    for graphs in (False, True):
        llm = LLM("tiny-qwen3-moe", device="cuda:0", dtype="float32", max_num_seqs=8, tokenizer=TOKENIZER,
                  max_num_batched_tokens=512, max_model_len=2048, num_kv_blocks=256, prefill_graphs=graphs)
        assert (llm.engine.runner.prefill_graphs is None) != graphs
        outs[graphs] = [o.token_ids for o in llm.generate(prompts, params)]
        del llm
        torch.cuda.empty_cache()
    assert replays and max(replays) == 512
    assert outs[True] == outs[False]
