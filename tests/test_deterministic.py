"""Deterministic mode (--deterministic, engine/runner/batch_invariant.py): a token's logits do not depend
on its batch, on how its prompt was chunked, on prefix-cache hits, or on whether it was computed
in a prefill or a decode step -- bit for bit. Same test on a GPU: BATON_TEST_DEVICE=cuda:0 (bf16
there, the platform's dtype: the case where default kernels do differ)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from helpers import save_tiny_checkpoint

from baton.engine import LLM, SamplingParams
from baton.engine.config import EngineConfig
from baton.engine.runner.batch_invariant import fixed_rows_linear
from baton.models.attention_metadata import AttnMetadata
from baton.models.forward_context import ForwardContext

DEVICE = os.environ.get("BATON_TEST_DEVICE", "cpu")
BLOCKS_PER_SEQ = 8
FIRST_BLOCK = 400          # _step's sequences use blocks 400..479 of 512: above what generate() has touched


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def tiny_path(request, tmp_path_factory):
    from baton.models.source import resolve_model
    tokenizer_dir = os.environ.get("BATON_TOKENIZER") or resolve_model(None).tokenizer_path
    arch = request.param
    return str(save_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch) / arch, tokenizer_dir))


@pytest.fixture(scope="module")
def llm(tiny_path):
    return LLM(tiny_path, device=DEVICE, deterministic=True, num_kv_blocks=512, block_size=16, max_num_seqs=64)


def _step(runner, seqs: list[tuple[list[int], int, int]]) -> torch.Tensor:
    """One forward over `seqs` = (new token ids, cached context length, slot of the sequence):
    sequence slot s owns blocks FIRST_BLOCK + [s * BLOCKS_PER_SEQ, ...). Returns each sequence's last logits."""
    bs = runner.block_size
    ids, positions, slots, starts, lens, tables = [], [], [], [0], [], []
    for new, context, s in seqs:
        pos = np.arange(context, context + len(new))
        table = np.arange(BLOCKS_PER_SEQ, dtype=np.int32) + FIRST_BLOCK + s * BLOCKS_PER_SEQ
        ids.extend(new)
        positions.extend(pos)
        slots.extend(table[pos // bs] * bs + pos % bs)
        starts.append(starts[-1] + len(new))
        lens.append(context + len(new))
        tables.append(table)
    decode = all(len(new) == 1 for new, _, _ in seqs)
    ids_d, pos_d, slots_d, starts_d, lens_d, tables_d = runner.upload(
        np.array(ids, np.int64), np.array(positions, np.int64), np.array(slots, np.int64),
        np.array(starts, np.int32), np.array(lens, np.int32), np.stack(tables))
    meta = AttnMetadata(is_decode=decode, slot_mapping=slots_d, query_start_loc=starts_d, seq_lens=lens_d,
                        block_tables=tables_d, max_query_len=max(len(n) for n, _, _ in seqs), max_seq_len=max(lens),
                        has_context=any(c for _, c, _ in seqs), query_start_loc_cpu=starts, seq_lens_cpu=lens)
    with torch.inference_mode():
        hidden = runner.model(ids_d, pos_d, ForwardContext(meta, runner.kv_caches, runner.attention, runner.scale))
        return runner.model.compute_logits(hidden[starts_d[1:].long() - 1]).float().cpu()


def _check_bits(runner) -> None:
    g = torch.Generator().manual_seed(3)
    a, b, c = (torch.randint(3, 49152, (n,), generator=g).tolist() for n in (37, 20, 50))
    alone = _step(runner, [(a, 0, 0)])[0]
    assert torch.equal(_step(runner, [(b, 0, 1), (a, 0, 2), (c, 0, 3)])[1], alone), "batched prefill"
    _step(runner, [(a[:20], 0, 4)])
    assert torch.equal(_step(runner, [(a[20:], 20, 4)])[0], alone), "chunked prefill"
    _step(runner, [(a[:36], 0, 5), (b[:19], 0, 6), (c[:49], 0, 7)])
    decoded = _step(runner, [(b[19:], 19, 6), (a[36:], 36, 5), (c[49:], 49, 7)])
    assert torch.equal(decoded[1], alone), "the last token decoded in a batch instead of prefilled"
    _step(runner, [(a[:16], 0, 8)])            # a cached prefix of one block, the rest and a batch-mate new
    assert torch.equal(_step(runner, [(c[:5], 0, 9), (a[16:], 16, 8)])[1], alone), "prefix-cache hit"


def test_a_tokens_logits_are_the_same_bits_however_it_is_computed(llm):
    _check_bits(llm.engine.runner)


def test_the_npu_emulation_keeps_the_same_contract(tmp_path):
    """The NPU platform (its documented ops, emulated on the host): same bits, bf16, block size 128;
    MoE is refused there (the grouped matmul tiles each expert its own way)."""
    from baton.models.source import resolve_model
    tokenizer_dir = os.environ.get("BATON_TOKENIZER") or resolve_model(None).tokenizer_path
    npu = dict(device="npu:0", npu_emulation=True, deterministic=True, dtype="bfloat16", block_size=128,
               num_kv_blocks=512, max_num_seqs=4, max_num_batched_tokens=256)
    llm = LLM(str(save_tiny_checkpoint("qwen3", tmp_path / "qwen3", tokenizer_dir)), **npu)
    _check_bits(llm.engine.runner)
    with pytest.raises(ValueError, match="deterministic does not cover"):
        LLM(str(save_tiny_checkpoint("qwen3_moe", tmp_path / "moe", tokenizer_dir)), **npu)


def test_together_equals_alone_greedy_and_seeded(llm):
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 49152, (int(n),), generator=g).tolist()
               for n in torch.randint(3, 60, (12,), generator=g)]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True) if i % 3 == 0 else
              SamplingParams(temperature=1.0, seed=i, max_tokens=10, ignore_eos=True) if i % 3 == 1 else
              SamplingParams(temperature=0.9, top_p=0.8, top_k=50, seed=i, max_tokens=10, ignore_eos=True)
              for i in range(len(prompts))]
    together = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    assert together == alone


