"""The Ascend NPU platform: torch_npu fused attention over the paged KV cache, fused layer
ops, decode graphs through aclgraph (torch.npu.NPUGraph) or torchair, HCCL collectives.

Written against torch_npu 2.10.0.post4 / CANN 9.1.0 (what Dockerfile.ascend installs; the
calls used exist from torch_npu 2.8.0 / op-plugin 7.2.0 on) and torchair as documented; see
docs/npu.md for each call's source. It has never run on an Ascend device: CI exercises these
call sites through `npu_emulation` (--npu-emulation), a plain-torch stand-in for the
documented op semantics, which tests our use of the API and says nothing about the hardware.

Options (EngineConfig, flags of the same names): npu_graph_mode aclgraph (default) | torchair;
the cache dir (torchair's compile cache under it); fused_ops off selects plain-torch layer ops
(MoE excepted: its plain form cannot be captured).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from baton.engine.config import PlatformOptions
from baton.engine.platforms.base import LayerOps, Platform
from baton.models.attention_metadata import AttnMetadata
from baton.models.layers import int4

MASK_SIZE = 2048            # fused attention's compressed causal mask (sparse_mode 2/3/4) is 2048x2048
PAGED_PREFILL_BLOCK = 128   # FIA paged KV with Q_S > 1 needs block_size in [128, 512], a multiple of 128
MAX_HEAD_DIM = 512
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
GRAPH_MODES = ("aclgraph", "torchair")


def load_torch_npu(index: int, emulation: bool = False):
    """(torch_npu, the torch.device of npu:index): the real torch_npu when it imports, the
    emulation (whose npu:N is the host CPU) only when `emulation` (--npu-emulation) asks for it."""
    if emulation:
        from baton.engine.platforms import npu_emulation
        npu = npu_emulation.emulated_torch_npu()
        return npu, npu.device(index)
    try:
        import torch_npu  # (registers the npu device and torch.npu with torch)
    except ImportError as exc:
        raise ValueError(
            f"--device npu:N needs torch_npu and the CANN runtime, which do not import here ({exc}). "
            "Install CANN + torch_npu (docs/npu.md, or Dockerfile.ascend), or use --device cpu / cuda:N."
        ) from exc
    torch_npu.npu.set_device(index)
    return torch_npu, torch.device("npu", index)


def load_torchair():
    try:
        import torchair
    except ImportError as exc:
        raise ValueError(f"--npu-graph-mode torchair needs torchair, which does not import here ({exc}); "
                         "use --npu-graph-mode aclgraph") from exc
    return torchair


class NpuMoeOps(LayerOps):
    """Qwen3-MoE's gating and experts through torch_npu's MoE ops (docs/npu.md, "MoE"), kept
    under --no-fused-ops too: the plain-torch moe_experts reads per-expert counts on the host,
    which a captured decode graph cannot; here they stay on the device as the grouped matmul's
    group_list, and every shape depends only on the token count."""

    moe_graph_safe = True
    invariant_moe = False     # the grouped matmul's tiling per expert is the op's own (deterministic mode refuses)

    def __init__(self, npu):
        self.npu = npu

    def moe_route(self, router_logits, top_k, renormalize):
        # float32 logits: the op's softmax and its weights take x's dtype; Qwen3-MoE routes in float32
        weights, ids, _ = self.npu.npu_moe_gating_top_k_softmax(router_logits.float(), k=top_k)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids.long(), weights

    def moe_experts(self, x, w13, w2, ids, weights, scales=None, fp8_dots=None, foreign=False):
        """Sort the (token, slot) rows by expert, run every expert's SwiGLU MLP as two grouped
        matmuls over its rows, then gather each token's k rows back, weighted and summed."""
        if foreign:                  # (EngineConfig refuses --enable-expert-parallel on npu before a model loads)
            raise ValueError("expert parallelism is not built for Ascend yet")
        if scales is not None:       # (the platform refuses --quantization fp8 before a model loads)
            raise ValueError("FP8 experts are not supported on Ascend (W8A8 is its quantized path)")
        t, k = ids.shape
        num_experts = w13.shape[0]
        rows, gather_idx, counts, _ = self.npu.npu_moe_init_routing_v2(
            x, ids.to(torch.int32), active_num=t * k, expert_num=num_experts, expert_tokens_num_type=1,
            expert_tokens_num_flag=True, active_expert_range=[0, num_experts], quant_mode=-1, row_idx_type=0)
        h = self._grouped_matmul(rows, w13, counts)
        h = self._grouped_matmul(self.silu_and_mul(h), w2, counts)
        return self._unpermute(h, gather_idx, weights.to(h.dtype))

    def _grouped_matmul(self, rows, weight, counts):
        # the op's 3-D weight is [E, K, N]; ours are nn.Linear's [E, N, K]: passed as a transposed
        # view on every call (no copy; the op documents transposed weights, vllm-ascend does the same)
        return self.npu.npu_grouped_matmul([rows], [weight.transpose(1, 2)], group_list=counts, split_item=2,
                                           group_type=0, group_list_type=1)[0]

    def _unpermute(self, h, gather_idx, weights):
        if torch.compiler.is_compiling():      # not documented for torchair graphs: its formula in torch
            k = weights.shape[1]
            return (h[gather_idx.long()].view(-1, k, h.shape[1]) * weights.unsqueeze(-1)).sum(dim=1)
        return self.npu.npu_moe_token_unpermute(h, gather_idx, probs=weights)


