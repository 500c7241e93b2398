"""Expert parallelism (--enable-expert-parallel): each tensor-parallel rank holds E/N whole experts
(rank r the contiguous ids [r*E/N, (r+1)*E/N)) instead of a 1/N slice of every expert; attention and
the dense layers stay tensor-parallel. Two ways to bring tokens to their experts and back
(--expert-parallel-dispatch, `make_dispatch`):

- allreduce (the default): after TP attention every rank already holds every token, so each rank
  runs its own experts on all tokens' pairs routed to them and the combine is the all-reduce TP's
  MoE does anyway. Pairs routed elsewhere carry the id E_local (`LayerOps.moe_experts(foreign=True)`
  skips them), so each pair is computed once somewhere, every shape depends on T alone and the
  decode graphs stay captured. The same bytes cross the link as under TP.
- alltoall: each rank takes its 1/N share of the tokens, sends each (token, expert) pair to the
  rank owning the expert (torch.distributed.all_to_all_single, which gloo has on the CPU too),
  runs them, sends the results back, weights and sums its share, then all-gathers the shares.
  The per-rank counts are exchanged first and read on the host, so shapes follow the routing:
  this mode runs eager (no decode graphs). It is the layout a later attention-data-parallel mode
  needs, where tokens are not replicated; beside TP attention it moves fewer bytes only when
  k*H*(N-1)/N per token beats the all-reduce's.

Load balance (--ep-redundant-experts K): the K hottest experts of a load profile (tokens per
expert, `hot_experts`) get a second copy on another rank, and their pairs alternate between the
copies (`ExpertPlacement`). The profile is a file; `SparseMoeBlock.expert_load` counts a run's
routed pairs per expert to make one (docs/parallelism.md).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class ExpertPlacement:
    """Which experts each rank holds, as slots: rank r's slot j is global slot r*S + j, S =
    E/N + K/N. Expert e's home slot is e (rank e // (E/N)); each of the K `redundant` (hot) experts
    gets one more copy in an extra slot, on the next rank after its home with one free (its own
    only when the others' are taken: hot experts sharing a home outnumber them). A pair goes to one copy
    of its expert, picked by its token's row (row % copies), so a hot expert's tokens split
    evenly between its copies; weights and results are the same whichever copy runs."""

    def __init__(self, num_experts: int, rank: int, ranks: int, redundant: tuple[int, ...] = ()):
        if num_experts % ranks or len(redundant) % ranks:
            raise ValueError(f"--enable-expert-parallel splits the {num_experts} experts (and the {len(redundant)} "
                             f"redundant copies) over the {ranks} ranks evenly; that does not divide (use a "
                             "--tp-size that divides both)")
        if len(set(redundant)) != len(redundant) or not all(0 <= e < num_experts for e in redundant):
            raise ValueError(f"redundant experts must be distinct ids below {num_experts}, got {list(redundant)}")
        self.num_experts, self.rank, self.ranks = num_experts, rank, ranks
        self.per_rank = num_experts // ranks
        self.num_local = self.per_rank + len(redundant) // ranks       # slots a rank holds
        copies = [[self._slot(e // self.per_rank, e % self.per_rank)] for e in range(num_experts)]
        used = [0] * ranks
        for e in redundant:
            home = e // self.per_rank
            r = next(r for r in ((home + i) % ranks for i in range(1, ranks + 1)) if used[r] < len(redundant) // ranks)
            copies[e].append(self._slot(r, self.per_rank + used[r]))
            used[r] += 1
        width = max(len(c) for c in copies)
        self.table = torch.tensor([c + c[:1] * (width - len(c)) for c in copies])       # [E, copies]
        self.copies = torch.tensor([len(c) for c in copies])
        self._mine = {e: [s - rank * self.num_local for s in c if s // self.num_local == rank]
                      for e, c in enumerate(copies)}

    def _slot(self, rank: int, local: int) -> int:
        return rank * self.num_local + local

    def local_slots(self, expert: int) -> list[int]:
        """This rank's slots holding global expert `expert` (none, its home, a redundant copy)."""
        return self._mine[expert]

    def slots(self, ids: torch.Tensor) -> torch.Tensor:
        """Global ids [T, k] -> the global slot each pair runs in."""
        table, copies = self.table.to(ids.device), self.copies.to(ids.device)
        if table.shape[1] == 1:
            return table[ids, 0]
        rows = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)
        return table[ids, rows % copies[ids]]

    def localize(self, ids: torch.Tensor) -> torch.Tensor:
        """Global ids [T, k] -> this rank's local slots, num_local for a pair another rank computes."""
        local = self.slots(ids) - self.rank * self.num_local
        return torch.where((local >= 0) & (local < self.num_local), local, self.num_local)


