"""A routed mixture of experts: the gate picks top-k experts per token, each expert is a SwiGLU
MLP, and their outputs are summed with the gate's weights (Qwen3-MoE's gating: softmax over
all experts in float32, top-k, renormalised when `norm_topk_prob`).

Every expert's weights live in two stacked parameters, w13 [E, 2*I, H] (gate rows, then up
rows) and w2 [E, H, I], so a platform can run all experts in one grouped kernel
(`LayerOps.moe_experts`). Tensor parallelism splits every expert's intermediate dimension, as
for a dense MLP (column-parallel w13, row-parallel w2, one all-reduce): all ranks hold every
expert, no token moves between ranks, and the gate runs replicated. Under expert parallelism
(--enable-expert-parallel) each rank instead holds E/N whole experts and an `ExpertDispatch` brings
the pairs to them (models/layers/expert_parallel.py).

Under --quantization fp8 both stacks hold e4m3 with one float32 scale per (expert, output
channel) in `FusedExperts.scales` (models/layers/quantization.py, `quantize_experts`; each
tensor-parallel rank's of its own slice).
"""
from __future__ import annotations

import torch
from torch import nn

from baton.models.layers.expert_parallel import ExpertPlacement, make_dispatch
from baton.models.layers.linear import ReplicatedLinear, TPInfo, _divide
from baton.models.layers.quantization import ExpertScales


def is_moe_layer(config, layer: int) -> bool:
    """Qwen3-MoE's rule: routed experts unless the layer is in mlp_only_layers, every
    decoder_sparse_step-th layer."""
    if getattr(config, "num_experts", 0) <= 0:
        return False
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return layer not in (getattr(config, "mlp_only_layers", None) or []) and (layer + 1) % step == 0


class FusedExperts(nn.Module):
    stacked_experts = True                  # quantization.quantize_fp8 quantizes w13 and w2 (quantize_experts)
    scales: ExpertScales | None = None      # set where w13 and w2 are e4m3

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPInfo, dtype,
                 placement: ExpertPlacement | None = None):
        super().__init__()
        self.tp, self.placement = tp, placement
        if placement is None:       # tensor-parallel: every expert, a 1/N slice of its intermediate
            self.num_experts, self.intermediate = num_experts, _divide(intermediate, tp.size, "moe_intermediate_size")
            self.shard = tp.rank
        else:                       # expert-parallel: this rank's whole experts
            self.num_experts, self.intermediate, self.shard = placement.num_local, intermediate, 0
        self.w13 = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate, hidden, dtype=dtype),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_experts, hidden, self.intermediate, dtype=dtype), requires_grad=False)
        self.w13.weight_loader = self.weight_loader
        self.w2.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int, str]) -> None:
        """One expert's checkpoint tensor (gate_proj / up_proj [I, H], down_proj [H, I]) into
        this rank's slice of the stacked parameter (expert-parallel: into each of this rank's slots
        holding that expert, whole; the others' skipped)."""
        expert, which = shard
        if self.placement is None:
            self._load_into(param, loaded, expert, which)
            return
        for slot in self.placement.local_slots(expert):
            self._load_into(param, loaded, slot, which)

    def _load_into(self, param: nn.Parameter, loaded: torch.Tensor, expert: int, which: str) -> None:
        n, r = self.intermediate, self.shard
        if which == "down_proj":
            param.data[expert].copy_(loaded[:, r * n:(r + 1) * n])
        else:
            row = 0 if which == "gate_proj" else n
            param.data[expert, row:row + n].copy_(loaded[r * n:(r + 1) * n])


class SparseMoeBlock(nn.Module):
    def __init__(self, config, ops, tp: TPInfo, dtype):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (supported: silu)")
        self.ops, self.tp = ops, tp
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = bool(getattr(config, "norm_topk_prob", False))
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, bias=False, dtype=dtype)
        self.gate.keep_dtype = True         # the router stays in the model dtype under --quantization
        placement = dispatch = None
        if tp.expert_parallel is not None:
            placement = ExpertPlacement(config.num_experts, tp.rank, tp.size, tp.redundant_experts)
            dispatch = make_dispatch(tp.expert_parallel, placement, ops, tp)
        self.dispatch = dispatch
        self.experts = FusedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size, tp, dtype,
                                    placement)

        self.expert_load: torch.Tensor | None = None     # routed pairs per expert, while counting (`count_load`)

    def count_load(self, on: bool = True) -> None:
        """Count routed pairs per expert from now on (a load profile for --ep-expert-load; run eager:
        a graph's padding rows would count too); off drops the counts."""
        self.expert_load = torch.zeros(self.gate.out_features, dtype=torch.int64, device=self.gate.weight.device) \
            if on else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k expert ids [T, k], their weights [T, k] in x's dtype)."""
        ids, weights = self.ops.moe_route(self.gate(x), self.top_k, self.norm_topk_prob)
        if self.expert_load is not None:
            self.expert_load.index_add_(0, ids.reshape(-1), torch.ones_like(ids.reshape(-1)))
        return ids, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        e = self.experts
        if self.dispatch is not None:
            return self.dispatch(x, ids, weights, e)
        out = self.ops.moe_experts(x, e.w13, e.w2, ids, weights, scales=e.scales)
        return self.tp.all_reduce(out)
