"""What one step carries through the model runner: its host-side inputs (`StepInputs`, built by
ModelRunner.step_inputs) and, once queued on the device, the step in flight (`LaunchedStep`: its
sampled tokens on the device and coming to the host, its logprobs, a deferred sampling's hook).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from baton.engine.logits_processing import LogitsProcessing, ProcessingInputs
from baton.engine.logprobs import TokenLogprob
from baton.engine.logprobs_device import StepLogprobs, prompt_to_host, to_host
from baton.engine.scheduler import SchedulerOutput


@dataclass(slots=True)
class StepInputs:
    """One step's host-side inputs (numpy): token ids, positions, KV slots, per-sequence query
    starts, lengths and block tables, which rows sample, and their sampling settings."""
    is_decode: bool
    input_ids: np.ndarray            # [T] int64
    positions: np.ndarray            # [T] int64
    slots: np.ndarray                # [T] int64
    query_starts: np.ndarray         # [B+1] int32
    seq_lens: np.ndarray             # [B] int32
    block_tables: np.ndarray         # [B, W] int32, -1 padded
    max_query_len: int
    has_context: bool
    rows: np.ndarray                 # [N] int64: input rows (sequences) that sample a token
    sample_items: np.ndarray         # [N] int64: ...and their index in the scheduler's output
    num_decode_rows: int             # leading rows of one token each
    temperatures: np.ndarray         # [N] float32
    top_ks: np.ndarray               # [N] int64
    top_ps: np.ndarray               # [N] float32
    seeds: np.ndarray                # [N] int64
    has_seed: np.ndarray             # [N] bool
    sample_positions: np.ndarray     # [N] int64: index of the token being sampled
    pending_dst: np.ndarray          # [P] int64: input positions whose token is still on the device...
    pending_src: np.ndarray          # [P] int64: ...as row pending_src of the previous step's samples
    pending_dst_dev: torch.Tensor | None = None      # (their device copies, set on upload)
    pending_src_dev: torch.Tensor | None = None
    mrope_positions: np.ndarray | None = None        # [3, T] int64: a multimodal prefill step's (t, h, w)
    image_chunks: list | None = None                 # ...and its chunks that hold image tokens
    logit_rows: np.ndarray | None = None             # [N] int64: input token of each sampled row, when some
    #                                                  rows sample nothing or several; None: each item's last
    logit_rows_dev: torch.Tensor | None = None       # (on the device, uploaded with the step's other inputs)
    processing: ProcessingInputs | None = None       # penalties / biases / masks of the sampling rows, if any
    processing_dev: LogitsProcessing | None = None   # (their device copies, set on upload)
    num_logprobs: int = -1                           # the most top logprobs a sampling row asked for (-1: none)
    wanted_logprobs: list | None = None              # [N]: each sampling row's own (None: none)
    prompt_logprob_rows: list | None = None          # [PromptLogprobRows] of the prompt chunks to score
    logprobs_dev: StepLogprobs | None = None         # (the device results, set by run)
    constrained: bool = False                        # some sampling row has structured output: sampled later
    deferred: tuple | None = None                    # ...(logits, SamplingBatch, input ids) until then
    # an EAGLE-3 head (engine/draft_head.py): the token after each input row (those drawn this step filled
    # in on the device), the input row each sampled token is drawn at, the guesses drawn from q to test,
    # (meta, positions, the target's hidden states for the head, whether the decode graphs ran the step) until
    # the head's pass runs, and whether that pass keeps the head's outputs (else it writes only the head's KV)
    next_ids: np.ndarray | None = None
    sample_logit_rows: np.ndarray | None = None
    draft_checks: object | None = None
    head_args: tuple | None = None
    head_full: bool = True


@dataclass(slots=True)
class LaunchedStep:
    """A step queued on the device: its scheduler output, which scheduled items sample, and
    the sampled tokens, on the device and (coming) on the host. `slots`: where each item's
    token goes in its sequence (set when the scheduler advances)."""
    out: SchedulerOutput
    rows: list[int]                  # scheduled item of each sampled token
    seq_ids: list[int]               # seq_id of each scheduled item
    device_tokens: torch.Tensor | None
    host_tokens: torch.Tensor | None
    event: object
    slots: list[int | None] | None = None
    step_logprobs: StepLogprobs | None = None
    wanted_logprobs: list | None = None
    deferred: StepInputs | None = None   # launched, not sampled yet: ModelRunner.sample takes its masks
    finish: Callable[[], None] | None = None   # ...which `complete` then runs (the engine sets it)
    head_hidden: torch.Tensor | None = None    # an EAGLE-3 head's output at each input row (engine/draft_head.py)
    head_rows: np.ndarray | None = None        # ...and the input row of each sampled token

    def ready(self) -> bool:
        """Are the step's tokens on the host already (its copy landed)? False while they are not, and
        where no event tells (the CPU: its steps are scheduled past as a device's would be)."""
        return self.finish is None and self.deferred is None and self.event is not None and self.event.query()

    def complete(self) -> None:
        """Queue the deferred sampling, if any, once its masks are filled (structured output: they
        fill meanwhile, engine/llm_engine.py); whatever reads this step's tokens, or feeds them to
        the next step, calls this first."""
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()

    def token_logprobs(self, tokens: list[int | None]) -> list[TokenLogprob | None]:
        """Each scheduled item's sampled token's record (None: none asked); after `tokens()`."""
        result: list[TokenLogprob | None] = [None] * len(self.out.scheduled)
        if self.step_logprobs is None or self.step_logprobs.chosen is None:
            return result
        drawn = [tokens[item] for item in self.rows]
        for item, entry in zip(self.rows, to_host(self.step_logprobs, drawn, self.wanted_logprobs), strict=True):
            result[item] = entry
        return result

    def prompt_logprobs(self) -> list[tuple[int, int, list[TokenLogprob]]]:
        """[(scheduled item, token index of the first, records)] of the prompt tokens this step scored."""
        return prompt_to_host(self.step_logprobs) if self.step_logprobs is not None else []

    def row_of(self) -> dict[int, int]:
        """seq_id -> its row among the sampled tokens."""
        return {self.seq_ids[item]: k for k, item in enumerate(self.rows)}

    def row_tokens(self) -> list[int]:
        """The sampled token of each sampling row; waits for this step only."""
        self.complete()
        if self.event is not None:
            self.event.synchronize()
        return self.host_tokens.tolist() if self.host_tokens is not None else []

    def tokens(self) -> list[int | None]:
        """The sampled token of each scheduled item (None: it did not sample); waits for this
        step only."""
        values = self.row_tokens()
        result: list[int | None] = [None] * len(self.out.scheduled)
        for item, token in zip(self.rows, values, strict=True):
            result[item] = token
        return result

    def token_lists(self) -> list[list[int] | None]:
        """Every token sampled for each scheduled item, in order (several for an item with
        guesses: one after its last token and one after each guess); None: it did not sample."""
        values = self.row_tokens()
        result: list[list[int] | None] = [None] * len(self.out.scheduled)
        for item, token in zip(self.rows, values, strict=True):
            if result[item] is None:
                result[item] = []
            result[item].append(token)
        return result
