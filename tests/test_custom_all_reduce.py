"""The tensor-parallel all-reduce's choice and routing (models/layers/custom_all_reduce.py) on the CPU:
`auto` falls back to torch.distributed with its reason logged, `symm` where it cannot run stops the
engine at start and says what to do, and two gloo ranks send the tensors that fit the symmetric
buffer through it and the rest (too big, float16, odd sizes, misaligned views) through torch.distributed.
tests/test_custom_all_reduce_cuda.py runs the real kernel on two GPUs."""
from __future__ import annotations

import logging
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import in_triton_interpreter, tiny_hf_config

from baton.engine.config import EngineConfig
from baton.models.layers import custom_all_reduce
from baton.models.layers.custom_all_reduce import SymmMemAllReduce, choose, install, unavailable
from baton.models.layers.linear import RowParallelLinear, TPInfo

BUFFER_BYTES = 1024


def test_auto_on_the_cpu_falls_back_to_torch_distributed_and_logs_why_once(caplog, monkeypatch):
    monkeypatch.setattr(custom_all_reduce, "_logged", set())
    with caplog.at_level(logging.INFO, logger="baton.models"):
        assert choose("auto", None, 0, ["cpu", "cpu"], backend="gloo") is None
        assert choose("auto", None, 0, ["cpu", "cpu"], backend="gloo") is None
        assert choose("auto", None, 1, ["cpu", "cpu"], backend="gloo") is None      # rank 1 says nothing
    said = [r.getMessage() for r in caplog.records if r.name == "baton.models"]
    assert said == ["all-reduce: gloo, not symmetric memory: the ranks are on cpu, and symmetric memory is CUDA's"]


