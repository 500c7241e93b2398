"""FP8 kernels at decode sizes (issue 33's speed): qwen3-8b's projections and decode attention.

    python -m baton.benchmarks.quant_kernels --out DIR

Per projection shape and batch M: the bf16 GEMM, the per-token quantizer, `torch._scaled_mm`
row-wise, and a plain Triton FP8 GEMM (below) at a few tiles, each call on its own
copy of the weights so they stream from HBM as in a decode step; decode attention over a bf16
and a float8 cache, per tile config (triton.testing.do_bench, the L2 flushed between runs).
Prints one JSON line per measurement and writes them to DIR/quant_kernels.jsonl.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from baton.engine.platforms.triton_kernels import decode_attention, quant


# -- the Triton FP8 GEMM measured against torch._scaled_mm (not used by the engine: it was not faster) --
@triton.jit
def _fp8_gemm_kernel(a_ptr, w_ptr, as_ptr, ws_ptr, out_ptr, M, N, K, stride_am, stride_wn, stride_om,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVEN_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * stride_am + rk[None, :]
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = k + rk < K
            a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    sa = tl.load(as_ptr + rm, mask=m_ok, other=0.0)
    sw = tl.load(ws_ptr + rn, mask=n_ok, other=0.0)
    y = acc * sa[:, None] * sw[None, :]
    o = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(o, y.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _tile_config(m: int, n: int, k: int, num_sms: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for a decode-sized GEMM."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 128 if triton.cdiv(n, 128) * triton.cdiv(m, block_m) >= num_sms else 64
    return block_m, block_n, 128, 4, 4


def triton_fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype = torch.bfloat16, config: tuple | None = None) -> torch.Tensor:
    """a e4m3 [M, K], a_scale float32 [M, 1]; w e4m3 [N, K], w_scale float32 [1, N] -> [M, N]."""
    m, k = a.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    bm, bn, bk, warps, stages = config or _tile_config(m, n, k, torch.cuda.get_device_properties(a.device).multi_processor_count)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm))
    _fp8_gemm_kernel[grid](a, w, a_scale, w_scale, out, m, n, k, a.stride(0), w.stride(0), out.stride(0),
                           BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0,
                           num_warps=warps, num_stages=stages)
    return out


def _us(fn, *args, **kwargs) -> float:
    return 1000 * do_bench(lambda: fn(*args, **kwargs))


SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}   # qwen3-8b
def _sweep(m: int) -> list[tuple]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) tiles of the Triton FP8 GEMM tried at M."""
    bm = 16 if m <= 16 else 64 if m <= 64 else 128
    return [(bm, 64, 256, 4, 3), (bm, 128, 128, 8, 3), (min(bm, 64), 64, 128, 4, 4)]


