"""The roofline: the least time the device could spend on each executed step.

least(step) = max(bytes the step must move / measured copy bandwidth,
                  FLOPs it must compute / measured matmul rate)

bytes = weights read once (the LM head only when some row samples) + the embedding rows
        of the step's tokens + KV read for every context token already in the cache +
        KV written for every new token
FLOPs = 2 x layer weights x tokens + 2 x LM head x sampled rows
        + attention: 4 x layers x q_heads x head_dim per (query, key) pair, causal

Mixture of experts: "layer weights" in the FLOPs are the active ones (shared weights + top_k
experts per MoE layer); the weights read are the shared ones + per MoE layer the distinct experts
the step's tokens hit. Which experts a step hit is not observed (the engine would have to sync
to report it): the count is the expectation under uniform routing, E * (1 - (1 - k/E)^tokens)
(ModelShape.expected_experts_hit); random-weight presets route near-uniformly, trained routers
are skewed and hit fewer, so there the floor is a little high.

FP8 weights (--quantization fp8): the projections FP8 stores (ModelShape.fp8_matmul_params) count
one byte each and their FLOPs run at the measured FP8 GEMM rate; the routed experts (fp8_experts:
e4m3 under --quantization fp8, not under w8a8) count one byte per weight of the experts a step
hits, their FLOPs at the bf16 rate where they run weight-only (decode sizes: the fused kernel's
dots stay bf16) and at the FP8 rate above quantization.FP8_EXPERT_DOTS_ABOVE pairs an expert (FP8 x
FP8 dots); an FP8 KV cache counts one byte per element of K and V.

Activations are left out: they are what a perfect kernel keeps on chip.
`roofline_fraction` = sum of least times / measured wall time.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from baton.benchmarks.model_shape import ModelShape


@dataclass(slots=True)
class StepShape:
    """One executed step: per scheduled sequence (tokens already in its KV cache, new tokens
    fed this step), and how many sequences sample a token (get logits)."""
    contexts: list[tuple[int, int]]
    sampled: int

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.contexts)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for _, n in self.contexts)


@dataclass(slots=True, frozen=True)
class Ceilings:
    copy_bytes_per_s: float          # bytes read + written per second
    matmul_flops_per_s: float
    fp8_matmul_flops_per_s: float | None = None    # a scaled FP8 GEMM's rate (FP8 weights' runs)


class CostModel:
    def __init__(self, shape: ModelShape, dtype_bytes: int, fp8_weights: bool = False, kv_bytes: int | None = None,
                 fp8_experts: bool = False):
        self.shape = shape
        self.dtype_bytes = dtype_bytes
        self.fp8_params = shape.fp8_matmul_params if fp8_weights else 0
        self.fp8_experts = fp8_experts and shape.moe_layers > 0
        self.kv_per_token = shape.kv_bytes_per_token(kv_bytes or dtype_bytes)

    def step_bytes(self, step: StepShape) -> int:
        s = self.shape
        weights = s.streamed_matmul_params(step.tokens) + s.small_params + (s.head_params if step.sampled else 0)
        embedding_rows = step.tokens * s.hidden
        kv_read = sum(c for c, _ in step.contexts) * self.kv_per_token
        kv_written = step.tokens * self.kv_per_token
        narrow = self.fp8_params + (self.streamed_expert_params(step.tokens) if self.fp8_experts else 0)
        wide = weights - narrow + embedding_rows
        return round(wide * self.dtype_bytes + narrow) + kv_read + kv_written

    def streamed_expert_params(self, tokens: int) -> float:
        """Routed-expert weights a step of `tokens` tokens reads (the expected experts hit)."""
        s = self.shape
        return s.moe_layers * s.expected_experts_hit(tokens) * s.expert_params

    def step_flops(self, step: StepShape) -> int:
        s = self.shape
        # new token i (0-based) of a sequence with c cached tokens attends to c + i + 1 keys
        pairs = sum(n * c + n * (n + 1) // 2 for c, n in step.contexts)
        attention = 4 * s.layers * s.heads * s.head_dim * pairs
        return 2 * s.active_matmul_params * step.tokens + 2 * s.head_params * step.sampled + attention

    def expert_dots_flops(self, step: StepShape) -> int:
        """Routed-expert FLOPs a step runs FP8 x FP8 (FP8 experts above the dots' bound), else 0."""
        if not self.fp8_experts:
            return 0
        from baton.models.layers.quantization import fp8_expert_dots
        s = self.shape
        if not fp8_expert_dots(step.tokens * s.experts_per_token, s.num_experts):
            return 0
        return 2 * s.moe_layers * s.experts_per_token * s.expert_params * step.tokens

    def least_seconds(self, step: StepShape, ceilings: Ceilings) -> tuple[float, str]:
        """(least time, "memory" or "compute": which ceiling binds)."""
        t_mem = self.step_bytes(step) / ceilings.copy_bytes_per_s
        fp8_flops = (2 * self.fp8_params * step.tokens + self.expert_dots_flops(step)
                     if ceilings.fp8_matmul_flops_per_s else 0)
        t_flop = ((self.step_flops(step) - fp8_flops) / ceilings.matmul_flops_per_s
                  + (fp8_flops / ceilings.fp8_matmul_flops_per_s if fp8_flops else 0.0))
        return (t_mem, "memory") if t_mem >= t_flop else (t_flop, "compute")


def roofline_report(cost: CostModel, ceilings: Ceilings, steps: Sequence[StepShape], wall_seconds: float,
                    step_seconds: Sequence[float] | None = None) -> dict:
    """Σ least times against the wall time, overall and (with measured step times) by kind."""
    least, bound = [], {"memory": 0, "compute": 0}
    total_bytes = total_flops = 0
    for step in steps:
        t, which = cost.least_seconds(step, ceilings)
        least.append(t)
        bound[which] += 1
        total_bytes += cost.step_bytes(step)
        total_flops += cost.step_flops(step)
    report = {
        "steps": len(steps), "least_seconds": sum(least), "wall_seconds": wall_seconds,
        "roofline_fraction": sum(least) / wall_seconds if wall_seconds > 0 else None,
        "bytes": total_bytes, "flops": total_flops,
        "memory_bound_steps": bound["memory"], "compute_bound_steps": bound["compute"],
        "ceilings": {"copy_bytes_per_s": ceilings.copy_bytes_per_s,
                     "matmul_flops_per_s": ceilings.matmul_flops_per_s,
                     "fp8_matmul_flops_per_s": ceilings.fp8_matmul_flops_per_s},
        "fp8_weight_params": cost.fp8_params, "fp8_experts": cost.fp8_experts, "kv_bytes_per_token": cost.kv_per_token,
    }
    if cost.shape.moe_layers:
        report["moe"] = moe_accounting(cost.shape)
    if step_seconds is not None:
        report["by_kind"] = _by_kind(steps, least, step_seconds)
    return report


def moe_accounting(shape: ModelShape) -> dict:
    """How a mixture-of-experts model's steps are counted, for the JSON."""
    return {
        "flops": "2 x active params (shared + top_k experts per MoE layer) per token",
        "expert_bytes": "per MoE layer, the expected distinct experts the step's n tokens hit under uniform "
                        "routing, E * (1 - (1 - k/E)^n): an estimate, the engine does not report the experts hit",
        "experts": shape.num_experts, "experts_per_token": shape.experts_per_token, "moe_layers": shape.moe_layers,
        "expert_params": shape.expert_params, "shared_matmul_params": shape.shared_matmul_params,
        "active_matmul_params": shape.active_matmul_params,
        "experts_hit_at": {n: round(shape.expected_experts_hit(n), 2) for n in (1, 16, 64, 256)},
    }


def _by_kind(steps: Sequence[StepShape], least: Sequence[float], measured: Sequence[float]) -> dict:
    out = {}
    for kind in ("decode", "prefill"):
        idx = [i for i, s in enumerate(steps) if s.is_decode == (kind == "decode")]
        spent = sum(measured[i] for i in idx)
        out[kind] = {"steps": len(idx), "least_seconds": sum(least[i] for i in idx), "measured_seconds": spent,
                     "roofline_fraction": sum(least[i] for i in idx) / spent if spent > 0 else None}
    return out

