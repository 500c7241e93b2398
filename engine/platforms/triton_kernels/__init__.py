"""Triton kernels behind the CUDA platform: KV store, paged decode, varlen prefill, fused layer ops,
fused MoE experts (moe.py; its routing alignment, moe_align.py, is plain torch and imports no triton).

Each kernel submodule imports triton at import time, so only `engine.platforms.cuda` imports them, and
only when a kernel first runs: the package itself stays importable on machines without triton.
"""
