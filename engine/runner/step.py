"""What one step carries through the model runner, each record valid for a stated span:
`StepInputs` (host arrays, built once by engine/runner/input_builder.py, never changed), `DeviceInputs`
(their device copies, from the upload until the step's sampling is queued), `StepOutput` (what the
forward leaves: logprobs, a draft head's pending pass, a deferred sampling's logits) and, once queued
on the device, the step in flight (`LaunchedStep`: its sampled tokens on the device and coming back).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from baton.engine.requests.logprobs import TokenLogprob
from baton.engine.runner.logits_processing import LogitsProcessing, ProcessingInputs
from baton.engine.runner.logprobs_device import StepLogprobs, prompt_to_host, to_host
from baton.engine.runner.sampler import SamplingBatch
from baton.engine.scheduling.scheduler import SchedulerOutput
from baton.models.attention_metadata import AttnMetadata


@dataclass(frozen=True, slots=True)
class DraftInputs:
    """An EAGLE-3 head's share of a step (engine/runner/draft_head.py), on the host: the token after each
    input row (0 where the step draws it: filled in on the device), the input row each sampled token
    is drawn at, the guesses drawn from q to test (DraftChecks, None: none), and whether the head's
    pass keeps its outputs (else it writes only the head's KV)."""
    next_ids: np.ndarray             # [T] int64
    sample_logit_rows: np.ndarray    # [N] int64
    checks: object | None
    full: bool


@dataclass(frozen=True, slots=True)
class StepInputs:
    """One step's host-side inputs (numpy): token ids, positions, KV slots, per-sequence query
    starts, lengths and block tables, which rows sample, and their sampling settings. What rank 0
    sends the other tensor-parallel ranks."""
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
    mrope_positions: np.ndarray | None = None        # [3, T] int64: a multimodal prefill step's (t, h, w)
    image_chunks: list | None = None                 # ...and its chunks that hold image tokens
    logit_rows: np.ndarray | None = None             # [N] int64: input token of each sampled row, when some
    #                                                  rows sample nothing or several; None: each item's last
    processing: ProcessingInputs | None = None       # penalties / biases / masks of the sampling rows, if any
    num_logprobs: int = -1                           # the most top logprobs a sampling row asked for (-1: none)
    wanted_logprobs: list | None = None              # [N]: each sampling row's own (None: none)
    prompt_logprob_rows: list | None = None          # [PromptLogprobRows] of the prompt chunks to score
    constrained: bool = False                        # some sampling row has structured output: sampled later
    draft: DraftInputs | None = None                 # with an EAGLE-3 head


@dataclass(frozen=True, slots=True)
class DeviceInputs:
    """A step's inputs on the device, views of one upload (engine/runner/staging.py): made when the step runs,
    held until its sampling is queued (at once, or by ModelRunner.sample for a deferred one). Only
    `input_ids` changes: tokens still pending from the step before are filled in on the device."""
    meta: AttnMetadata
    input_ids: torch.Tensor
    positions: torch.Tensor
    sampling: SamplingBatch
    pending_dst: torch.Tensor
    pending_src: torch.Tensor
    logit_rows: torch.Tensor | None              # StepInputs.logit_rows (None: each item's last token)
    processing: LogitsProcessing | None          # StepInputs.processing


@dataclass(frozen=True, slots=True)
class HeadPass:
    """An EAGLE-3 head's pass over a step, as the target's forward left it, waiting for the step's
    tokens (engine/runner/draft_head.py `pass_over_step`)."""
    meta: AttnMetadata
    positions: torch.Tensor
    aux: torch.Tensor                # the target's hidden states the head reads
    graphs: object | None            # the decode graphs that ran the step (they replay the pass); None: eager
    draft: DraftInputs


@dataclass(frozen=True, slots=True)
class StepLogits:
    """The logits of a step's sampling rows, and the inputs that sample them."""
    inputs: StepInputs
    device: DeviceInputs
    logits: torch.Tensor


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What a step's forward leaves on rank 0: the sampled tokens on the device, or (structured output)
    the logits sampled once the masks are known (`deferred`); the logprobs being computed; the draft
    head's pass, run once the tokens are drawn."""
    sampled: torch.Tensor | None
    logprobs: StepLogprobs | None
    head: HeadPass | None
    deferred: StepLogits | None = None


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
    deferred: StepOutput | None = None   # launched, not sampled yet: ModelRunner.sample takes its masks
    finish: Callable[[], None] | None = None   # ...which `complete` then runs (the engine sets it)
    head_hidden: torch.Tensor | None = None    # an EAGLE-3 head's output at each input row (engine/runner/draft_head.py)
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

    def record_logprobs(self, tokens: list[int | None]) -> None:
        """Keep the step's logprob records on their sequences, by token index (after `tokens()`)."""
        scheduled = self.out.scheduled
        for item, entry in enumerate(self.token_logprobs(tokens)):
            slot = self.slots[item]
            if entry is not None and slot is not None:
                seq = scheduled[item].seq
                seq.logprobs = seq.logprobs or {}
                seq.logprobs[slot] = entry
        for item, first, entries in self.prompt_logprobs():
            seq = scheduled[item].seq
            seq.prompt_logprobs = seq.prompt_logprobs or {}
            seq.prompt_logprobs.update(enumerate(entries, first))

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
