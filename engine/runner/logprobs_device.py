"""Computing a step's logprobs on the device (records: engine/requests/logprobs.py).

Sampled tokens: log_softmax of the raw logits of the rows that asked, gathered at the token the
sampler drew, and their top N. Prompt tokens (`prompt_logprobs`): the logits of every position of
the prompt chunk the step ran, each scored on the prompt's next token. All tensor ops; the host
reads the small results when it reads the step's tokens (LaunchedStep.logprobs).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from baton.engine.requests.logprobs import TokenLogprob


@dataclass(slots=True)
class PromptLogprobRows:
    """Host side: one prefill chunk whose prompt tokens are scored."""
    item: int                    # its index among the step's scheduled items
    positions: np.ndarray        # [M] int64: input rows (flat) whose logits score...
    targets: np.ndarray          # [M] int64: ...these next prompt tokens
    first_index: int             # token index of targets[0] in its sequence
    n: int                       # top alternatives asked for


@dataclass(slots=True)
class StepLogprobs:
    """Device results of one step (None where no row asked)."""
    chosen: torch.Tensor | None = None          # [N] float32: each sampling row's drawn token's
    top_values: torch.Tensor | None = None      # [N, K]
    top_ids: torch.Tensor | None = None         # [N, K]
    prompt: list | None = None                  # [(PromptLogprobRows, logprob [M], values [M, n], ids [M, n])]


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def sampled_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, k: int, out: StepLogprobs) -> None:
    out.chosen = logprobs.gather(1, tokens[:, None].long())[:, 0]
    if k > 0:
        out.top_values, out.top_ids = logprobs.topk(k, dim=-1)


def prompt(hidden: torch.Tensor, compute_logits, rows: list[PromptLogprobRows], out: StepLogprobs) -> None:
    out.prompt = []
    for r in rows:
        positions = torch.as_tensor(r.positions, device=hidden.device)
        lp = log_softmax(compute_logits(hidden.index_select(0, positions)))
        targets = torch.as_tensor(r.targets, device=hidden.device)
        values, ids = lp.topk(r.n, dim=-1) if r.n > 0 else (lp[:, :0], lp[:, :0].long())
        out.prompt.append((r, lp.gather(1, targets[:, None])[:, 0], values, ids))


def to_host(out: StepLogprobs, tokens: list[int], wanted: list[int | None]) -> list[TokenLogprob | None]:
    """Each sampling row's record (`wanted`: its own N, None: it asked for none)."""
    if out.chosen is None:
        return [None] * len(tokens)
    chosen = out.chosen.tolist()
    values = out.top_values.tolist() if out.top_values is not None else None
    ids = out.top_ids.tolist() if out.top_ids is not None else None
    return [None if n is None else TokenLogprob(t, chosen[i], tuple(zip(ids[i][:n], values[i][:n], strict=True))
                                                if n else ())
            for i, (t, n) in enumerate(zip(tokens, wanted, strict=True))]


def prompt_to_host(out: StepLogprobs) -> list[tuple[int, int, list[TokenLogprob]]]:
    """[(scheduled item, token index of the first, records)] of the prompt chunks scored."""
    result = []
    for r, chosen, values, ids in out.prompt or []:
        v, i = values.tolist(), ids.tolist()
        result.append((r.item, r.first_index, [TokenLogprob(t, c, tuple(zip(i[k], v[k], strict=True)))
                                               for k, (t, c) in enumerate(zip(r.targets.tolist(), chosen.tolist(),
                                                                                strict=True))]))
    return result