def test_chunked_prefill_and_prefix_hits_keep_the_tokens(tiny_path, llm):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (70, 45, 33)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(prompts, params)]
    again = llm.generate(prompts, params)                     # their full blocks are cached now
    assert [o.token_ids for o in again] == want
    assert all(o.cached_tokens >= 32 for o in again)
    chunked = LLM(tiny_path, device=DEVICE, deterministic=True, num_kv_blocks=256, max_num_batched_tokens=16,
                  enable_prefix_caching=False)
    assert [o.token_ids for o in chunked.generate(prompts, params)] == want


def test_fixed_rows_linear_is_plain_linear_in_pieces():
    rows = 4
    linear = fixed_rows_linear(rows)
    x, w, bias = torch.randn(10, 6), torch.randn(5, 6), torch.randn(5)
    out = linear(x, w, bias)
    assert out.shape == (10, 5)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, bias))
    for m in (1, 3, 4, 7):                     # a row's bits do not depend on how many rows came with it
        assert torch.equal(linear(x[:m], w, bias), out[:m])
    assert linear(x.view(2, 5, 6), w).shape == (2, 5, 5)


def test_more_than_two_tensor_parallel_ranks_are_refused():
    with pytest.raises(ValueError, match="at most 2 tensor-parallel"):
        EngineConfig(deterministic=True, tp_size=4).validate()


def test_the_worker_flag_reaches_the_engine():
    import argparse

    from baton.serving.worker.worker_config import add_worker_args, engine_config_from_args
    p = argparse.ArgumentParser()
    add_worker_args(p, 50052)
    assert engine_config_from_args(p.parse_args(["--deterministic"])).deterministic
    assert not engine_config_from_args(p.parse_args([])).deterministic