class NpuLayerOps(NpuMoeOps):
    """Fused RMSNorm, add-RMSNorm, rotary and SwiGLU (the MoE ops of NpuMoeOps too);
    --no-fused-ops selects plain torch for all but MoE.
    While torchair compiles, only npu_add_rms_norm (documented for TorchAir graphs on A2/A3) is
    kept; npu_rms_norm and npu_rotary_mul document graph mode for Ascend 950 only, npu_swiglu
    not at all, so those fall back to plain torch, which torchair lowers itself."""

    def rms_norm(self, x, weight, eps):
        if torch.compiler.is_compiling():
            return super().rms_norm(x, weight, eps)
        return self.npu.npu_rms_norm(x, weight, epsilon=eps)[0]

    def add_rms_norm(self, x, residual, weight, eps):
        y, _, s = self.npu.npu_add_rms_norm(x, residual, weight, epsilon=eps)
        return y, s

    def rotary(self, q, k, cos, sin):
        if torch.compiler.is_compiling():
            return super().rotary(q, k, cos, sin)
        # BSND with B = 1: input [1, T, N, D], cos/sin [1, T, 1, D] (the documented 1S1D broadcast)
        c = cos.to(q.dtype)[None, :, None, :]
        s = sin.to(q.dtype)[None, :, None, :]
        q = self.npu.npu_rotary_mul(q.unsqueeze(0), c, s, rotary_mode="half").squeeze(0)
        k = self.npu.npu_rotary_mul(k.unsqueeze(0), c, s, rotary_mode="half").squeeze(0)
        return q, k

    def silu_and_mul(self, x):
        if torch.compiler.is_compiling():
            return super().silu_and_mul(x)
        return self.npu.npu_swiglu(x, dim=-1)


@dataclass(slots=True)
class CapturedAttention:
    """One decode attention launch inside an aclgraph task group, kept to re-issue it with the
    step's kv lengths (FIA takes them as a host list, which capture freezes)."""
    handle: object
    args: tuple
    kwargs: dict
    workspace: torch.Tensor
    out: list[torch.Tensor]


class AclDecodeGraph:
    """A captured decode step (torch.npu.NPUGraph) and its attention task groups."""

    def __init__(self, graph, attention: list[CapturedAttention]):
        self.graph = graph
        self.attention = attention

    def replay(self) -> None:
        self.graph.replay()

    def pool(self):
        return self.graph.pool()


