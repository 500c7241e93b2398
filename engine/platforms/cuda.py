"""The CUDA platform: Triton kernels over the paged KV cache, CUDA graphs for decode, NCCL.

Kernels live in `triton_kernels/` and are imported on first use, so this module (and its
layout checks) import on machines without triton or a GPU. Decode attention is capturable:
its launch shape depends only on tensor shapes, never on seq_lens values (see
triton_kernels/decode_attention.py). fused_ops off (--no-fused-ops) selects plain-torch layer ops.
"""
from __future__ import annotations

import torch

from baton.engine.platforms.base import LayerOps, Platform, is_fp8
from baton.models.attention_metadata import AttnMetadata

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


class TritonLayerOps(LayerOps):
    """Fused RMSNorm, add-RMSNorm, SiLU-and-mul, q/k norm + rotary in one kernel, and MoE experts
    as grouped GEMMs with the routing grouped on the device (capturable: no host sync)."""

    moe_graph_safe = True

    def rms_norm(self, x, weight, eps):
        from baton.engine.platforms.triton_kernels import layer_ops
        return layer_ops.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        from baton.engine.platforms.triton_kernels import layer_ops
        return layer_ops.add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x):
        from baton.engine.platforms.triton_kernels import layer_ops
        return layer_ops.silu_and_mul(x)

    def rms_norm_fp8(self, x, weight, eps):
        from baton.engine.platforms.triton_kernels import layer_ops
        if weight.dtype != x.dtype:        # the fused kernel rounds to x's dtype, as rms_norm does when they agree
            return super().rms_norm_fp8(x, weight, eps)
        return layer_ops.rms_norm_fp8(x, weight, eps)

    def add_rms_norm_fp8(self, x, residual, weight, eps):
        from baton.engine.platforms.triton_kernels import layer_ops
        if weight.dtype != x.dtype:
            return super().add_rms_norm_fp8(x, residual, weight, eps)
        return layer_ops.add_rms_norm_fp8(x, residual, weight, eps)

    def silu_and_mul_fp8(self, x):
        from baton.engine.platforms.triton_kernels import layer_ops
        return layer_ops.silu_and_mul_fp8(x)

    def qk_norm_rotary(self, q, k, q_weight, k_weight, eps, cos, sin, positions):
        from baton.engine.platforms.triton_kernels import layer_ops
        return layer_ops.qk_norm_rotary(q, k, q_weight, k_weight, eps, cos, sin, positions)

    def quantize_fp8_rows(self, x):
        from baton.engine.platforms.triton_kernels import quant
        return quant.quantize_fp8_rows(x)

    def scaled_mm(self, a, a_scale, w, w_scale, out_dtype):
        from baton.engine.platforms.triton_kernels import fp8_gemm
        return fp8_gemm.scaled_mm(a, a_scale, w, w_scale, out_dtype, fast_accum=self.fp8_fast_accum)

    moe_invariant = False      # False: tiles by rows per expert; deterministic mode fixes them

    def moe_route(self, router_logits, top_k, renormalize):
        from baton.engine.platforms.triton_kernels import moe_routing
        if top_k > router_logits.shape[-1] or router_logits.dim() != 2:
            return super().moe_route(router_logits, top_k, renormalize)
        return moe_routing.route(router_logits, top_k, renormalize)

    def moe_experts(self, x, w13, w2, ids, weights, scales=None, fp8_dots=None, foreign=False):
        from baton.engine.platforms.triton_kernels import moe
        return moe.fused_experts(x, w13, w2, ids, weights, invariant=self.moe_invariant, scales=scales,
                                 fp8_dots=fp8_dots, foreign=foreign)

    def make_batch_invariant(self, linear) -> None:
        """One tile shape whatever the batch: each output sums its K dimension in the same pieces
        with the same instructions, so a row's experts do not depend on the rows beside it."""
        super().make_batch_invariant(linear)
        self.moe_invariant = True


