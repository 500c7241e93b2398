"""The offline engine on real weights: greedy parity with transformers, every scheduling
path gives the same tokens, and bad input is refused without harming the engine."""
from __future__ import annotations

import itertools
import os
import weakref

import pytest
import torch
from helpers import Hook, hf_greedy, save_tiny_checkpoint

from baton.engine import LLM, SamplingParams

GREEDY32 = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

PLAIN_PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
    "La capitale de la France est",
    "東京は日本の",
    "1, 2, 3, 4,",
]
CHATS = [
    [{"role": "user", "content": "Write a haiku about autumn."}],
    [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Wie spät ist es in Berlin, wenn es in New York Mittag ist?"}],
]


@pytest.fixture(scope="module")
def prompt_ids(embedded_llm):
    tok = embedded_llm.tokenizer
    plain = [tok(p)["input_ids"] for p in PLAIN_PROMPTS]
    return plain + [embedded_llm.apply_chat_template(c) for c in CHATS]


@pytest.fixture(scope="module")
def hf_reference(hf_embedded, prompt_ids):
    return hf_greedy(hf_embedded, prompt_ids, 32)


def test_greedy_matches_transformers_on_embedded_model(embedded_llm, prompt_ids, hf_reference):
    outs = embedded_llm.generate(prompt_ids, GREEDY32)
    assert [o.token_ids for o in outs] == hf_reference


def test_other_block_size_gives_the_same_tokens(embedded_source, prompt_ids, hf_reference):
    llm = LLM(embedded_source.name, block_size=8, num_kv_blocks=512)
    assert [o.token_ids for o in llm.generate(prompt_ids, GREEDY32)] == hf_reference


def test_a_dropped_llm_gives_its_engine_back(embedded_source, prompt_ids, hf_reference, monkeypatch):
    """Each LLM freezes what start-up made (freeze_startup_objects), its engine's reference cycles
    included: a process making LLMs one after another (a sweep, a notebook, this suite) kept every
    engine's weights and KV cache, ~1 GiB each here, until the LLM gave them back when it went; then
    the platform hands its allocator's cache back to the driver (on a GPU the next LLM's KV sizing
    otherwise found the device full: benchmarks/llm_release.py)."""
    llm = LLM(embedded_source.name, num_kv_blocks=64)
    engine = weakref.ref(llm.engine)
    released = []
    monkeypatch.setattr(type(llm.engine.runner.platform), "release_cached_memory",
                        lambda platform: released.append(engine()))
    assert [o.token_ids for o in llm.generate(prompt_ids[:2], GREEDY32)] == hf_reference[:2]
    del llm
    assert engine() is None and released == [None]          # released once the engine was gone
    again = LLM(embedded_source.name, num_kv_blocks=64)       # the next one starts and answers alike
    assert [o.token_ids for o in again.generate(prompt_ids[:2], GREEDY32)] == hf_reference[:2]


def test_chunked_prefill_and_preemption_keep_tokens(embedded_source, prompt_ids, hf_reference):
    # tiny token budget -> long prompts are chunked; tiny KV cache -> preemption by recompute
    llm = LLM(embedded_source.name, max_num_batched_tokens=16, num_kv_blocks=12, block_size=16)
    outs = llm.generate(prompt_ids[:5], GREEDY32)
    assert [o.token_ids for o in outs] == hf_reference[:5]
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == 12


def test_prefix_cache_hits_give_the_same_tokens(embedded_llm, prompt_ids, hf_reference):
    long_prompts = [p for p in prompt_ids if len(p) > 16][:2]
    want = [hf_reference[prompt_ids.index(p)][:12] for p in long_prompts]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    embedded_llm.generate(long_prompts, params)
    again = embedded_llm.generate(long_prompts, params)       # their full blocks are cached now
    assert [o.token_ids for o in again] == want
    assert all(o.cached_tokens >= 16 for o in again)


def test_alone_equals_batched(embedded_llm, prompt_ids, hf_reference):
    # the batched run is test_greedy_matches_transformers_on_embedded_model
    alone = [embedded_llm.generate([p], GREEDY32)[0] for p in (prompt_ids[1], prompt_ids[-1])]
    assert [o.token_ids for o in alone] == [hf_reference[1], hf_reference[-1]]


def test_capital_of_france_is_paris(embedded_llm):
    out = embedded_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                            SamplingParams(temperature=0, max_tokens=32))
    assert "Paris" in out[0].text
    assert out[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}),                                                    # GQA, untied
    ("llama", {"tie_word_embeddings": True,
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    ("qwen2", {"tie_word_embeddings": True}),                         # qkv bias
    ("qwen3", {"tie_word_embeddings": False}),                        # q/k norm
    ("qwen3_moe", {}),                                                # routed experts, a dense layer between
    ("qwen3_moe", {"norm_topk_prob": False, "num_experts_per_tok": 3, "decoder_sparse_step": 2}),
])
@pytest.mark.parametrize("block_size", [16, 4])
def test_tiny_architectures_match_transformers(tmp_path, arch, overrides, block_size):
    from transformers import AutoModelForCausalLM

    from baton.models.source import resolve_model
    tokenizer_dir = os.environ.get("BATON_TOKENIZER") or resolve_model(None).tokenizer_path
    path = save_tiny_checkpoint(arch, tmp_path / arch, tokenizer_dir, **overrides)
    device = os.environ.get("BATON_TEST_DEVICE", "cpu")      # cuda:0 on a GPU machine: same test, fp32
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).to(device).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 23, 40)]
    want = hf_greedy(hf, prompts, 16)
    llm = LLM(str(path), block_size=block_size, num_kv_blocks=256, device=device, dtype="float32")
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in got] == want


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_moe"])
def test_short_prompt_chunks_run_as_decode_rows_with_transformers_tokens(tmp_path, arch):
    """Steps with short prompt chunks run as decode rows, one per token, each over its own context
    (StepInputBuilder.runs_as_rows; on a GPU inside the decode graphs, on the CPU forced): fresh prompts, a
    prefix-cache hit, prompts cut in chunks and prompts joining a running batch, against transformers'
    greedy tokens; every block back."""
    from transformers import AutoModelForCausalLM

    from baton.models.source import resolve_model
    tokenizer_dir = os.environ.get("BATON_TOKENIZER") or resolve_model(None).tokenizer_path
    path = save_tiny_checkpoint(arch, tmp_path / arch, tokenizer_dir)
    device = os.environ.get("BATON_TEST_DEVICE", "cpu")
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).to(device).eval()
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(3, 49152, (35,), generator=g).tolist()
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 70, 18)] + [shared, shared + [7, 8]]
    want = hf_greedy(hf, prompts, 12)
    llm = LLM(str(path), block_size=16, num_kv_blocks=64, device=device, dtype="float32", max_num_seqs=2,
              max_num_batched_tokens=32)            # 2 at a time (the rest join a running batch), chunks of 32
    builder = llm.engine.runner.inputs
    if device == "cpu":
        builder.eager_prompt_rows = True            # (no graphs here: the same rows, eager)
    chunks = []
    row_inputs = builder.row_inputs

    def counted(out, prev):
        chunks.append(sum(item.num_new_tokens > 1 + len(item.draft) for item in out.scheduled))
        return row_inputs(out, prev)
    builder.row_inputs = counted
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in got] == want
    assert sum(chunks) >= len(prompts) + 1, chunks         # every prompt, the 70-token one in three chunks
    assert got[4].cached_tokens >= 32                        # the shared prefix's blocks came from the cache
    assert llm.engine.block_manager.num_free_blocks == 64


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_moe"])
def test_tensor_parallel_ranks_give_the_single_device_tokens(tmp_path, arch):
    """TP=2 (two processes: gloo on the CPU, NCCL across two GPUs) against transformers' greedy."""
    from transformers import AutoModelForCausalLM

    from baton.models.source import resolve_model
    device = os.environ.get("BATON_TEST_DEVICE", "cpu")
    if device.startswith("cuda") and torch.cuda.device_count() < 2:
        pytest.skip(f"tensor parallelism on {device} needs two GPUs; torch sees {torch.cuda.device_count()}")
    tokenizer_dir = os.environ.get("BATON_TOKENIZER") or resolve_model(None).tokenizer_path
    path = save_tiny_checkpoint(arch, tmp_path / arch, tokenizer_dir)
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (7, 30)]
    want = hf_greedy(hf, prompts, 12)
    # llama: the next step queued before the last one's tokens are back (on by default on GPUs), so rank 1
    # takes its pending inputs from the tokens rank 0 broadcasts
    llm = LLM(str(path), num_kv_blocks=64, device=device, dtype="float32", tp_size=2,
              async_scheduling=True if arch == "llama" else None)
    try:
        got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        assert llm.engine.runner.tp.procs[0].is_alive()
    finally:
        llm.engine.runner.close()
    assert [o.token_ids for o in got] == want


