"""The symmetric-memory all-reduce (models/layers/custom_all_reduce.py) on two CUDA GPUs, against
NCCL's: the same sums on random bf16 and fp32 tensors of 8 KiB .. 8 MiB, eagerly and replayed from a
captured CUDA graph (bit for bit: with two ranks both add the same two numbers once); the times of
both at the sizes of decode steps, printed as a table with -s; the all-reduce fused with the add and RMSNorm
after it against the two steps (the same bits; its times); and an engine at --tp-size 2 that decodes the
same greedy tokens with either. Skipped without two CUDA devices.

    python3 -m pytest -s tests/test_custom_all_reduce_cuda.py
"""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [pytest.mark.device,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (tensor parallelism)")]

HIDDEN = 4096                                   # qwen3-8b's: one token's row is 8 KiB in bf16
SIZES = [8 << 10 << i for i in range(11)]       # 8 KiB .. 8 MiB
TIMED = [256 << 10, 1 << 20, 2 << 20, 4 << 20]
DEVICES = ["cuda:0", "cuda:1"]
TOKENIZER = os.environ.get("BATON_TOKENIZER")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(rank: int, port: int):
    from baton.models.layers.custom_all_reduce import choose, unavailable
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    if rank == 0:
        print(f"\n[custom all-reduce] torch {torch.__version__}; auto would "
              f"{'take symm' if unavailable(DEVICES) is None else 'fall back: ' + unavailable(DEVICES)}")
    return choose("symm", dist.group.WORLD, rank, DEVICES)       # raises, saying why, where it cannot run


def _tensor(nbytes: int, dtype: torch.dtype, rank: int, seed: int) -> torch.Tensor:
    numel = nbytes // torch.tensor([], dtype=dtype).element_size()
    g = torch.Generator(device="cuda").manual_seed(seed * 10 + rank)
    shape = (numel // HIDDEN, HIDDEN) if numel % HIDDEN == 0 else (numel,)
    return torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)


def _nccl(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    dist.all_reduce(y)
    return y


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, what
    diff = (got.float() - want.float()).abs().max().item()
    assert torch.equal(got, want), f"{what}: differs from NCCL's sum by up to {diff}"


def _correctness(rank: int, port: int) -> None:
    reducer = _start(rank, port)
    try:
        for i, nbytes in enumerate(SIZES):
            for dtype in (torch.bfloat16, torch.float32):
                x = _tensor(nbytes, dtype, rank, i)
                assert reducer.fits(x), (nbytes, dtype)
                _same(reducer(x), _nccl(x), f"eager {nbytes} B {dtype}")
        for i, nbytes in enumerate(SIZES):
            _graph_case(reducer, rank, nbytes, seed=100 + i)
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()


def _graph_case(reducer, rank: int, nbytes: int, seed: int) -> None:
    """Three all-reduces in a row inside one graph (a layer's two and the next one's first), with work
    between them, replayed twice on new inputs: each replay's sums are NCCL's eager ones."""
    x = _tensor(nbytes, torch.bfloat16, rank, seed)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):                  # warm-up off the capture, as torch.cuda.graph asks
        _layers(reducer, x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _layers(reducer, x)
    for replay in range(2):
        x.copy_(_tensor(nbytes, torch.bfloat16, rank, seed + 1000 * (replay + 1)))
        graph.replay()
        _same(out, _layers(_nccl, x), f"graph replay {replay} at {nbytes} B")


def _layers(all_reduce, x: torch.Tensor) -> torch.Tensor:
    a = all_reduce(x)
    b = all_reduce(a * 0.5)
    return all_reduce(b + x)


def test_the_symmetric_all_reduce_sums_as_nccl_does_eagerly_and_in_cuda_graphs():
    mp.spawn(_correctness, args=(_free_port(),), nprocs=2, join=True)


def _timings(rank: int, port: int) -> None:
    reducer = _start(rank, port)
    try:
        rows = [(nbytes, *_time(reducer, nbytes)) for nbytes in TIMED]
        if rank == 0:
            print("\n| size | NCCL eager us | symm eager us | NCCL graph us | symm graph us | graph speed-up "
                  "| two-shot graph us |")
            print("| --- | --- | --- | --- | --- | --- | --- |")
            for nbytes, ne, se, ng, sg, tg in rows:
                print(f"| {nbytes >> 10} KiB | {ne:.1f} | {se:.1f} | {ng:.1f} | {sg:.1f} | {ng / sg:.2f}x | {tg:.1f} |")
    finally:
        dist.destroy_process_group()


def _time(reducer, nbytes: int, calls: int = 50, replays: int = 20) -> tuple[float, ...]:
    """Microseconds per all-reduce of a zero bf16 tensor (sums stay zero): `calls` back to back,
    eagerly and replayed from one graph, both ranks started together. Two-shot (torch's
    two_shot_all_reduce_out: each rank sums half and writes it to both) is timed for comparison only."""
    x = torch.zeros(nbytes // 2 // HIDDEN, HIDDEN, dtype=torch.bfloat16, device="cuda")
    ops = {"nccl": lambda t: dist.all_reduce(t) or t, "symm": reducer, "two-shot": _two_shot(reducer)}
    out = {}
    for name, op in ops.items():
        for _ in range(10):
            op(x)
        out[name, "eager"] = _timed(lambda op=op: [op(x) for _ in range(calls)]) / calls
    for name, op in ops.items():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                op(x)
        graph.replay()
        out[name, "graph"] = _timed(lambda g=graph: [g.replay() for _ in range(replays)]) / (calls * replays)
    return out["nccl", "eager"], out["symm", "eager"], out["nccl", "graph"], out["symm", "graph"], out["two-shot", "graph"]


def _two_shot(reducer):
    def op(x: torch.Tensor) -> torch.Tensor:
        symm = reducer.buffer.view(x.dtype)[: x.numel()].view(x.shape)
        symm.copy_(x)
        return torch.ops.symm_mem.two_shot_all_reduce_out(symm, "sum", reducer.group_name, torch.empty_like(x))
    return op


def _timed(fn) -> float:
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000


def _fused_correctness(rank: int, port: int) -> None:
    """The fused all-reduce + add + RMSNorm (models/layers/all_reduce_norm.py) against NCCL's sum then the
    platform's add_rms_norm: the same bits, eagerly at 1 .. 1,024 rows (8 KiB .. 8 MiB), and replayed from a
    graph of three fused calls in a row (one buffer, no host between them) on new inputs."""
    from baton.engine.platforms.triton_kernels import layer_ops
    reducer = _start(rank, port)
    try:
        assert reducer.fused_norm is not None, reducer.why_unfused
        g = torch.Generator(device="cuda").manual_seed(7)          # the same weight and residual on both ranks
        weight = (1 + 0.1 * torch.randn(HIDDEN, generator=g, device="cuda")).to(torch.bfloat16)

        def unfused(x, residual):
            return layer_ops.add_rms_norm(_nccl(x), residual, weight, 1e-6)

        for rows in (1, 3, 64, 127, 128, 129, 256, 1024):
            x = _tensor(rows * HIDDEN * 2, torch.bfloat16, rank, rows)
            residual = torch.randn(rows, HIDDEN, generator=g, device="cuda").to(torch.bfloat16)
            assert reducer.fits_norm(x, residual, weight), rows
            for got, want, what in zip(reducer.add_rms_norm(x, residual, weight, 1e-6), unfused(x, residual),
                                       ("normed", "sum"), strict=True):
                _same(got, want, f"fused {what}, {rows} rows")
        rows = 200
        x = _tensor(rows * HIDDEN * 2, torch.bfloat16, rank, 1)
        residual = torch.randn(rows, HIDDEN, generator=g, device="cuda").to(torch.bfloat16)

        def three(x, residual, op):
            a, r = op(x, residual)
            b, r = op(a * 0.5 + x, r)
            return op(b - x, r)

        def fused(x, residual):
            return reducer.add_rms_norm(x, residual, weight, 1e-6)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            three(x, residual, fused)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = three(x, residual, fused)
        for replay in range(3):
            x.copy_(_tensor(rows * HIDDEN * 2, torch.bfloat16, rank, 50 + replay))
            graph.replay()
            for got, want in zip(out, three(x, residual, unfused), strict=True):
                _same(got, want, f"fused, graph replay {replay}")
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()


def test_the_fused_all_reduce_and_rms_norm_writes_what_the_two_steps_write():
    mp.spawn(_fused_correctness, args=(_free_port(),), nprocs=2, join=True)


def _fused_timings(rank: int, port: int) -> None:
    """Microseconds per all-reduce + add + RMSNorm at decode sizes, 50 in a row replayed from a graph: torch's
    one-shot then add_rms_norm (two kernels), against the fused kernel (one)."""
    from baton.engine.platforms.triton_kernels import layer_ops
    reducer = _start(rank, port)
    try:
        weight = torch.ones(HIDDEN, dtype=torch.bfloat16, device="cuda")
        lines = []
        for rows in (1, 16, 64, 128, 256, 512):
            x = torch.zeros(rows, HIDDEN, dtype=torch.bfloat16, device="cuda")
            residual = torch.ones(rows, HIDDEN, dtype=torch.bfloat16, device="cuda")
            ops = {"two kernels": lambda x=x, r=residual: layer_ops.add_rms_norm(reducer(x), r, weight, 1e-6),
                   "fused": lambda x=x, r=residual: reducer.add_rms_norm(x, r, weight, 1e-6)}
            us = {}
            for name, op in ops.items():
                op()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(50):
                        op()
                graph.replay()
                us[name] = _timed(lambda g=graph: [g.replay() for _ in range(20)]) / (50 * 20)
            lines.append(f"| {rows} | {rows * HIDDEN * 2 >> 10} KiB | {us['two kernels']:.1f} | {us['fused']:.1f} "
                         f"| {us['two kernels'] / us['fused']:.2f}x |")
        if rank == 0:
            print(f"\nfused: up to {reducer.fused_norm.programs} programs")
            print("\n| rows | size | one-shot + add_rms_norm us | fused us | speed-up |\n| --- | --- | --- | --- | --- |")
            print("\n".join(lines))
    finally:
        dist.destroy_process_group()


def test_times_of_the_fused_all_reduce_and_rms_norm():
    mp.spawn(_fused_timings, args=(_free_port(),), nprocs=2, join=True)


def test_times_of_both_at_decode_sizes():
    mp.spawn(_timings, args=(_free_port(),), nprocs=2, join=True)


def test_an_engine_at_tp2_decodes_the_same_tokens_with_either_all_reduce():
    """The qwen3-0.6b preset (random weights) in bf16 at --tp-size 2, decode graphs captured: symm's sums
    are NCCL's bits. symm first: torch sets symmetric memory up once per process (a later engine falls
    back to NCCL, which the last part checks)."""
    from baton.engine import LLM, SamplingParams
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 151_000, (n,), generator=g).tolist() for n in (9, 200, 700)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for mode in ("symm", "nccl", "auto"):       # symm: fused with the RMSNorms (qwen3's layers are dense)
        llm = LLM("qwen3-0.6b", device="cuda:0", dtype="bfloat16", tp_size=2, all_reduce=mode, max_num_seqs=8,
                  tokenizer=TOKENIZER, max_model_len=1024, kv_cache_memory=2 << 30)
        try:
            outs[mode] = [o.token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.engine.runner.close()
        del llm
        torch.cuda.empty_cache()
    assert outs["symm"] == outs["nccl"] == outs["auto"]