def _fused_sample(*args):
    from baton.engine.platforms.triton_kernels import sampling
    return sampling.sample(*args)


class CudaPlatform(Platform):
    name = "cuda"
    dist_backend = "nccl"
    supports_graphs = True
    supports_piecewise_graphs = True
    graphs_take_prompt_rows = True
    # deterministic mode's matmul piece: cuBLAS sees one shape; a decode step of fewer sequences
    # computes 256 rows, which costs about what reading the weights does on an H100 (~295 flop/byte)
    invariant_rows = 256

    def __init__(self, device: torch.device, fused_ops: bool = True):
        super().__init__(device)
        self.runtime = torch.cuda
        if fused_ops:
            self.ops = TritonLayerOps()
            self.fused_sample = _fused_sample
        self._num_sms: int | None = None

    # -- device -----------------------------------------------------------------------------
    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def memory_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)

    def bind_thread(self) -> None:
        torch.cuda.set_device(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def release_cached_memory(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def fp8_linear(self) -> str:
        """FP8 tensor cores: Ada and Hopper (compute capability 8.9) and newer."""
        major, minor = torch.cuda.get_device_capability(self.device)
        if (major, minor) < (8, 9):
            raise ValueError(f"FP8 weights need an FP8 tensor-core GPU (compute capability 8.9+: Ada, Hopper, "
                             f"Blackwell); {torch.cuda.get_device_name(self.device)} is {major}.{minor}")
        return "scaled_mm"

    def int8_linear(self) -> None:
        raise ValueError("--quantization w8a8 is the Ascend (and CPU) path; on CUDA use --quantization fp8")

    def w4a16_layout(self, w, dtype):
        """INT4 weights re-packed at load as the W4A16 kernels read them (triton_kernels/w4a16.py: a block of
        128 rows interleaved so each nibble plane is 16 consecutive rows)."""
        from baton.engine.platforms.triton_kernels import w4a16
        return w4a16.w4a16_layout(w)

    def w4a16_matmul(self, x, w):
        """INT4 weights: the Triton W4A16 GEMV / GEMM (triton_kernels/w4a16.py; large M: dequantized, then cuBLAS)."""
        from baton.engine.platforms.triton_kernels import w4a16
        return w4a16.w4a16_matmul(x, w)

    def check_kv_layout(self, block_size: int, head_dim: int, dtype: torch.dtype) -> None:
        if is_fp8(dtype):
            major, minor = torch.cuda.get_device_capability(self.device)
            if (major, minor) < (8, 9):
                raise ValueError(f"--kv-cache-dtype fp8 needs compute capability 8.9+ (Ada, Hopper, Blackwell): "
                                 f"Triton converts float8 e4m3 there; this GPU is {major}.{minor}")
        elif dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"cuda attention kernels take float16, bfloat16 or float32, not {dtype}")
        if head_dim < 16 or head_dim > MAX_HEAD_DIM or head_dim & (head_dim - 1):
            raise ValueError(f"cuda attention kernels need head_dim a power of two in [16, {MAX_HEAD_DIM}] "
                             f"(Triton tiles span the whole head), got {head_dim}")
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"cuda attention kernels need block_size a power of two, got {block_size}")

    @property
    def num_sms(self) -> int:
        if self._num_sms is None:
            self._num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        return self._num_sms

    # -- decode graphs ----------------------------------------------------------------------
    def capture_graph(self, fn, pool=None):
        """Kernels must already be compiled (the caller warms fn up first): Triton compiles on
        the host, and decode's partial buffers are allocated from the graph's pool."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return graph, out

    def graph_pool(self):
        return torch.cuda.graph_pool_handle()

    def capture_stream(self):
        """A side stream to capture on (the legacy default stream cannot be captured), entered. It
        first waits for the current stream: what was queued there (the static buffers' zero fills)
        must land before the side stream reads it. Without the wait the side stream does not wait (an
        H200 showed it: tests/test_platform_cuda.py), and with other processes keeping the device
        busy the capture's first gather could read positions not yet zeroed: the "index out of
        bounds" seen at start-up twice, with two and four workers starting on one GPU."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(stream)

    def begin_capture(self, pool):
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=pool)
        return graph

    def end_capture(self, graph) -> None:
        graph.capture_end()

    # -- KV cache and attention -------------------------------------------------------------
    checksum_in_pass = True

    def pack_kv(self, kv, index, checksum=None, first_block=0):
        from baton.engine.platforms.triton_kernels import kv_pack
        if not kv_pack.supported(kv):
            return super().pack_kv(kv, index, checksum, first_block)
        return kv_pack.pack(kv, index, checksum, first_block)

    def unpack_kv(self, kv, index, data, checksum=None, first_block=0):
        from baton.engine.platforms.triton_kernels import kv_pack
        if not kv_pack.supported(kv) or data.data_ptr() % 8:
            return super().unpack_kv(kv, index, data, checksum, first_block)
        kv_pack.unpack(kv, index, data, checksum, first_block)

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping, kv_scale=None) -> None:
        from baton.engine.platforms.triton_kernels import kv_store
        kv_store.store_kv(key, value, k_cache, v_cache, slot_mapping, kv_scale)

    def prefill_attention(self, q, k, v, k_cache, v_cache, meta: AttnMetadata, scale: float, kv_scale=None):
        nd = meta.num_decode_rows
        if nd and k_cache is not None and nd < meta.num_seqs:
            # a mixed step: its decode rows through the decode kernel, which reads each KV head once
            # for its group of query heads (the prefill kernel reads it once per query head, in
            # tiles of mostly padding for a one-token query)
            decode, prefill = meta.split_decodes()
            out = torch.empty_like(q)
            out[:nd] = self.decode_attention(q[:nd], k_cache, v_cache, decode, scale, kv_scale)
            out[nd:] = self._prefill(q[nd:], k[nd:], v[nd:], k_cache, v_cache, prefill, scale, kv_scale)
            return out
        return self._prefill(q, k, v, k_cache, v_cache, meta, scale, kv_scale)

    def _prefill(self, q, k, v, k_cache, v_cache, meta: AttnMetadata, scale: float, kv_scale=None):
        from baton.engine.platforms.triton_kernels import prefill_attention
        if meta.has_context and k_cache is not None:     # every key from the cache, times its scales
            return prefill_attention.varlen_prefill(
                q, k, v, meta.query_start_loc, meta.max_query_len, scale, seq_lens=meta.seq_lens,
                k_cache=k_cache, v_cache=v_cache, block_tables=meta.block_tables, kv_scale=kv_scale)
        if k_cache is not None and is_fp8(k_cache.dtype):   # this step's own keys rounded as the cache holds them
            from baton.engine.platforms.triton_kernels import kv_store
            k, v = kv_store.rounded_as_cached(k, v, kv_scale)
        return prefill_attention.varlen_prefill(q, k, v, meta.query_start_loc, meta.max_query_len, scale)

    def row_attention(self, q, k_cache, v_cache, rows: AttnMetadata, scale: float, kv_scale=None):
        """The decode kernel over every row with one split: a row's context is summed by one
        program in tiles of block_n from position 0, whatever the batch or the block-table width."""
        from baton.engine.platforms.triton_kernels import decode_attention
        cfg = decode_attention.invariant_config(q.shape[-1], k_cache.dtype)
        return decode_attention.paged_decode(q, k_cache, v_cache, rows.block_tables, rows.seq_lens, scale,
                                             self.num_sms, cfg, kv_scale=kv_scale)

    def decode_attention(self, q, k_cache, v_cache, meta: AttnMetadata, scale: float, kv_scale=None):
        """Splits derive from block_tables' width, fixed for a captured graph (the graph runner
        sizes it for max_model_len); each program reads its sequence length on the device."""
        from baton.engine.platforms.triton_kernels import decode_attention
        return decode_attention.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                             self.num_sms, kv_scale=kv_scale)
