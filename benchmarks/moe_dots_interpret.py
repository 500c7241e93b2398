"""The fused MoE expert kernels (engine/platforms/triton_kernels/moe.py) without a GPU: Triton's
interpreter runs them on CPU tensors, weight-only and FP8 x FP8, in every tile bucket of the CUDA
tests' shapes, against the base ops in float64. Needs triton beside the venv (not a dependency):

    python -m pip install --target /tmp/triton triton
    TRITON_INTERPRET=1 PYTHONPATH=/tmp/triton python -m baton.benchmarks.moe_dots_interpret

What the interpreter cannot show, so this does not use it: bfloat16 (its dots on bf16 come out as
garbage, ~1e10 off, the bf16 kernel included), and float32 -> e4m3 rounding (3 % of a row's
elements differ from torch's round-to-nearest-even, twice the error): the activations are float32
here and the row quantizer is torch's (quantization.quantize_rows, the numbers the Triton quantizer
gives on a GPU). The index, scale and epilogue logic is what it checks; the sm_90 code is not.
"""
from __future__ import annotations

import torch

from baton.engine.platforms.base import LayerOps
from baton.engine.platforms.triton_kernels import moe
from baton.models.layers.quantization import ExpertScales, quantize_rows, quantize_stacked

# (tokens, experts, top_k, hidden, intermediate): tests/test_platform_cuda.py's MOE_CASES but the largest
CASES = [(1, 16, 4, 128, 64), (5, 8, 2, 64, 32), (37, 16, 4, 128, 96), (300, 8, 2, 256, 128), (600, 8, 2, 128, 64)]


def main() -> None:
    moe.quantize_fp8_rows = quantize_rows
    d = torch.float64
    for tokens, experts, top_k, hidden, inter in CASES:
        g = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, hidden, generator=g)
        (q13, s13), (q2, s2) = (quantize_stacked(torch.randn(experts, n, k, generator=g) / k ** 0.5)
                                for n, k in ((2 * inter, hidden), (hidden, inter)))
        scales = ExpertScales(s13, s2)
        logits = torch.randn(tokens, experts, generator=g)
        logits[:, [0, experts - 1]] = -1e9
        ids, weights = LayerOps().moe_route(logits, top_k, renormalize=True)
        line = []
        for dots in (False, True):
            out = moe.fused_experts(x, q13, q2, ids, weights, scales=scales, fp8_dots=dots).double()
            ref = LayerOps().moe_experts(x.to(d), q13, q2, ids, weights.to(d), scales=scales, fp8_dots=dots)
            tiles = moe.pick_tiles(tokens * top_k, experts, hidden, inter, moe.FP8 if dots else x.dtype)
            line.append(f"{'FP8 x FP8' if dots else 'weight-only'} {float((out - ref).norm() / ref.norm()):.1e} "
                        f"(tiles {tiles.block_m}x{tiles.block_n}x{tiles.block_k}{' swapped' if tiles.swap else ''})")
        print(f"T={tokens} E={experts} k={top_k} H={hidden} I={inter}: " + ", ".join(line), flush=True)


if __name__ == "__main__":
    main()