def _stream_us(calls: list) -> float:
    """Microseconds per call, each call on its own copy of the weights (together > 4x the L2),
    back to back: weights stream from HBM as in a decode step, with no L2 flush in between."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(3):
            for c in calls:
                c()
        end.record()
        end.synchronize()
        best = min(best, 1000 * start.elapsed_time(end) / (3 * len(calls)))
    return best


def _engine_path(x, w, s):
    """What Fp8Matmul runs: the per-token quantizer, then the row-wise scaled GEMM."""
    xq, xs = quant.quantize_fp8_rows(x)
    return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=s, out_dtype=torch.bfloat16)


def _gemm_row(name: str, n: int, k: int, m: int, wq_: list, ws_: list, wb_: list) -> dict:
    dev = wq_[0].device
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    xq, xs = quant.quantize_fp8_rows(x)
    row = {"shape": name, "m": m, "n": n, "k": k, "copies": len(wq_)}
    row["bf16_us"] = _stream_us([lambda w=w: torch.nn.functional.linear(x, w) for w in wb_])
    row["quantize_us"] = _stream_us([lambda: quant.quantize_fp8_rows(x)])
    row["scaled_mm_us"] = _stream_us([lambda w=w, s=s: torch._scaled_mm(
        xq, w.t(), scale_a=xs, scale_b=s, out_dtype=torch.bfloat16) for w, s in zip(wq_, ws_, strict=True)])
    row["quantize_scaled_mm_us"] = _stream_us([lambda w=w, s=s: _engine_path(x, w, s)
                                               for w, s in zip(wq_, ws_, strict=True)])
    row["scaled_mm_fast_us"] = _stream_us([lambda w=w, s=s: torch._scaled_mm(
        xq, w.t(), scale_a=xs, scale_b=s, out_dtype=torch.bfloat16, use_fast_accum=True)
        for w, s in zip(wq_, ws_, strict=True)])
    ref = torch._scaled_mm(xq, wq_[0].t(), scale_a=xs, scale_b=ws_[0], out_dtype=torch.bfloat16).float()
    for cfg in _sweep(m):
        try:
            y = triton_fp8_gemm(xq, xs, wq_[0], ws_[0], config=cfg)
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            t = _stream_us([lambda w=w, s=s, cfg=cfg: triton_fp8_gemm(xq, xs, w, s, config=cfg)
                            for w, s in zip(wq_, ws_, strict=True)])
        except Exception as e:  # noqa: BLE001 -- out of shared memory etc.: skip that tile
            print(json.dumps({"skip": cfg, "why": repr(e)[:100]}), flush=True)
            continue
        row[f"triton_{'x'.join(map(str, cfg))}_us"] = t
        row["triton_rel_err"] = err
    row["fp8_floor_us"] = n * k / 2.96e6          # the weight bytes at 2.96 TB/s
    row["bf16_floor_us"] = 2 * n * k / 2.96e6
    row = {k2: round(v, 2) if isinstance(v, float) else v for k2, v in row.items()}
    return row


def _gemms(ms: list[int], out) -> None:
    dev = torch.device("cuda")
    for name, (n, k) in SHAPES.items():
        copies = max(2, -(-4 * 50 * 2 ** 20 // (n * k)))        # fp8 copies over 4x an H100's 50 MiB L2
        ws_, wq_, wb_ = [], [], []
        for _ in range(copies):
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
            s = (w.float().abs().amax(1, keepdim=True) / 448).clamp(min=1e-12)
            wq_.append((w.float() / s).to(torch.float8_e4m3fn))
            ws_.append(s.reshape(1, -1).contiguous())
            wb_.append(w)
        for m in ms:
            row = _gemm_row(name, n, k, m, wq_, ws_, wb_)
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")
        del ws_, wq_, wb_


def _attention(cases: list[tuple[int, int]], out) -> None:
    dev = torch.device("cuda")
    hq, hkv, d, bs = 32, 8, 128, 16
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    cfgs = [decode_attention.DecodeConfig(block_n=bn, num_warps=w, num_stages=s)
            for bn in (64, 128) for w in (4, 8) for s in (2, 3)]
    for batch, ctx in cases:
        blocks_per = ctx // bs
        nblocks = batch * blocks_per + 1
        tables = torch.randperm(nblocks - 1, device=dev, dtype=torch.int32)[: batch * blocks_per].view(batch, -1)
        seq_lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
        q = torch.randn(batch, hq, d, device=dev, dtype=torch.bfloat16)
        kb = torch.randn(nblocks, bs, hkv, d, device=dev, dtype=torch.bfloat16)
        vb = torch.randn(nblocks, bs, hkv, d, device=dev, dtype=torch.bfloat16)
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            k, v = kb.to(dtype), vb.to(dtype)
            floor_us = 2 * batch * ctx * hkv * d * k.element_size() / 2.96e6
            ref = decode_attention.paged_decode(q, k, v, tables, seq_lens, d ** -0.5, sms)
            default_us = _us(decode_attention.paged_decode, q, k, v, tables, seq_lens, d ** -0.5, sms)
            best = None
            for cfg in cfgs:
                try:
                    y = decode_attention.paged_decode(q, k, v, tables, seq_lens, d ** -0.5, sms, cfg=cfg)
                    assert (y.float() - ref.float()).abs().max().item() < 0.05
                    t = _us(decode_attention.paged_decode, q, k, v, tables, seq_lens, d ** -0.5, sms, cfg=cfg)
                except Exception as e:  # noqa: BLE001
                    print(json.dumps({"skip": str(cfg), "why": repr(e)[:100]}), flush=True)
                    continue
                if best is None or t < best[0]:
                    best = (t, (cfg.block_n, cfg.num_warps, cfg.num_stages))
            row = {"attention": str(dtype).split(".")[-1], "batch": batch, "context": ctx,
                   "default_us": round(default_us, 1), "best_us": round(best[0], 1), "best_cfg": best[1],
                   "floor_us": round(floor_us, 1), "default_fraction": round(floor_us / default_us, 3)}
            if dtype != torch.bfloat16:    # V widened after its shared-memory staging, as Triton places it
                staged = dataclasses.replace(decode_attention.default_config(d, dtype), v_in_registers=False)
                row["v_after_staging_us"] = round(_us(decode_attention.paged_decode, q, k, v, tables, seq_lens,
                                                      d ** -0.5, sms, cfg=staged), 1)
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=".")
    p.add_argument("--m", default="16,64,128,256")
    p.add_argument("--skip", default="", help="gemm,attention")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "quant_kernels.jsonl"), "w") as out:
        if "attention" not in args.skip:
            _attention([(256, 1024), (64, 2048)], out)
        if "gemm" not in args.skip:
            _gemms([int(m) for m in args.m.split(",")], out)


if __name__ == "__main__":
    main()
