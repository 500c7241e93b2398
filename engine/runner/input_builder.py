"""A scheduled step's host inputs (engine/runner/step.py `StepInputs`), in one of two layouts:

- chunks (`chunk_inputs`): each sequence's new tokens as one query, decodes first, so a mixed step's
  attention runs them through the decode kernel; the generic path, for every request.
- rows (`row_inputs`): a decode step of one row per token, each attending to its sequence's context
  up to itself, so the decode graphs and kernels serve it with no padding; for steps verifying
  guesses and steps with short prompt chunks (`runs_as_rows`).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from baton.engine.config import EngineConfig
from baton.engine.runner.logits_processing import host_inputs
from baton.engine.runner.logprobs_device import PromptLogprobRows
from baton.engine.runner.step import LaunchedStep, StepInputs
from baton.engine.scheduling.multimodal import step_positions
from baton.engine.scheduling.scheduler import SchedulerOutput
from baton.engine.scheduling.sequence import PENDING

# A prompt chunk ending within this many tokens may run as decode rows (`runs_as_rows`): each of its
# rows reads its context again, which stays cheap (and in L2) this short
ROWS_PROMPT_CONTEXT = 512


class StepInputBuilder:
    """`drafts`: an EAGLE-3 head (engine/runner/draft_head.py) or None; `graphs_replay(n)`: can the decode
    graphs replay a step of n rows with prompt tokens among them (engine/runner/executor.py)."""

    def __init__(self, config: EngineConfig, drafts, graphs_replay: Callable[[int], bool]):
        self.block_size = config.block_size
        self.deterministic = config.deterministic
        self.drafts = drafts
        self.graphs_replay = graphs_replay
        self.eos_token_ids: list[int] = []     # min_tokens masks them (the engine sets them)
        # short prompt chunks as decode rows where decode graphs replay them; True: without graphs
        # too (tests: the same rows, eager)
        self.eager_prompt_rows = False

    def build(self, out: SchedulerOutput, prev: LaunchedStep | None = None) -> StepInputs:
        """The step's inputs as small numpy arrays: what the device needs, and what rank 0 sends to
        the other tensor-parallel ranks. Input tokens still pending (sampled by `prev`, not back yet)
        are marked to be taken from `prev`'s tokens on the device."""
        return self.row_inputs(out, prev) if self.runs_as_rows(out) else self.chunk_inputs(out, prev)

    def runs_as_rows(self, out: SchedulerOutput) -> bool:
        """Run the step as decode rows, one per token: a step verifying guesses, and, where the
        platform's decode graphs can replay all its rows (CUDA), a step with short prompt chunks (each
        ending within ROWS_PROMPT_CONTEXT tokens), whose eager forward costs the host far more than the
        device (~25 ms against ~1 ms of kernels for a 135M model on an H100: a Triton launch per op per
        layer). Requests with penalties, logprobs, prompt logprobs, a grammar or images take the
        generic path, as does every prompt chunk under --deterministic (its rows must not depend on the
        step) or a draft head."""
        items = out.scheduled
        if out.is_decode or not all(_row_ready(item) for item in items):     # (is_decode: no guesses either)
            return False
        chunks = [item for item in items if not _is_last_token(item)]
        if not chunks:
            return any(item.draft for item in items)           # plain decode steps: the generic path
        if self.drafts is not None or self.deterministic \
                or any(item.draft or item.seq.num_computed_tokens + item.num_new_tokens > ROWS_PROMPT_CONTEXT
                       for item in chunks):
            return False
        rows = sum(item.num_new_tokens for item in items)
        graphed = self.graphs_replay(rows)
        return self.eager_prompt_rows or graphed

    def chunk_inputs(self, out: SchedulerOutput, prev: LaunchedStep | None) -> StepInputs:
        """Each sequence's new tokens as one query; rows of one token (decodes) first."""
        bs = self.block_size
        order = list(range(len(out.scheduled))) if out.is_decode else \
            sorted(range(len(out.scheduled)), key=lambda i: out.scheduled[i].num_new_tokens != 1)
        items = [out.scheduled[i] for i in order]
        counts, begins, tables, ids = _gather(items)
        ends = begins + counts
        starts = np.zeros(len(items) + 1, np.int32)
        np.cumsum(counts, out=starts[1:])
        if out.is_decode:                                  # one token each: no per-token loop
            positions = begins
        else:
            positions = np.concatenate([np.arange(b, e) for b, e in zip(begins, ends, strict=True)])
        token_rows = np.repeat(np.arange(len(items)), counts)
        slots = tables[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        positions, mrope, image_chunks = step_positions(items, begins, ends, positions, starts, out.is_decode)
        pending_dst, pending_src = _pending(ids, prev, items, token_rows)
        rows = np.array([i for i, item in enumerate(items) if item.samples], np.int64)
        logit_rows = None
        sample_positions = [items[r].seq.num_tokens for r in rows.tolist()]
        if any(items[r].draft for r in rows.tolist()):
            # a verified step: a token is sampled at the last real token and after each guess
            per_row = [len(items[r].draft) + 1 for r in rows.tolist()]
            logit_rows = np.concatenate([np.arange(starts[r + 1] - n, starts[r + 1]) for r, n in zip(rows, per_row,
                                                                                                   strict=True)])
            sample_positions = [p + j for p, n in zip(sample_positions, per_row, strict=True) for j in range(n)]
            rows = np.repeat(rows, per_row)
        elif len(rows) < len(items):                       # some items sample nothing (a prompt's earlier chunk)
            logit_rows = (starts[1:] - 1)[rows].astype(np.int64)
        seqs = [items[r].seq for r in rows.tolist()]
        params = [q.params for q in seqs]
        wanted = [p.logprobs for p in params]
        sample_items = np.array([order[r] for r in rows.tolist()], np.int64)
        draft = None
        if self.drafts is not None:     # the head's pass: each row's next token, and where tokens are drawn
            # (a decode step draws every row's next token: all filled in on the device)
            next_ids = np.zeros_like(ids) if out.is_decode and len(rows) == len(items) else \
                _next_ids(ids, starts, items, ends)
            sample_logit_rows = logit_rows if logit_rows is not None else (starts[1:] - 1)[rows].astype(np.int64)
            draft = self.drafts.inputs(out, sample_items, next_ids, sample_logit_rows)
        return StepInputs(
            is_decode=out.is_decode, input_ids=ids, positions=positions, slots=slots,
            query_starts=starts, seq_lens=ends.astype(np.int32), block_tables=tables,
            max_query_len=int(counts.max()), has_context=bool((begins > 0).any()), rows=rows,
            sample_items=sample_items, num_decode_rows=len(items) if out.is_decode else int(np.argmax(counts != 1)),
            **_sampling(seqs), sample_positions=np.array(sample_positions, np.int64),
            pending_dst=pending_dst, pending_src=pending_src,
            mrope_positions=mrope, image_chunks=image_chunks, logit_rows=logit_rows,
            processing=host_inputs(seqs, [int(starts[r] - begins[r]) for r in rows.tolist()], self.eos_token_ids),
            num_logprobs=max((n for n in wanted if n is not None), default=-1), wanted_logprobs=wanted,
            constrained=any(p.structured is not None for p in params),
            prompt_logprob_rows=None if out.is_decode else _prompt_logprob_rows(items, order, begins, ends, starts),
            draft=draft,
        )

    def row_inputs(self, out: SchedulerOutput, prev: LaunchedStep | None) -> StepInputs:
        """A step as a decode step of one row per token: each row attends to its sequence's context up
        to itself (its own length over the sequence's block table; the step's keys are stored before any
        row attends). A verifying sequence samples at every row (after its last token and after each
        guess), a prompt's last chunk at its last row, an earlier chunk nowhere. A last token still being
        sampled by `prev` (scheduled past its guesses, as if they all held) is taken from its tokens on
        the device."""
        bs, items = self.block_size, out.scheduled
        n = len(items)
        counts, begins, tables, input_ids = _gather(items)
        sampled = np.zeros(int(counts.sum()), np.bool_)
        starts = np.zeros(n + 1, np.int64)
        np.cumsum(counts, out=starts[1:])
        for i, item in enumerate(items):
            if item.samples:
                sampled[starts[i + 1] - 1 - len(item.draft):starts[i + 1]] = True
        seq_of = np.repeat(np.arange(n), counts)                       # each row's scheduled item
        total = len(seq_of)
        positions = begins[seq_of] + np.arange(total) - starts[seq_of]
        row_tables = tables[seq_of]
        slots = row_tables[np.arange(total), positions // bs].astype(np.int64) * bs + positions % bs
        rows = np.flatnonzero(sampled)
        seqs = [items[r].seq for r in seq_of[rows].tolist()]
        pending_dst, pending_src = _pending(input_ids, prev, items, seq_of)
        sample_items = seq_of[rows]
        draft = None
        if self.drafts is not None:     # every row's next token is drawn (a verifying step: its guesses)
            draft = self.drafts.inputs(out, sample_items, np.zeros(total, np.int64), rows)
        return StepInputs(
            is_decode=True, input_ids=input_ids, positions=positions, slots=slots,
            query_starts=np.arange(total + 1, dtype=np.int32), seq_lens=(positions + 1).astype(np.int32),
            block_tables=row_tables, max_query_len=1, has_context=True, rows=rows,
            logit_rows=None if len(rows) == total else rows,       # (None: every row's)
            sample_items=sample_items, num_decode_rows=total, **_sampling(seqs),
            sample_positions=positions[rows] + 1, pending_dst=pending_dst, pending_src=pending_src, draft=draft)


def _gather(items) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(new tokens, tokens computed before, block tables [-1 padded], the input ids) of these items."""
    n = len(items)
    counts = np.fromiter((item.num_new_tokens for item in items), np.int64, n)
    begins = np.fromiter((item.seq.num_computed_tokens for item in items), np.int64, n)
    tables = np.full((n, max(len(item.seq.block_table) for item in items)), -1, np.int32)
    ids: list[int] = []
    for i, item in enumerate(items):
        seq = item.seq
        tables[i, :len(seq.block_table)] = seq.block_table
        ids += seq.token_ids[begins[i]:begins[i] + counts[i] - len(item.draft)] + item.draft
    return counts, begins, tables, np.asarray(ids, np.int64)


def _sampling(seqs: list) -> dict[str, np.ndarray]:
    """The sampling rows' settings (StepInputs' fields of the same names)."""
    params = [q.params for q in seqs]
    return dict(temperatures=np.array([p.temperature for p in params], np.float32),
                top_ks=np.array([p.top_k for p in params], np.int64),
                top_ps=np.array([p.top_p for p in params], np.float32),
                seeds=np.array([_signed64(q.sampling_seed or 0) for q in seqs], np.int64),
                has_seed=np.array([q.sampling_seed is not None for q in seqs], np.bool_))


def _pending(ids: np.ndarray, prev: LaunchedStep | None, items, item_of: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(input rows whose token is still pending, the rows of `prev`'s sampled tokens that hold them);
    `item_of`: each input row's scheduled item."""
    dst = np.flatnonzero(ids == PENDING)
    return dst.astype(np.int64), _rows_in(prev, [items[r].seq.seq_id for r in item_of[dst].tolist()])


def _row_ready(item) -> bool:
    """Can this item's tokens run as decode rows: no penalties, logprobs, prompt logprobs, grammar
    or images (the generic path serves those: a chunk of tokens per sequence)."""
    p = item.seq.params
    return not p.processes_logits and p.logprobs is None and p.prompt_logprobs is None and p.structured is None \
        and item.seq.mm is None


def _is_last_token(item) -> bool:
    """A decode item: the sequence's last token (and its guesses, if any)."""
    return item.num_new_tokens == 1 + len(item.draft) and item.seq.num_computed_tokens == item.seq.num_tokens - 1


def _rows_in(prev: LaunchedStep | None, seq_ids: list[int]) -> np.ndarray:
    """The rows of `prev`'s sampled tokens that hold these sequences' pending tokens."""
    if not seq_ids:
        return np.zeros(0, np.int64)
    if prev is None:
        raise RuntimeError("a scheduled token is still pending but no step in flight sampled it")
    where = prev.row_of()
    return np.array([where[s] for s in seq_ids], np.int64)


def _prompt_logprob_rows(items, order, begins, ends, starts) -> list[PromptLogprobRows]:
    """The prompt chunks of this step whose sequences asked for prompt logprobs: each position
    scores the prompt's next token (the last prompt position scores none: its token is sampled)."""
    rows = []
    for i, item in enumerate(items):
        seq = item.seq
        n = seq.params.prompt_logprobs
        end = min(int(ends[i]), seq.num_prompt_tokens - 1)
        if n is None or end <= begins[i]:
            continue
        count = end - int(begins[i])
        rows.append(PromptLogprobRows(order[i], np.arange(starts[i], starts[i] + count, dtype=np.int64),
                                      np.asarray(seq.token_ids[begins[i] + 1:end + 1], np.int64), int(begins[i]) + 1, n))
    return rows


def _next_ids(ids: np.ndarray, starts: np.ndarray, items, ends: np.ndarray) -> np.ndarray:
    """The token after each input row: the next row's, at a chunk's end the next prompt token (0 where
    the step draws it: filled in on the device)."""
    nxt = np.zeros_like(ids)
    nxt[:-1] = ids[1:]
    for i, item in enumerate(items):
        nxt[starts[i + 1] - 1] = 0 if item.samples else item.seq.token_ids[ends[i]]
    return nxt


def _signed64(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x
