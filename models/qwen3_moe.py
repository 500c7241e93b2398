"""Qwen3-MoE: Qwen3's attention with routed experts in place of the dense MLP on its sparse
layers (models/layers/moe.py). Checkpoints hold one tensor per expert
(`mlp.experts.E.gate_proj.weight`, ...), loaded into the stacked expert parameters."""
from __future__ import annotations

import re

from baton.models.decoder import MLP
from baton.models.layers.moe import SparseMoeBlock, is_moe_layer
from baton.models.qwen3 import Qwen3ForCausalLM

_EXPERT = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    # routed experts: decode graphs only where the platform's moe_experts is capturable
    # (LayerOps.moe_graph_safe; engine/runner/model_runner.py asks)
    uses_moe = True

    def __init__(self, config, ops, dtype=None, tp=None):
        super().__init__(config, ops, dtype=dtype, tp=tp)
        # the alltoall expert dispatch reads its pair counts on the host: eager steps only
        self.graph_safe = tp is None or tp.expert_parallel != "alltoall"

    def make_mlp(self, config, layer_idx, ops, tp, dtype):
        if is_moe_layer(config, layer_idx):
            return SparseMoeBlock(config, ops, tp, dtype)
        return MLP(config, ops, tp, dtype)

    def remap_weight(self, name: str):
        m = _EXPERT.match(name)
        if m is None:
            return None
        stacked = "w2" if m[3] == "down_proj" else "w13"
        return f"{m[1]}.experts.{stacked}", (int(m[2]), m[3])