class ExpertDispatch:
    """Runs a MoE layer's routed pairs on the ranks holding their experts; `__call__` returns the
    combined output [T, H] on every rank (what TP's all-reduced MoE returns)."""

    def __init__(self, placement: ExpertPlacement, ops, tp):
        self.placement, self.ops, self.tp = placement, ops, tp

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts) -> torch.Tensor:
        raise NotImplementedError


class AllReduceDispatch(ExpertDispatch):
    graph_safe = True

    def __call__(self, x, ids, weights, experts):
        local = self.placement.localize(ids)
        out = self.ops.moe_experts(x, experts.w13, experts.w2, local, weights, scales=experts.scales, foreign=True)
        return self.tp.all_reduce(out)


class AllToAllDispatch(ExpertDispatch):
    graph_safe = False         # the pair counts per rank are read on the host

    def __call__(self, x, ids, weights, experts):
        n, r = self.placement.ranks, self.placement.rank
        bounds = _shares(x.shape[0], n)
        lo, hi = bounds[r], bounds[r + 1]
        k, per = ids.shape[1], self.placement.num_local
        slots = self.placement.slots(ids[lo:hi]).reshape(-1)
        owner = torch.div(slots, per, rounding_mode="floor")
        order = torch.argsort(owner, stable=True)                         # pairs grouped by owning rank
        send = torch.bincount(owner, minlength=n)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.tp.group)
        send_n, recv_n = send.tolist(), recv.tolist()
        rows = x[lo:hi][order // k]
        got_rows = self._exchange(rows, recv_n, send_n)
        local = self._exchange(slots[order] % per, recv_n, send_n).unsqueeze(1)
        ones = torch.ones(local.shape, dtype=x.dtype, device=x.device)
        done = self.ops.moe_experts(got_rows, experts.w13, experts.w2, local, ones, scales=experts.scales)
        back = self._exchange(done, send_n, recv_n)                 # results in `order`'s pair order
        wide = torch.promote_types(x.dtype, torch.float32)         # each token's k results summed once, wide
        mine = torch.zeros(hi - lo, x.shape[1], dtype=wide, device=x.device)
        scaled = back.to(wide) * weights[lo:hi].reshape(-1)[order].to(wide).unsqueeze(1)
        mine.index_add_(0, order // k, scaled)
        return self._gather(mine.to(x.dtype), bounds)

    def _exchange(self, t: torch.Tensor, out_counts: list[int], in_counts: list[int]) -> torch.Tensor:
        out = torch.empty((sum(out_counts), *t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.all_to_all_single(out, t.contiguous(), output_split_sizes=out_counts, input_split_sizes=in_counts,
                               group=self.tp.group)
        return out

    def _gather(self, mine: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        """Every rank's share, padded to the largest for all_gather, cut and stacked in token order."""
        width = max(b - a for a, b in zip(bounds, bounds[1:], strict=False))
        padded = torch.zeros(width, mine.shape[1], dtype=mine.dtype, device=mine.device)
        padded[:mine.shape[0]] = mine
        parts = [torch.empty_like(padded) for _ in range(self.placement.ranks)]
        dist.all_gather(parts, padded, group=self.tp.group)
        return torch.cat([p[:b - a] for p, a, b in zip(parts, bounds, bounds[1:], strict=False)])


def _shares(tokens: int, ranks: int) -> list[int]:
    """Token bounds of the ranks' shares: as even as can be, the first ranks one larger."""
    base, extra = divmod(tokens, ranks)
    bounds = [0]
    for r in range(ranks):
        bounds.append(bounds[-1] + base + (r < extra))
    return bounds


DISPATCHES = {"allreduce": AllReduceDispatch, "alltoall": AllToAllDispatch}


def make_dispatch(mode: str, placement: ExpertPlacement, ops, tp) -> ExpertDispatch:
    if mode not in DISPATCHES:
        raise ValueError(f"expert-parallel dispatch must be one of {', '.join(DISPATCHES)}, got {mode!r}")
    return DISPATCHES[mode](placement, ops, tp)


def hot_experts(path: str, k: int) -> tuple[int, ...]:
    """The k experts with the most tokens in a load profile: a JSON file {"tokens_per_expert":
    [count of expert 0, ...]} (summed over the MoE layers); ties go to the lower id."""
    import json
    with open(path) as f:
        counts = json.load(f).get("tokens_per_expert")
    if not isinstance(counts, list) or len(counts) < k or not all(isinstance(c, (int, float)) for c in counts):
        raise ValueError(f"--ep-expert-load {path}: need {{\"tokens_per_expert\": [a count per expert]}} with at "
                         f"least {k} experts (--ep-redundant-experts)")
    return tuple(sorted(range(len(counts)), key=lambda e: (-counts[e], e))[:k])
