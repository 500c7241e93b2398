"""Vocabulary embedding and LM head, split along the vocabulary across TP ranks."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from baton.models.layers.linear import TPInfo


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPInfo | None = None, dtype=None):
        super().__init__()
        self.tp = tp or TPInfo()
        self.vocab_size = vocab_size
        self.per_rank = (vocab_size + self.tp.size - 1) // self.tp.size
        self.start = self.tp.rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id=None):
        part = loaded[self.start:self.start + self.per_rank]
        param.data.zero_()
        param.data[:part.shape[0]].copy_(part)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mask = (local >= 0) & (local < self.per_rank)
        y = F.embedding(local.clamp(0, self.per_rank - 1), self.weight) * mask.unsqueeze(-1)
        return self.tp.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    matmul = staticmethod(F.linear)    # as LinearBase.matmul

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.matmul(hidden, self.weight)
        if self.tp.size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp.size)]
            dist.all_gather(parts, logits, group=self.tp.group)
            logits = torch.cat(parts, dim=-1)
        return logits[..., :self.vocab_size]
