"""The platform interface: everything device-specific the engine needs, behind one class.

A platform owns a torch device and provides paged-KV storage, attention for prefill
(varlen, prefix-aware) and decode (paged), optional fused layer ops, graph capture for
decode, collectives and memory info. The CPU platform is the reference every other one is
tested against; models and the scheduler never import a platform directly.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from baton.engine.platforms import kv_copy
from baton.models.layers import int4, quantization

if TYPE_CHECKING:
    from baton.models.attention_metadata import AttnMetadata


class LayerOps:
    """Plain-torch layer math; a platform may subclass with fused kernels (NPU, Triton).

    Numerics follow Hugging Face transformers exactly (norms in float32, rotary cos/sin in
    float32 then cast), so greedy tokens can be compared token for token.
    """

    # whether moe_experts can be captured into a device graph: this one reads per-expert counts
    # on the host, so the runner keeps MoE models eager on it (engine/runner/model_runner.py)
    moe_graph_safe: bool = False
    # whether make_batch_invariant makes moe_experts batch-invariant (engine/runner/batch_invariant.py)
    invariant_moe: bool = True
    # the matmul of the ops' own GEMMs (the experts'); deterministic mode swaps in a fixed-shape one
    linear = staticmethod(F.linear)

    def make_batch_invariant(self, linear) -> None:
        """Deterministic mode: `linear` is a matmul whose rows do not depend on each other's count."""
        self.linear = linear

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (rms_norm(x + residual), x + residual)."""
        s = x + residual
        return self.rms_norm(s, weight, eps), s

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Neox-style (rotate-half) rotary; q [T, Hq, D], k [T, Hkv, D], cos/sin [T, D]."""
        cos = cos.unsqueeze(1).to(q.dtype)
        sin = sin.unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def qk_norm_rotary(
        self, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
        eps: float, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head RMSNorm of q and k (none when the weights are None, as in Llama), then rotary
        at `positions` from the fp32 tables cos/sin [max_positions, D]. One kernel on CUDA."""
        if q_weight is not None:
            q, k = self.rms_norm(q, q_weight, eps), self.rms_norm(k, k_weight, eps)
        return self.rotary(q, k, cos[positions], sin[positions])

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    fp8_fast_accum = False      # --fp8-accumulation fast: CUDA's FP8 GEMMs only (the CPU sums in float32)

    def scaled_mm(self, a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
        """An FP8 linear's GEMM: e4m3 a [M, K] times e4m3 w [N, K] transposed, times a_scale [M, 1]
        and w_scale [1, N] (float32), float32 sums, [M, N] in out_dtype."""
        return torch._scaled_mm(a, w.t(), scale_a=a_scale, scale_b=w_scale, out_dtype=out_dtype)

    def quantize_fp8_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """FP8 weights' activations: each row of 2-D x as e4m3 with a float32 scale [M, 1]."""
        return quantization.quantize_rows(x)

    def _fp8_rows(self, x: torch.Tensor) -> quantization.Fp8Rows:
        return quantization.Fp8Rows(*self.quantize_fp8_rows(x.reshape(-1, x.shape[-1])))

    def rms_norm_fp8(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> quantization.Fp8Rows:
        """rms_norm, then quantize_fp8_rows: the input of an FP8 projection (one kernel on CUDA)."""
        return self._fp8_rows(self.rms_norm(x, weight, eps))

    def add_rms_norm_fp8(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                         eps: float) -> tuple[quantization.Fp8Rows, torch.Tensor]:
        normed, total = self.add_rms_norm(x, residual, weight, eps)
        return self._fp8_rows(normed), total

    def silu_and_mul_fp8(self, x: torch.Tensor) -> quantization.Fp8Rows:
        """silu_and_mul, then quantize_fp8_rows (one kernel on CUDA)."""
        return self._fp8_rows(self.silu_and_mul(x))

    def moe_route(self, router_logits: torch.Tensor, top_k: int,
                  renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3-MoE's gating: softmax over all experts in float32, the top-k, renormalised to
        sum 1 when `renormalize`. Returns (expert ids [T, k] int64, weights [T, k] float32)."""
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights

    def moe_experts(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor, scales: quantization.ExpertScales | None = None,
                    fp8_dots: bool | None = None, foreign: bool = False) -> torch.Tensor:
        """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]), experts SwiGLU with stacked weights
        w13 [E, 2I, H], w2 [E, H, I]. `foreign`: an id equal to E marks a pair another rank computes
        (expert parallelism, models/layers/expert_parallel.py); it adds nothing. Tokens are grouped by expert and each expert hit runs
        once, added in expert order (as transformers adds them, so fp32 sums match). The
        per-expert counts are read on the host, so this is not capturable (moe_graph_safe =
        False); the CUDA platform's fused path is (triton_kernels/moe.py). With `scales` the
        stacks are e4m3 (--quantization fp8): each expert's weights widened to x's dtype (exact),
        its products times their output channels' scales in float32, as the fused kernel does;
        and where `fp8_dots` (None: quantization.fp8_expert_dots by the step's shape, the fused
        kernel's rule) each GEMM's input rows are first rounded to e4m3 per token (quantize_rows)
        and the products scaled by token scale x channel scale: FP8 x FP8, the same numbers."""
        k = ids.shape[1]
        if fp8_dots is None:
            fp8_dots = quantization.fp8_expert_dots(ids.numel(), w13.shape[0])
        dots = scales is not None and fp8_dots
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()[:w13.shape[0]]   # (foreign pairs sort last)
        flat_weights = weights.reshape(-1)
        s13, s2 = scales or (None, None)
        out = torch.zeros_like(x)
        start = 0
        for expert, n in enumerate(counts):
            if not n:
                continue
            slots = order[start:start + n]
            start += n
            tokens = slots // k
            h = self.silu_and_mul(self._expert_matmul(x[tokens], w13, expert, s13, dots))
            h = self._expert_matmul(h, w2, expert, s2, dots) * flat_weights[slots, None]
            out.index_add_(0, tokens, h)
        return out

    def _expert_matmul(self, x: torch.Tensor, w: torch.Tensor, expert: int, scale: torch.Tensor | None,
                       dots: bool = False) -> torch.Tensor:
        if scale is None:
            return self.linear(x, w[expert])
        wide = torch.promote_types(x.dtype, torch.float32)
        if dots:                 # FP8 x FP8: the rows in e4m3 first, their scales beside the channels'
            xq, xs = quantization.quantize_rows(x)
            y = self.linear(xq.to(x.dtype), w[expert].to(x.dtype))
            return (y.to(wide) * xs.to(wide) * scale[expert]).to(x.dtype)
        y = self.linear(x, w[expert].to(x.dtype))             # e4m3 widens exactly; the scales in float32 (or wider)
        return (y.to(wide) * scale[expert]).to(x.dtype)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == quantization.FP8


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., Hkv, D] as the KV cache stores it: float8 e4m3 (--kv-cache-dtype fp8) holds x / scale
    (one scale per kv head, engine/runner/kv_scales.py; None: 1), saturating at +-448 instead of
    overflowing to NaN; any other dtype is a plain cast."""
    if is_fp8(dtype):
        if scale is not None:
            x = x.float() / scale[:, None]
        return x.clamp(-quantization.FP8_MAX, quantization.FP8_MAX).to(dtype)
    return x.to(dtype)


def from_cache_dtype(x: torch.Tensor, dtype: torch.dtype | None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Cached entries [..., Hkv, D] in `dtype`: a float8 cache's widened and times its per-head
    scale; any other cache's as they are."""
    if not is_fp8(x.dtype) or dtype is None:
        return x
    if scale is None:
        return x.to(dtype)
    return (x.float() * scale[:, None]).to(dtype)


def as_cached(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x rounded as the cache would hold it, in x's dtype: a prefill's own keys and values take
    the same rounding as those a later step reads back, so prefill and decode see one model."""
    return from_cache_dtype(to_cache_dtype(x, cache_dtype, scale), x.dtype, scale) if is_fp8(cache_dtype) else x


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Platform(ABC):
    """One accelerator family. Instances are bound to one device (`cpu`, `cuda:N`, `npu:N`)."""

    name: str = "base"
    dist_backend: str = "gloo"           # the collective library: tensor parallelism and device-direct KV
    supports_graphs: bool = False        # can capture decode steps (CUDA graphs, torchair)
    # can capture a forward piecewise, cut at its attention calls (engine/runner/prefill_graphs.py)
    supports_piecewise_graphs: bool = False
    # decode graphs may replay short prompt chunks as decode rows (engine/runner/input_builder.py: runs_as_rows): rows of one
    # sequence read the same blocks, which torch_npu's paged attention counts once per row against the
    # cache's size (a documented constraint), so Ascend keeps prompts on the prefill path
    graphs_take_prompt_rows: bool = False
    invariant_rows: int = 64             # deterministic mode's matmul piece (engine/runner/batch_invariant.py)

    def __init__(self, device: torch.device):
        self.device = device
        self.ops = LayerOps()
        # the device runtime (torch.cuda, torch_npu.npu) for streams and events; None where work
        # is done when the call returns (the CPU, and the NPU emulation, whose npu:N is the host)
        self.runtime = None

    # -- device -----------------------------------------------------------------------------
    @abstractmethod
    def default_dtype(self) -> torch.dtype: ...

    @abstractmethod
    def memory_info(self) -> tuple[int, int]:
        """(free bytes, total bytes) of the memory the KV cache will live in."""

    def synchronize(self) -> None:  # noqa: B027  (host-synchronous platforms need nothing)
        return None

    def release_cached_memory(self) -> None:  # noqa: B027  (the host's allocator keeps no cache of its own)
        """Hand the device memory the framework's allocator keeps for reuse back to the driver (a
        dropped engine's), so that the next engine's KV sizing, which asks the driver, finds it."""
        return None

    def bind_thread(self) -> None:  # noqa: B027
        """Make this platform's device the calling thread's current one (accelerators keep a
        current device per thread: kernels launch there)."""
        return None

    # -- streams and events (device-direct KV overlaps the engine's compute on its own stream) --
    def new_stream(self, high_priority: bool = False):
        """A stream of its own on this device (None without a runtime); high priority: its
        kernels go first when SMs free up."""
        if self.runtime is None:
            return None
        return self.runtime.Stream(self.device, priority=-1 if high_priority else 0)

    def on_stream(self, stream):
        """Context: work launched inside goes on `stream` (nothing to do without a runtime)."""
        if self.runtime is None or stream is None:
            return contextlib.nullcontext()
        return self.runtime.stream(stream)

    def record_event(self, stream=None, blocking: bool = False, timing: bool = False):
        """An event recorded now on `stream` (default: the calling thread's current stream);
        it passes when the work queued before it has. None without a runtime (work is done
        when it returns). `blocking`: waiting for it sleeps instead of spinning; `timing`: it
        can measure elapsed time to another such event."""
        if self.runtime is None:
            return None
        event = self.runtime.Event(blocking=blocking, enable_timing=timing)
        event.record(stream if stream is not None else self.runtime.current_stream(self.device))
        return event

    # (a platform may offer `fused_sample(logits, temperatures, seeds, has_seed, positions, step_seed,
    # bitmask=None)`: one-pass temperature sampling, structured output's token mask read in the same
    # pass; engine/runner/sampler.py falls back to plain torch)
    fused_sample = None

    def can_pin_memory(self) -> bool:
        """Page-locked host buffers make device <-> host copies asynchronous and faster."""
        return self.runtime is not None

    def fp8_linear(self) -> str:
        """How FP8 weights multiply here (models/layers/quantization.py): "scaled_mm" (a scaled
        FP8 GEMM) or "dequant" (the weights widened per call: a reference, not faster); a
        platform without either raises ValueError saying why."""
        raise ValueError(f"FP8 weights are not supported on {self.name}")

    def int8_linear(self) -> None:
        """Raise ValueError where W8A8 (`--quantization w8a8`) cannot run; the CPU's torch._int_mm
        is this base's w8a8_matmul."""
        return None

    def int8_weight_layout(self, weight: torch.Tensor) -> torch.Tensor:
        """An int8 weight [N, K] laid out as this platform's int8 GEMM reads it (same shape)."""
        return weight

    def w8a8_matmul(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """x [M, K] (float) times int8 weight [N, K] with per-channel scales [N] -> [M, N] in x's
        dtype: x's rows to int8 per token, an int8 GEMM accumulating in int32, then both scales."""
        xq, xs = quantization.quantize_rows_int8(x)
        acc = torch._int_mm(xq, weight.t())
        return (acc.float() * xs * scale).to(x.dtype)

    def w4a16_layout(self, w: int4.Int4Weight, dtype: torch.dtype) -> int4.Int4Weight:
        """An INT4 layer's packed weight (models/layers/int4.py's layout) as this platform's W4A16 GEMM
        reads it, for activations of `dtype`."""
        return w

    def w4a16_matmul(self, x: torch.Tensor, w: int4.Int4Weight) -> torch.Tensor:
        """x [M, K] (its columns already in w's row order) times the INT4 weight -> [M, N] in x's dtype.
        The reference: the weight dequantized per call ((q - zero) * scale in float32, then x's dtype)."""
        return F.linear(x, int4.dequantize(w, x.dtype))

    def check_kv_layout(self, block_size: int, head_dim: int, dtype: torch.dtype) -> None:  # noqa: B027
        """Raise ValueError naming the constraint if the KV layout is unsupported here."""
        return None

    # -- decode graphs (platforms with supports_graphs) -------------------------------------
    def capture_graph(self, fn, pool=None):
        """Capture fn() (one decode forward over static buffers) into a device graph sharing
        memory `pool`; returns (graph, output). graph.replay() reruns it in place, graph.pool()
        is the pool to share with the next capture."""
        raise NotImplementedError(f"{self.name} does not capture graphs")

    # piecewise (platforms with supports_piecewise_graphs): captures begun and ended around the ops
    # between two attention calls, all on the stream of `capture_stream()`, sharing `graph_pool()`
    def graph_pool(self):
        raise NotImplementedError(f"{self.name} does not capture graphs piecewise")

    def capture_stream(self):
        raise NotImplementedError(f"{self.name} does not capture graphs piecewise")

    def begin_capture(self, pool):
        raise NotImplementedError(f"{self.name} does not capture graphs piecewise")

    def end_capture(self, graph) -> None:
        raise NotImplementedError(f"{self.name} does not capture graphs piecewise")

    def before_replay(self, graph, meta, batch_size: int) -> None:  # noqa: B027
        """Refresh whatever a captured graph froze that this step changes (host-side arguments
        such as NPU attention's sequence lengths); `meta` is the step's own metadata, padded
        to `batch_size` rows in the graph. Nothing on CUDA."""
        return None

    # -- KV cache and attention -------------------------------------------------------------
    def allocate_kv_cache(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """[layers, 2, num_blocks, block_size, kv_heads, head_dim]; [l, 0] is K, [l, 1] is V."""
        return torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim,
                           dtype=dtype, device=self.device)

    def pack_kv(self, kv: torch.Tensor, index: torch.Tensor, checksum: torch.Tensor | None = None,
                first_block: int = 0) -> torch.Tensor:
        """Blocks `index` (block ids on kv's device) of the paged cache kv as one contiguous uint8
        payload on kv's device, queued on the current stream. With `checksum` (int64 [2] there), add
        to it the checksum of these blocks as blocks first_block, ... of a transfer (kv_copy.py).
        Here a copy, then a second read for the checksum; CUDA does both in one pass."""
        return kv_copy.pack(kv, index, checksum, first_block)

    def unpack_kv(self, kv: torch.Tensor, index: torch.Tensor, data: torch.Tensor,
                  checksum: torch.Tensor | None = None, first_block: int = 0) -> None:
        """Write the uint8 payload `data` (on kv's device, the size of `index`'s blocks) into blocks
        `index` of kv, adding its checksum to `checksum` as pack_kv does."""
        kv_copy.unpack(kv, index, data, checksum, first_block)

    # whether pack_kv / unpack_kv take the checksum in the copy's own pass (then it costs no extra read)
    checksum_in_pass: bool = False

    @abstractmethod
    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
        """Write key/value [T, Hkv, D] into caches [blocks, block_size, Hkv, D]; slot -1 = skip.
        kv_scale [2, Hkv] float32 (a float8 cache's K and V scales per kv head, engine/runner/kv_scales.py;
        None: 1): the cache holds key / kv_scale[0], value / kv_scale[1], and every attention
        below multiplies them back."""

    @abstractmethod
    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          k_cache: torch.Tensor | None, v_cache: torch.Tensor | None,
                          meta: AttnMetadata, scale: float, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of this step's tokens over each sequence's whole history.

        q [T, Hq, D]; k/v [T, Hkv, D] are this step's tokens (already stored in the cache).
        When meta.has_context, earlier tokens must be read from the cache via block_tables.
        """

    @abstractmethod
    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: AttnMetadata, scale: float, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """One query token per sequence, q [B, Hq, D], over paged caches -> [B, Hq, D]."""

    def row_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      rows: AttnMetadata, scale: float, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Deterministic mode's attention (engine/runner/batch_invariant.py): as decode_attention, one query
        row per entry of `rows`, but each row's reduction order must depend on its own length
        alone, never on the other rows (no split of the context by batch size)."""
        raise NotImplementedError(f"{self.name} has no batch-invariant attention: serve without --deterministic")