@pytest.mark.parametrize("prompt,params,match", [
    ("", SamplingParams(), "empty"),
    ([], SamplingParams(), "empty"),
    ([1] * 9000, SamplingParams(), "max_model_len"),
    ([1, 2, 10**6], SamplingParams(), "vocabulary"),
    ("hi", SamplingParams(temperature=-0.5), "temperature"),
    ("hi", SamplingParams(top_p=0.0), "top_p"),
    ("hi", SamplingParams(top_p=1.5), "top_p"),
    ("hi", SamplingParams(max_tokens=0), "max_tokens"),
    ("hi", SamplingParams(top_k=-1), "top_k"),
    ("hi", SamplingParams(stop_token_ids=[10**6]), "stop token"),
])
def test_bad_input_is_refused_and_engine_keeps_working(embedded_llm, prompt, params, match):
    free = embedded_llm.engine.block_manager.num_free_blocks
    with pytest.raises(ValueError, match=match):
        embedded_llm.generate([prompt], params)
    assert embedded_llm.engine.block_manager.num_free_blocks == free
    assert not embedded_llm.engine.has_unfinished
    assert embedded_llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=2))[0].token_ids


def test_unknown_model_or_option_is_a_clear_error():
    with pytest.raises(ValueError, match="no-such-model"):
        LLM("no-such-model")
    with pytest.raises(ValueError, match="unknown engine options"):
        LLM(block_sise=16)


