"""The Ascend NPU platform: torch_npu fused attention over the paged KV cache, fused layer
ops, decode graphs through aclgraph (torch.npu.NPUGraph), HCCL collectives.

Written against the torch_npu / torchair APIs as documented for torch_npu 2.8.0+ (op-plugin
7.2.0+, CANN 8.3+; see docs/npu.md for each call's source). It has never run on an Ascend
device: CI exercises these call sites through `npu_emulation`, a plain-torch stand-in for the
documented op semantics, which tests our use of the API and says nothing about the hardware.
"""
from __future__ import annotations

import os

import torch

from engine.attention_metadata import AttnMetadata
from engine.platforms.base import LayerOps, Platform

MASK_SIZE = 2048            # fused attention's compressed causal mask (sparse_mode 2/3/4) is 2048x2048
PAGED_PREFILL_BLOCK = 128   # FIA paged KV with Q_S > 1 needs block_size in [128, 512], a multiple of 128
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def load_torch_npu():
    """The real torch_npu when it imports; the emulation only when asked for explicitly."""
    if os.environ.get("BATON_NPU_EMULATION") == "1":
        from engine.platforms import npu_emulation
        return npu_emulation.emulated_torch_npu()
    try:
        import torch_npu  # noqa: F401  (registers the npu device with torch)
    except ImportError as exc:
        raise ValueError(
            f"--device npu:N needs torch_npu and the CANN runtime, which do not import here ({exc}). "
            "Install CANN + torch_npu (see README, Ascend section), or use --device cpu / cuda:N."
        ) from exc
    return torch_npu


class NpuLayerOps(LayerOps):
    """Fused RMSNorm, add-RMSNorm, rotary and SwiGLU; BATON_NPU_FUSED_OPS=0 selects plain torch."""

    def __init__(self, npu):
        self.npu = npu

    def rms_norm(self, x, weight, eps):
        return self.npu.npu_rms_norm(x, weight, epsilon=eps)[0]

    def add_rms_norm(self, x, residual, weight, eps):
        y, _, s = self.npu.npu_add_rms_norm(x, residual, weight, epsilon=eps)
        return y, s

    def rotary(self, q, k, cos, sin):
        # npu_rotary_mul takes 4-D input and broadcastable cos/sin: [1, T, N, D] with [1, T, 1, D]
        c = cos.to(q.dtype)[None, :, None, :]
        s = sin.to(q.dtype)[None, :, None, :]
        q = self.npu.npu_rotary_mul(q.unsqueeze(0), c, s, rotary_mode="half").squeeze(0)
        k = self.npu.npu_rotary_mul(k.unsqueeze(0), c, s, rotary_mode="half").squeeze(0)
        return q, k

    def silu_and_mul(self, x):
        return self.npu.npu_swiglu(x, dim=-1)


class NpuPlatform(Platform):
    name = "npu"
    dist_backend = "hccl"
    supports_graphs = True

    def __init__(self, device: torch.device, npu):
        super().__init__(device)
        self.npu = npu
        if os.environ.get("BATON_NPU_FUSED_OPS", "1") != "0":
            self.ops = NpuLayerOps(npu)
        self._mask: torch.Tensor | None = None

    @classmethod
    def create(cls, index: int) -> NpuPlatform:
        npu = load_torch_npu()
        device = npu.device(index)
        return cls(device, npu)

    # -- device -----------------------------------------------------------------------------
    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def memory_info(self) -> tuple[int, int]:
        return self.npu.mem_get_info(self.device)

    def synchronize(self) -> None:
        self.npu.synchronize(self.device)

    def check_kv_layout(self, block_size: int, head_dim: int, dtype: torch.dtype) -> None:
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"npu fused attention takes float16 or bfloat16, not {dtype}; "
                             "use --dtype bfloat16")
        if block_size % PAGED_PREFILL_BLOCK or not PAGED_PREFILL_BLOCK <= block_size <= 512:
            raise ValueError(f"npu fused attention over a paged cache needs block_size 128, 256, 384 or 512 "
                             f"(npu_fused_infer_attention_score with Q_S > 1), got {block_size}; "
                             "use --block-size 128")
        if head_dim > 512 or head_dim % 16:
            raise ValueError(f"npu fused attention needs head_dim <= 512 and a multiple of 16, got {head_dim}")

    # -- graphs (aclgraph) ------------------------------------------------------------------
    def capture_graph(self, fn, pool=None):
        graph = self.npu.NPUGraph()
        with self.npu.graph(graph, pool=pool):
            out = fn()
        return graph, out

    # -- KV cache and attention -------------------------------------------------------------
    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        # ATB ReshapeAndCache: k/v (T, KV_N, D), caches (nblk, bs, KV_N, D), int32 slots;
        # padding rows carry slot -1, which the op skips (as vllm-ascend relies on)
        self.npu._npu_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping.to(torch.int32))

    def causal_mask(self) -> torch.Tensor:
        if self._mask is None:     # 1/True = masked: the strict upper triangle
            ones = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=self.device)
            self._mask = torch.triu(ones, diagonal=1)
        return self._mask

    def prefill_attention(self, q, k, v, k_cache, v_cache, meta: AttnMetadata, scale: float):
        """BSND over the paged cache for every prefill (with or without cached context): one
        path, any head_dim (TND would need head_dim 128), new tokens already stored."""
        if k_cache is None:
            raise ValueError("npu prefill attention reads K/V from the paged cache; none was given")
        b = meta.num_seqs
        starts = meta.query_start_loc_cpu
        q_lens = [starts[i + 1] - starts[i] for i in range(b)]
        max_q = max(q_lens)
        hq, d = q.shape[1], q.shape[2]
        hkv = k_cache.shape[2]
        padded = q.new_zeros(b, max_q, hq, d)
        for i in range(b):
            padded[i, :q_lens[i]] = q[starts[i]:starts[i + 1]]
        nblk, bs = k_cache.shape[0], k_cache.shape[1]
        out, _ = self.npu.npu_fused_infer_attention_score_v2(
            padded, k_cache.view(nblk, bs, hkv * d), v_cache.view(nblk, bs, hkv * d),
            atten_mask=self.causal_mask(), block_table=meta.block_tables,
            actual_seq_qlen=q_lens, actual_seq_kvlen=list(meta.seq_lens_cpu),
            num_query_heads=hq, num_key_value_heads=hkv, softmax_scale=scale,
            input_layout="BSND", sparse_mode=3, block_size=bs)
        return torch.cat([out[i, :q_lens[i]] for i in range(b)], dim=0)

    def decode_attention(self, q, k_cache, v_cache, meta: AttnMetadata, scale: float):
        """One token per sequence: BSND q (B, 1, N, D) over the paged cache; no mask needed."""
        nblk, bs, hkv, d = k_cache.shape
        out, _ = self.npu.npu_fused_infer_attention_score_v2(
            q.unsqueeze(1), k_cache.view(nblk, bs, hkv * d), v_cache.view(nblk, bs, hkv * d),
            block_table=meta.block_tables, actual_seq_kvlen=self.decode_seq_lens(meta),
            num_query_heads=q.shape[1], num_key_value_heads=hkv, softmax_scale=scale,
            input_layout="BSND", sparse_mode=0, block_size=bs)
        return out.squeeze(1)

    def decode_seq_lens(self, meta: AttnMetadata):
        """FIA takes host lists for kv lengths; inside a captured graph they would be frozen at
        capture time, so graph replays pass a device tensor via torchair's variant instead."""
        if getattr(self, "capturing", False):
            return meta.seq_lens
        return [int(x) for x in meta.seq_lens.tolist()]
