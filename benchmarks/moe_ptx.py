"""The fused MoE expert kernels (engine/platforms/triton_kernels/moe.py) compiled for sm_90 (H100 /
H200) without a GPU: Triton's own ptxas, the device's Triton version beside the venv. Per tile
config and mode (bf16; "w-only": e4m3 weights widened, bf16 activations; "dots": FP8 x FP8; swapped
tiles: FP8 x FP8 with the weights as wgmma's A, moe._w13_silu_swapped_kernel / _w2_swapped_kernel), the
shared memory a block asks for (an H100 gives at most 232,448 bytes), the tensor-core instruction
and how many of them, the asynchronous copies (cp.async) and shared-memory stores (st.shared) in
the PTX. Arguments carry the divisibility-by-16 hints the JIT gives Qwen3-30B-A3B's shapes (pointers,
N, K, strides), without which Triton neither copies asynchronously nor pipelines:

    python -m pip install --target /tmp/triton36 triton==3.6.0       # the device image's Triton
    PYTHONPATH=/tmp/triton36 python -m baton.benchmarks.moe_ptx
"""
from __future__ import annotations

import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from baton.engine.platforms.triton_kernels import moe

SM90 = GPUTarget("cuda", 90, 32)
W13_ARGS = ("x_ptr", "x_scale_ptr", "w_ptr", "scale_ptr", "out_ptr", "slots_ptr", "block_expert_ptr", "num_slots",
            "num_experts", "N", "K", "top_k", "stride_x", "stride_we", "stride_wn", "stride_o")
W2_ARGS = ("a_ptr", "a_scale_ptr", "w_ptr", "scale_ptr", "out_ptr", "slots_ptr", "block_expert_ptr", "route_ptr",
           "num_slots", "num_experts", "N", "K", "stride_a", "stride_we", "stride_wn", "stride_o")
UNALIGNED = ("top_k", "num_slots")        # (T * k need not be a multiple of 16; k = 8)
T = moe.MoeTiles
# pick_tiles' buckets on Qwen3-30B-A3B (the FP8 ones at > 24 and > 96 pairs an expert), then moe_kernel's alternatives
CONFIGS = [("decode", T(16, 32, 128, 4, 5)), ("24-96 bf16", T(64, 64, 64, 4, 3)), ("24-96 FP8", T(64, 64, 128, 4, 3)),
           ("96+ bf16", T(128, 128, 64, 8, 4, 256, 64, 8, 4)), ("96+ FP8", T(128, 128, 128, 8, 3, 256, 128, 8, 3)),
           ("alt", T(64, 128, 128, 4, 3)), ("alt", T(128, 128, 128, 8, 4, 256, 128, 8, 4)),
           ("alt", T(128, 64, 128, 4, 4, 128, 128, 8, 3)), ("alt", T(64, 64, 256, 4, 3)),
           ("decode FP8", T(16, 64, 256, 4, 3, swap=True)), ("4-24 FP8", T(32, 64, 256, 4, 3, swap=True)),
           ("alt", T(16, 64, 128, 4, 4, swap=True)), ("alt", T(32, 128, 128, 4, 3, swap=True)),
           ("alt", T(32, 128, 256, 8, 3, swap=True))]
MODES = (("bf16", "bf16", "bf16"), ("w-only", "bf16", "fp8e4nv"), ("dots", "fp8e4nv", "fp8e4nv"))


def compile_kernel(fn, names: tuple[str, ...], types: dict[str, str], tiles: moe.MoeTiles, mode: str):
    sig = {n: types.get(n, "*fp32" if n.endswith("_ptr") else "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in UNALIGNED}
    consts = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k)
    if not tiles.swap:          # (the swapped kernels are FP8 x FP8 only)
        consts.update(PRECISION="tf32", FP8_W=mode != "bf16", FP8_A=mode == "dots")
    sig.update(dict.fromkeys(consts, "constexpr"))
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=SM90,
                          options=dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages))


def describe(kernel) -> str:
    ptx = kernel.asm["ptx"]
    ops = re.findall(r"wgmma\.mma_async\.[\w.]+", ptx) or re.findall(r"\bmma\.sync\.[\w.]+", ptx)
    kinds = ", ".join(sorted({o.split(".aligned.")[-1] for o in ops}))
    return (f"smem {kernel.metadata.shared:>7,} B  {len(ops):3d} x {kinds:<28} cp.async {ptx.count('cp.async.'):4d}  "
            f"st.shared {ptx.count('st.shared'):4d}")


def main() -> None:
    print(f"triton {triton.__version__}, sm_90")
    for label, tiles in CONFIGS:
        w2 = tiles.for_w2()
        for mode, act, weight in MODES[2:] if tiles.swap else MODES:
            w13_types = dict(x_ptr=f"*{act}", w_ptr=f"*{weight}", out_ptr="*bf16", slots_ptr="*i32",
                             block_expert_ptr="*i32")
            w2_types = dict(a_ptr=f"*{act}", w_ptr=f"*{weight}", slots_ptr="*i32", block_expert_ptr="*i32")
            kernels = ((moe._w13_silu_swapped_kernel, moe._w2_swapped_kernel) if tiles.swap
                       else (moe._w13_silu_kernel, moe._w2_kernel))
            for name, fn, names, types, t in (("w13", kernels[0], W13_ARGS, w13_types, tiles),
                                              ("w2", kernels[1], W2_ARGS, w2_types, w2)):
                head = (f"{label:<11} {mode:<7} {name:<4} {t.block_m}x{t.block_n}x{t.block_k} w{t.num_warps} "
                        f"s{t.num_stages}{' swapped' if t.swap else ''}")
                try:
                    print(f"{head:<42} {describe(compile_kernel(fn, names, types, t, mode))}", flush=True)
                except Exception as e:      # noqa: BLE001  (a config past the shared memory: say so, go on)
                    print(f"{head:<42} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
    main()
