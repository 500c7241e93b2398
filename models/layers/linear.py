"""Linear layers with tensor-parallel sharding and fused (packed) projections.

Each parameter carries a `weight_loader` that knows how a checkpoint tensor maps onto its
shard, so the loader only routes names; with tp_size 1 no torch.distributed is needed.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class TPInfo:
    def __init__(self, rank: int = 0, size: int = 1, group=None, expert_parallel: str | None = None,
                 redundant_experts: tuple[int, ...] = ()):
        self.rank, self.size, self.group = rank, size, group
        # None: MoE layers split every expert like a dense MLP; else the ranks hold whole experts and
        # this names the dispatch, with a second copy of each redundant (hot) expert
        # (models/layers/expert_parallel.py)
        self.expert_parallel, self.redundant_experts = expert_parallel, tuple(redundant_experts)
        # the one-shot all-reduce over symmetric memory for small tensors on CUDA, set at engine start
        # (models/layers/custom_all_reduce.py); None: torch.distributed's for every size
        self.custom_all_reduce = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks: `x` itself summed in place, or a new tensor (use the result)."""
        if self.size == 1:
            return x
        if self.custom_all_reduce is not None and self.custom_all_reduce.fits(x):
            return self.custom_all_reduce(x)
        dist.all_reduce(x, group=self.group)
        return x

    def reduce_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            ops) -> tuple[torch.Tensor, torch.Tensor]:
        """`ops.add_rms_norm(all_reduce(x), residual, ...)`: x is this rank's partial sum. In one kernel where
        the symmetric-memory all-reduce fuses it (models/layers/all_reduce_norm.py), else as written."""
        fused = self.custom_all_reduce
        if fused is not None and getattr(fused, "fused_norm", None) is not None and fused.fits_norm(x, residual, weight):
            return fused.add_rms_norm(x, residual, weight, eps)
        return ops.add_rms_norm(self.all_reduce(x), residual, weight, eps)


def _divide(n: int, by: int, what: str) -> int:
    if n % by:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {by}")
    return n // by


class LinearBase(nn.Module):
    # the matmul: F.linear, or deterministic mode's fixed-shape one (engine/runner/batch_invariant.py)
    matmul = staticmethod(F.linear)

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPInfo, dtype):
        super().__init__()
        self.tp = tp
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 2 and self.input_shard() is not None:
            offset, size = self.input_shard()
            loaded = loaded.narrow(1, offset, size)
        dst, size, src = self.output_shard(shard_id)
        param.data.narrow(0, dst, size).copy_(loaded.narrow(0, src, size))

    def output_shard(self, shard_id=None) -> tuple[int, int, int]:
        """Where a checkpoint tensor's output rows land: (offset in this rank's rows, how many,
        offset in the checkpoint tensor's rows). Packed layouts (models/layers/int4.py) shard by it too."""
        return 0, self.out_features, 0

    def input_shard(self) -> tuple[int, int] | None:
        """This rank's input columns of the checkpoint tensor, (offset, how many); None: all of them."""
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features, out_features, bias=False, tp: TPInfo | None = None, dtype=None):
        super().__init__(in_features, out_features, bias, tp or TPInfo(), dtype)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(self, in_features, out_features, bias=False, tp: TPInfo | None = None, dtype=None):
        tp = tp or TPInfo()
        super().__init__(in_features, _divide(out_features, tp.size, "output features"), bias, tp, dtype)

    def output_shard(self, shard_id=None):
        return 0, self.out_features, self.tp.rank * self.out_features


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several projections of the same input fused into one matmul (gate_up_proj)."""

    def __init__(self, in_features, output_sizes: list[int], bias=False, tp: TPInfo | None = None, dtype=None):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, tp, dtype)

    def output_shard(self, shard_id: int = 0):
        size = self.output_sizes[shard_id] // self.tp.size
        return sum(self.output_sizes[:shard_id]) // self.tp.size, size, self.tp.rank * size


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; heads split across ranks (kv heads replicated if fewer)."""

    def __init__(self, hidden_size, head_dim, num_heads, num_kv_heads, bias=False, tp: TPInfo | None = None,
                 dtype=None):
        tp = tp or TPInfo()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp.size, "attention heads")
        self.num_kv_heads = max(1, num_kv_heads // tp.size)
        self.kv_replicas = max(1, tp.size // num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        LinearBase.__init__(self, hidden_size, out, bias, tp, dtype)

    def output_shard(self, shard_id: str = "q"):
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        rank = self.tp.rank if shard_id == "q" else self.tp.rank // self.kv_replicas
        return offset, size, rank * size


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial sums all-reduced."""

    def __init__(self, in_features, out_features, bias=False, tp: TPInfo | None = None, dtype=None):
        tp = tp or TPInfo()
        super().__init__(_divide(in_features, tp.size, "input features"), out_features, bias, tp, dtype)

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:            # bias: added once, on rank 0
            param.data.copy_(loaded if self.tp.rank == 0 else torch.zeros_like(loaded))
            return
        super().weight_loader(param, loaded, shard_id)

    def input_shard(self):
        return self.tp.rank * self.in_features, self.in_features

    def forward(self, x, reduce: bool = True):
        """reduce=False: this rank's partial sum, for an op after it that all-reduces it itself
        (`TPInfo.reduce_add_rms_norm`)."""
        y = self.matmul(x, self.weight, self.bias)
        return self.tp.all_reduce(y) if reduce else y
