"""Triton kernels behind the CUDA platform: KV store, paged decode, varlen prefill, fused layer ops,
fused MoE experts (moe.py) and their gating and alignment (moe_routing.py); the alignment's torch
reference and its shapes (moe_align.py) are plain torch and import no triton.

Each kernel submodule imports triton at import time, so only `engine.platforms.cuda` imports them, and
only when a kernel first runs: the package itself stays importable on machines without triton.
"""