class NpuPlatform(Platform):
    name = "npu"
    dist_backend = "hccl"
    supports_graphs = True
    invariant_rows = 256     # deterministic mode's matmul piece (engine/runner/batch_invariant.py)

    def __init__(self, device: torch.device, npu, torchair=None, graph_cache_dir: str | None = None,
                 fused_ops: bool = True):
        """`torchair` (the module) selects torchair graph mode; None selects aclgraph."""
        super().__init__(device)
        self.npu = npu
        if not getattr(npu, "EMULATED", False):
            self.runtime = npu.npu               # streams and events: torch_npu.npu
        else:                                    # the emulated npu:N is the host: gloo moves its KV
            self.dist_backend = "gloo"
        self.ops = NpuLayerOps(npu) if fused_ops else NpuMoeOps(npu)
        self.torchair = torchair
        self.graph_cache_dir = graph_cache_dir
        self._mask: torch.Tensor | None = None
        self._capturing: list[CapturedAttention] | None = None    # set while an aclgraph capture runs
        self._compiled_steps = 0

    @classmethod
    def create(cls, index: int, options: PlatformOptions) -> NpuPlatform:
        if options.npu_graph_mode not in GRAPH_MODES:
            raise ValueError(f"--npu-graph-mode must be one of {', '.join(GRAPH_MODES)}, got {options.npu_graph_mode!r}")
        npu, device = load_torch_npu(index, options.npu_emulation)
        torchair = load_torchair() if options.npu_graph_mode == "torchair" else None
        return cls(device, npu, torchair, options.graph_cache_dir, options.fused_ops)

    # -- device -----------------------------------------------------------------------------
    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def memory_info(self) -> tuple[int, int]:
        return self.npu.npu.mem_get_info(self.device)

    def synchronize(self) -> None:
        self.npu.npu.synchronize(self.device)

    def release_cached_memory(self) -> None:
        self.npu.npu.synchronize(self.device)
        self.npu.npu.empty_cache()              # torch.npu.empty_cache, as torch.cuda's

    def bind_thread(self) -> None:
        self.npu.npu.set_device(self.device)     # the current npu is per thread, as on CUDA

    def fp8_linear(self) -> str:
        raise ValueError("FP8 weights are not supported on Ascend NPUs (torch_npu's quantized matmul takes int8, "
                         "Atlas A2/A3 have no FP8 matmul units); serve bf16 weights there")

    def int8_weight_layout(self, weight: torch.Tensor) -> torch.Tensor:
        """[N, K] with K-major storage: its .t() is the contiguous [K, N] ND weight npu_quant_matmul
        takes as x2 (what vllm-ascend stores)."""
        return weight.t().contiguous().t()

    def w8a8_matmul(self, x, weight, scale):
        """npu_dynamic_quant (per token: scale = row_max(|x|) / 127, y = round(x / scale)), then
        npu_quant_matmul(x1 int8 [M, K], x2 int8 [K, N], scale [N] float32, pertoken_scale [M] float32,
        output_dtype x's dtype) = x1 @ x2 * scale * pertoken_scale (docs/npu.md, "W8A8")."""
        xq, xs = self.npu.npu_dynamic_quant(x)
        return self.npu.npu_quant_matmul(xq, weight.t(), scale, pertoken_scale=xs, output_dtype=x.dtype)

    def w4a16_layout(self, w, dtype):
        """INT4 weights as npu_weight_quant_batchmatmul takes them (docs/npu.md, "W4A16"): the 4-bit values
        signed (q - 8, in [-8, 7]) as int32 [K, N], packed eight to an int32 by npu_convert_weight_to_int4pack
        ([K, N/8]); antiquant_scale the scales and antiquant_offset 8 - zero, both [K/g, N] in x's dtype (the
        op's rule), so (w + offset) * scale = (q - zero) * scale. Per-channel (one group) as [N]."""
        if w.group_size != w.in_features and w.group_size % 32:
            raise ValueError(f"INT4 group_size {w.group_size} cannot run on Ascend (npu_weight_quant_batchmatmul's "
                             "antiquant_group_size is a multiple of 32); supported: 32, 64, 128, ... or per channel")
        signed = int4.unpack_rows(w.qweight).to(torch.int32) - 8
        packed = self.npu.npu_convert_weight_to_int4pack(signed.contiguous())
        scale, offset = w.scales.to(dtype), (8 - w.zeros.to(torch.int32)).to(dtype)
        if w.group_size == w.in_features:
            scale, offset = scale.reshape(-1), offset.reshape(-1)
        return w._replace(qweight=packed, scales=scale, zeros=offset)

    def w4a16_matmul(self, x, w):
        """npu_weight_quant_batchmatmul(x [M, K], weight int4pack [K, N/8], antiquant_scale, antiquant_offset,
        antiquant_group_size g; 0 per channel) = x @ ((weight + offset) * scale)."""
        group = 0 if w.group_size == w.in_features else w.group_size
        return self.npu.npu_weight_quant_batchmatmul(x, w.qweight, w.scales, w.zeros, antiquant_group_size=group)

    def check_kv_layout(self, block_size: int, head_dim: int, dtype: torch.dtype) -> None:
        if dtype == torch.float8_e4m3fn:
            raise ValueError("--kv-cache-dtype fp8 is not supported on Ascend NPUs (fused attention reads a "
                             "float16/bfloat16 or int8 cache, no float8); use --kv-cache-dtype auto")
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"npu fused attention takes float16 or bfloat16, not {dtype}; use --dtype bfloat16")
        if block_size % PAGED_PREFILL_BLOCK or not PAGED_PREFILL_BLOCK <= block_size <= 512:
            raise ValueError(f"npu fused attention over a paged cache needs block_size 128, 256 or 512 "
                             f"(npu_fused_infer_attention_score_v2 with Q_S > 1: 128..512, a multiple of 128), "
                             f"got {block_size}; use --block-size 128")
        if head_dim > MAX_HEAD_DIM or head_dim % 16:
            raise ValueError(f"npu fused attention needs head_dim <= {MAX_HEAD_DIM} and a multiple of 16 "
                             f"(fp16/bf16 D alignment), got {head_dim}")

    # -- decode graphs ----------------------------------------------------------------------
    def capture_graph(self, fn, pool=None):
        if self.torchair is not None:
            return self._compile_torchair(fn)
        runtime = self.npu.npu
        graph = runtime.NPUGraph()
        self._capturing = []
        try:
            with runtime.graph(graph, pool=pool):
                out = fn()
            return AclDecodeGraph(graph, self._capturing), out
        finally:
            self._capturing = None

    def before_replay(self, graph, meta: AttnMetadata, batch_size: int) -> None:
        """Re-issue each captured attention task with this step's kv lengths (VA's
        FULL_DECODE_ONLY update, done before replay on the replay stream). Padding rows have one
        token, as graph_runner fills them."""
        if not isinstance(graph, AclDecodeGraph) or not graph.attention:
            return
        lens = list(meta.seq_lens_cpu) + [1] * (batch_size - meta.num_seqs)
        runtime = self.npu.npu
        stream = runtime.current_stream()
        fia = self.npu.npu_fused_infer_attention_score_v2
        for task in graph.attention:
            runtime.graph_task_update_begin(stream, task.handle)
            fia.out(*task.args, **task.kwargs, actual_seq_kvlen=lens, workspace=task.workspace, out=task.out)
            runtime.graph_task_update_end(stream)

    def _capture_attention(self, args: tuple, kwargs: dict, lens: list[int]) -> torch.Tensor:
        """FIA's `.out` variant in its own task group, with its max workspace, so before_replay
        can update its host-side lengths (torch_npu's graph-task API)."""
        runtime = self.npu.npu
        fia = self.npu.npu_fused_infer_attention_score_v2
        workspace = self.npu._npu_fused_infer_attention_score_v2_get_max_workspace(
            *args, **kwargs, actual_seq_kvlen=lens)
        query = args[0]
        out = [torch.empty_like(query), torch.empty(1, dtype=torch.float32, device=query.device)]
        stream = runtime.current_stream()
        runtime.graph_task_group_begin(stream)
        fia.out(*args, **kwargs, actual_seq_kvlen=lens, workspace=workspace, out=out)
        handle = runtime.graph_task_group_end(stream)
        self._capturing.append(CapturedAttention(handle, args, kwargs, workspace, out))
        return out[0]

    def _compile_torchair(self, fn):
        """NEVER RUN (no torchair here): compile the decode step for GE through torchair's
        cache_compile, one cache directory per capture (graph_runner captures in a fixed order:
        clear the directory when the model, dtype, max_num_seqs or CANN version changes)."""
        ta = self.torchair
        config = ta.CompilerConfig()
        config.experimental_config.frozen_parameter = True          # weights keep their addresses
        config.experimental_config.tiling_schedule_optimize = True  # FIA reads kv lengths on the device
        backend = ta.get_npu_backend(compiler_config=config)
        step = TorchairDecodeStep(fn)
        cache_dir = os.path.join(self.graph_cache_dir, f"decode-{self._compiled_steps}")
        self._compiled_steps += 1
        compiled = ta.inference.cache_compile(step.decode, backend=backend, dynamic=False, cache_dir=cache_dir)
        out = compiled()
        return TorchairDecodeGraph(step, compiled, out), out

    # -- KV cache and attention -------------------------------------------------------------
    def store_kv(self, key, value, k_cache, v_cache, slot_mapping, kv_scale=None) -> None:
        # (kv_scale: a float8 cache's; never here, check_kv_layout refuses one)
        # ATB ReshapeAndCache: k/v (T, KV_N, D), caches (nblk, bs, KV_N, D), int32 slots; graph
        # padding rows carry slot -1, which we rely on the op to skip (docs/npu.md: unverified)
        self.npu._npu_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping.to(torch.int32))

    def causal_mask(self) -> torch.Tensor:
        if self._mask is None:     # 1/True = masked: the strict upper triangle
            ones = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=self.device)
            self._mask = torch.triu(ones, diagonal=1)
        return self._mask

    def prefill_attention(self, q, k, v, k_cache, v_cache, meta: AttnMetadata, scale: float, kv_scale=None):
        """BSND over the paged cache for every prefill (with or without cached context): one
        path, any head_dim (TND would need head_dim 128); new tokens are already stored.
        Queries are padded to the longest; FIA's actual_seq_qlen marks each batch's real rows."""
        if k_cache is None:
            raise ValueError("npu prefill attention reads K/V from the paged cache; none was given")
        b = meta.num_seqs
        starts = meta.query_start_loc_cpu
        q_lens = [starts[i + 1] - starts[i] for i in range(b)]
        max_q = max(q_lens)
        hq, d = q.shape[1], q.shape[2]
        nblk, bs, hkv, _ = k_cache.shape
        padded = q.new_zeros(b, max_q, hq, d)
        for i in range(b):
            padded[i, :q_lens[i]] = q[starts[i]:starts[i + 1]]
        out, _ = self.npu.npu_fused_infer_attention_score_v2(
            padded, k_cache.view(nblk, bs, hkv * d), v_cache.view(nblk, bs, hkv * d),
            atten_mask=self.causal_mask(), block_table=meta.block_tables,
            actual_seq_qlen=q_lens, actual_seq_kvlen=list(meta.seq_lens_cpu),
            num_query_heads=hq, num_key_value_heads=hkv, softmax_scale=scale,
            input_layout="BSND", sparse_mode=3, block_size=bs)
        return torch.cat([out[i, :q_lens[i]] for i in range(b)], dim=0)

    def decode_attention(self, q, k_cache, v_cache, meta: AttnMetadata, scale: float, kv_scale=None):
        """One token per sequence: BSND q (B, 1, N, D) over the paged cache; no mask at Q_S = 1.
        kv lengths are a host list (meta.seq_lens_cpu, never read back from the device): under
        aclgraph capture the launch goes into a task group that before_replay refreshes; under
        torchair compilation torchair's variant reads them from the device instead."""
        nblk, bs, hkv, d = k_cache.shape
        args = (q.unsqueeze(1), k_cache.view(nblk, bs, hkv * d), v_cache.view(nblk, bs, hkv * d))
        kwargs = dict(block_table=meta.block_tables, num_query_heads=q.shape[1], num_key_value_heads=hkv,
                      softmax_scale=scale, input_layout="BSND", sparse_mode=0, block_size=bs)
        if self._capturing is not None:
            return self._capture_attention(args, kwargs, list(meta.seq_lens_cpu)).squeeze(1)
        if self.torchair is not None and torch.compiler.is_compiling():
            out, _ = self.torchair.ops.npu_fused_infer_attention_score_v2(
                *args, **kwargs, actual_seq_kvlen=meta.seq_lens.to(torch.int64))
        else:
            out, _ = self.npu.npu_fused_infer_attention_score_v2(
                *args, **kwargs, actual_seq_kvlen=list(meta.seq_lens_cpu))
        return out.squeeze(1)


    def row_attention(self, q, k_cache, v_cache, rows: AttnMetadata, scale: float, kv_scale=None):
        """Deterministic mode: prefill rows too through the decode call (Q_S = 1 per row, its own
        kv length), so a token sees one reduction whichever step computes it. That FIA reduces a
        row by its own kv length only, not by the batch, is what its documentation's per-batch
        actual_seq_kvlen implies; it is tested on the emulation, never on hardware."""
        return self.decode_attention(q, k_cache, v_cache, rows, scale)


class TorchairDecodeStep(torch.nn.Module):
    """cache_compile takes an undecorated method of a module instance; this one runs a decode
    step over graph_runner's static buffers. NEVER RUN."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def decode(self):
        return self.fn()


class TorchairDecodeGraph:
    """graph_runner's graph interface over a torchair-compiled step: replay reruns it and copies
    into the output captured first (torchair returns fresh tensors). NEVER RUN."""

    def __init__(self, step: TorchairDecodeStep, compiled, out: torch.Tensor):
        self.step, self.compiled, self.out = step, compiled, out

    def replay(self) -> None:
        self.out.copy_(self.compiled())

    def pool(self):
        return None