def test_streamed_kv_passes_each_prompt_block_once_in_order_as_its_chunk_ends(embedded_source, prompt_ids):
    """The handoff hook (the KV transfer's source) gets every prompt block exactly once, in
    order, chunk by chunk, with its final KV already written, and the first token with the
    last: the pieces, packed when they were passed, equal the blocks the request held; the
    request's ticket ends PREFILLED with every block free again."""
    from baton.engine.kv_handoff import KVState
    from baton.engine.runner.kv_blocks import pack_blocks

    class Collect(Hook):
        def on_prompt_kv(self, piece):
            super().on_prompt_kv(piece)
            if piece.last:                  # the request's blocks, as it holds them at the end
                self.table = list(e.states[piece.request_id].seq.block_table)

    hook = Collect()
    llm = LLM(embedded_source.name, max_num_batched_tokens=24, num_kv_blocks=64, block_size=8)
    e = llm.engine
    e.handoff = hook
    prompt = max(prompt_ids, key=len)
    e.add_request(prompt, SamplingParams(temperature=0, max_tokens=1), request_id="s", hand_off_kv=True)
    ticket, packed = e.kv_ticket("s"), []
    pack = e.runner.pack_kv
    e.runner.pack_kv = lambda block_ids, *more: packed.append(list(block_ids)) or pack(block_ids, *more)
    outs = []
    while e.has_unfinished:
        outs += e.step()
    held = [b for ids in packed for b in ids]
    pieces = hook.pieces
    tokens = [p.first_token for p in pieces]
    assert tokens[:-1] == [None] * (len(tokens) - 1) and [tokens[-1]] == outs[-1].new_token_ids   # with the last
    assert len(pieces) == -(-len(prompt) // 24) > 1                 # one piece per chunk
    assert [p.first_block for p in pieces] == [0, *itertools.accumulate(p.num_blocks for p in pieces[:-1])]
    assert held == hook.table and len(set(held)) == len(held)      # each block once, in order
    ids = [held[p.first_block:p.first_block + p.num_blocks] for p in pieces]
    assert torch.equal(torch.cat([p.data for p in pieces]).view(-1),
                       torch.cat([pack_blocks(e.runner.kv_cache, b) for b in ids]).view(-1))
    assert ticket.history == [KVState.QUEUED, KVState.PREFILLING, KVState.PREFILLED]
    assert e.block_manager.num_free_blocks == e.block_manager.num_blocks   # nothing held past the prefill