def test_symm_where_it_cannot_run_is_an_error_that_says_what_to_do():
    with pytest.raises(RuntimeError, match="--all-reduce symm cannot run here: the ranks are on cpu.*--all-reduce auto"):
        choose("symm", None, 0, ["cpu", "cpu"], backend="gloo")
    for config, match in ((dict(device="cpu"), "ranks here are on cpu: use --all-reduce auto or nccl"),
                          (dict(device="npu:0"), "on npu:0"),
                          (dict(device="cuda:0", tp_size=3), "--tp-size 2, 4 or 8, got 3"),
                          (dict(device="cuda:0", deterministic=True), "--deterministic keeps NCCL's")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(**{"tp_size": 2, "all_reduce": "symm", **config}).validate()
    with pytest.raises(ValueError, match="all_reduce must be one of auto, nccl, symm"):
        EngineConfig(all_reduce="custom").validate()
    EngineConfig(device="cpu", tp_size=2, all_reduce="nccl").validate()


def test_the_reasons_cuda_ranks_fall_back():
    """Checked before any device is touched: these hold on a machine without GPUs."""
    assert "3 ranks" in unavailable(["cuda:0", "cuda:1", "cuda:2"])
    assert unavailable(["cuda:0", "cuda:0"]) == "two ranks share a device"
    assert "--deterministic" in unavailable(["cuda:0", "cuda:1"], deterministic=True)


def test_install_reaches_every_tensor_parallel_layer():
    tp, single = TPInfo(0, 2, None), TPInfo()
    model = torch.nn.ModuleList([RowParallelLinear(8, 4, tp=tp, dtype=torch.float32),
                                 RowParallelLinear(8, 4, tp=single, dtype=torch.float32)])
    reducer = SymmMemAllReduce(torch.empty(BUFFER_BYTES, dtype=torch.uint8), "0")
    install(model, reducer)
    assert tp.custom_all_reduce is reducer and single.custom_all_reduce is None


def _through_gloo(symm, x, group_name, out):
    """The one-shot op's contract, on gloo: x into the symmetric view, the sum of every rank's into out."""
    _through_gloo.calls += 1
    symm.copy_(x)
    dist.all_reduce(symm)
    return out.copy_(symm)


def _worker(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        tp = TPInfo(rank, 2, dist.group.WORLD)
        tp.custom_all_reduce = SymmMemAllReduce(torch.zeros(BUFFER_BYTES, dtype=torch.uint8), "0", _through_gloo)
        _through_gloo.calls = 0
        base = torch.zeros(64, dtype=torch.bfloat16)
        cases = {                      # name: (tensor, through the symmetric buffer?)
            "small bf16": (torch.zeros(4, 64, dtype=torch.bfloat16), True),
            "small float32, the whole buffer": (torch.zeros(16, 16), True),
            "past the buffer": (torch.zeros(16, 17), False),
            "float16": (torch.zeros(4, 64, dtype=torch.float16), False),
            "size not a multiple of 16 bytes": (torch.zeros(3, dtype=torch.bfloat16), False),
            "offset not 16-byte aligned": (base[1:9], False),
        }
        for name, (x, symm) in cases.items():
            x.fill_(rank + 1)
            before = _through_gloo.calls
            got = tp.all_reduce(x)
            assert (_through_gloo.calls > before) == symm, name
            assert (got is x) != symm, f"{name}: torch.distributed sums in place, the symmetric path into a new tensor"
            assert bool((got == 3).all()), name
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_ranks_route_by_size_dtype_and_layout():
    mp.spawn(_worker, args=(_free_port(),), nprocs=2, join=True)


class _Doubling(TPInfo):
    """Two ranks that hold the same partial sums, seen from one: every all-reduce doubles."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class _FusedByHand:
    """A reducer whose fused all-reduce + add + RMSNorm is the two steps, counted."""

    def __init__(self, ops):
        self.ops, self.calls = ops, 0
        self.fused_norm = self.add_rms_norm

    def fits(self, x):
        return False

    def fits_norm(self, x, residual, weight):
        return True

    def add_rms_norm(self, x, residual, weight, eps):
        self.calls += 1
        return self.ops.add_rms_norm(x * 2, residual, weight, eps)


class _QAttention:
    """Attention that returns its queries: enough to carry each layer's input to its o_proj."""

    def prefill_attention(self, q, k, v, k_cache, v_cache, meta, scale, kv_scale=None):
        return q


def test_a_decoder_reduces_each_partial_sum_once_in_the_norm_after_it():
    """With the fused all-reduce installed, o_proj and down_proj leave their partial sums to the RMSNorm after
    them (2 per layer, the last one the final norm's) and the outputs are the unfused forward's, bit for bit;
    not where an EAGLE-3 head reads the layers' sums, nor in a model whose norms quantize to FP8."""
    from baton.engine.platforms.base import LayerOps
    from baton.models.forward_context import ForwardContext
    from baton.models.qwen3 import Qwen3ForCausalLM
    config, ops = tiny_hf_config("qwen3"), LayerOps()
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config, ops, torch.float32, _Doubling(0, 2, None))
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    ids, positions = torch.randint(0, config.vocab_size, (7,)), torch.arange(7)
    ctx = ForwardContext(None, None, _QAttention(), 1.0)
    want = model.model(ids, positions, ctx)
    reducer = _FusedByHand(ops)
    install(model, reducer)
    assert model.model.fused_reduce is model.model.embed_tokens.tp
    assert torch.equal(model.model(ids, positions, ctx), want)
    assert reducer.calls == 2 * config.num_hidden_layers
    model.model.aux_layers = (1,)
    model.model(ids, positions, ctx)
    assert reducer.calls == 2 * config.num_hidden_layers, "aux layers read the sums: no fusion"
    quantizing = Qwen3ForCausalLM(config, ops, torch.float32, _Doubling(0, 2, None))
    quantizing.model.layers[1].post_attention_layernorm.fp8_out = True
    install(quantizing, _FusedByHand(ops))
    assert quantizing.model.fused_reduce is None


def test_the_fused_kernels_pushes_and_sums_in_triton_s_interpreter():
    """all_reduce_norm's kernel as rank 0 of two, the peer played by hand: its rows already in its slot of this
    rank's half. Two calls: the sums and norms are the two steps', several rows a program; each call's rows
    land in this rank's slot of the peer's half of its number (1, then 2), a negative zero written as a positive
    one; the peer's slot it read is empty again after; the count of calls moves on by one each."""
    in_triton_interpreter("import test_custom_all_reduce as t; t._fused_in_interpreter(); print('DONE')",
                          "DONE", "the fused all-reduce + RMSNorm kernel")


def _fused_in_interpreter() -> None:
    from baton.models.layers import all_reduce_norm as arn
    torch.manual_seed(0)
    rows, n, world, programs = 5, 96, 2, 2
    slot = rows * n                                  # elements (fp32: the interpreter's bf16 is inexact)
    max_bytes = slot * 4
    buf0, buf1 = (torch.zeros(arn.buffer_bytes(max_bytes, world) // 4) for _ in range(2))
    for buf in (buf0, buf1):
        arn.empty_slots(buf.view(torch.uint8), max_bytes, torch.float32)
    empty = torch.full((slot,), -0.0)
    calls = torch.zeros(2, dtype=torch.int32)
    bufs = torch.tensor([buf0.data_ptr(), buf1.data_ptr()], dtype=torch.int64)
    w = torch.randn(n)

    def at(buf, e, sender):                         # a sender's slot in a rank's half of call e
        start = (1 + (e % 2) * world + sender) * slot
        return buf[start:start + slot]

    for e in (1, 2):
        x, peer, res = (torch.randn(rows, n) for _ in range(3))
        x[0, 0] = -0.0
        at(buf0, e, 1).copy_(peer.reshape(-1))      # the peer (rank 1) has pushed its rows of call e
        out, total = arn.all_reduce_add_rms_norm(x, res, w, 1e-6, bufs, calls, 0, world, max_bytes,
                                                 max_programs=programs)
        s = (x + peer) + res
        assert torch.equal(total, s)
        want = w * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6))
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
        pushed = at(buf1, e, 0).view(rows, n)
        assert torch.equal(pushed, x) and not pushed[0, 0].signbit(), "pushed, a negative zero as a positive one"
        assert torch.equal(at(buf0, e, 1).view(torch.int32), empty.view(torch.int32)), "read, then emptied"
        assert calls.tolist() == [e, 0]
    assert not buf0[:slot].any() and not buf1[:slot].any()       # torch's one-shot region: untouched
    for buf in (buf0, buf1):                        # every slot empty but the peer's, which rank 1 reads
        for e in (1, 2):
            for sender in range(world):
                if buf is buf0 or sender != 0:
                    assert torch.equal(at(buf, e, sender).view(torch.int32), empty.view(torch.int32))
