"""Penalties, biases and masks on a step's logits, before the sampler draws (engine/runner/sampler.py).

In this order, as vLLM orders them: `logit_bias`; `min_tokens` (eos and the stop token ids
masked while the output is shorter); `repetition_penalty` (tokens of prompt or output: a
positive logit divided by it, a negative one multiplied); `frequency_penalty` x count and
`presence_penalty` x (count > 0) over the output; then `min_p`, which is temperature-aware
(p >= min_p * p_max  <=>  logit >= max_logit + T * log(min_p)), so the sampler stays as it is.

The host builds small padded arrays per step from each sequence's tokens (`host_inputs`); on the
device everything is tensor ops on the sampling batch (scatter into [N, vocab + 1] counts, the
extra column taking the padding), no host sync per row, so it runs after a replayed decode graph
as after an eager step. A token sampled by the step still in flight (asynchronous scheduling) is
this step's input: its history entry points at that input position, read on the device. The
prefill worker (first token) and the decode worker (prompt + output, at hand-off or migration)
build the same arrays from the same tokens, so both sides sample alike.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from baton.engine.runner.staging import StagingPair

PAD = -1


@dataclass(slots=True)
class ProcessingInputs:
    """Host arrays for the N sampling rows of a step (neutral values on rows that use nothing)."""
    prompt_ids: np.ndarray      # [N, Lp] int64: prompt tokens of rows with a repetition penalty; PAD
    output_ids: np.ndarray      # [N, Lo] int64: output tokens of rows with any penalty; PAD; <= -2: input -(x + 2)
    banned_ids: np.ndarray      # [N, S] int64: masked (min_tokens not reached); PAD
    bias_ids: np.ndarray        # [N, B] int64: logit_bias tokens; PAD
    bias_values: np.ndarray     # [N, B] float32
    presence: np.ndarray        # [N] float32
    frequency: np.ndarray       # [N] float32
    repetition: np.ndarray      # [N] float32
    min_p: np.ndarray           # [N] float32

    def arrays(self) -> tuple[np.ndarray, ...]:
        return (self.prompt_ids, self.output_ids, self.banned_ids, self.bias_ids, self.bias_values,
                self.presence, self.frequency, self.repetition, self.min_p)


@dataclass(slots=True)
class LogitsProcessing:
    """ProcessingInputs on the device."""
    prompt_ids: torch.Tensor
    output_ids: torch.Tensor
    banned_ids: torch.Tensor
    bias_ids: torch.Tensor
    bias_values: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    min_p: torch.Tensor


def host_inputs(seqs: list, input_starts: list[int], eos_token_ids: list[int]) -> ProcessingInputs | None:
    """The arrays for these sampling sequences (`input_starts`: where each one's first token of this
    step sits among the step's inputs, minus its num_computed_tokens); None when none needs any."""
    if not any(s.params.processes_logits for s in seqs):
        return None
    prompts, outputs, banned, biases = [], [], [], []
    for seq, start in zip(seqs, input_starts, strict=True):
        p = seq.params
        first_output = seq.num_prompt_tokens - p.prior_output_tokens
        uses_output = bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)
        prompts.append(_prompt_set(seq, first_output) if p.repetition_penalty != 1.0 else [])
        out = seq.token_ids[first_output:] if uses_output else []
        if out and seq.num_pending_tokens:      # the trailing ones, sampled by the step in flight
            for j in range(len(out) - seq.num_pending_tokens, len(out)):
                out[j] = -(2 + start + first_output + j)
        outputs.append(out)
        if seq.num_tokens - seq.num_prompt_tokens < p.min_tokens:    # (as max_tokens, past the prompt)
            banned.append(list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids)))
        else:
            banned.append([])
        biases.append(p.logit_bias)
    rows = [s.params for s in seqs]
    bias_ids = _padded([list(b) for b in biases])
    bias_values = np.zeros(bias_ids.shape, np.float32)
    for i, b in enumerate(biases):
        bias_values[i, :len(b)] = list(b.values())
    return ProcessingInputs(
        prompt_ids=_padded(prompts), output_ids=_padded(outputs), banned_ids=_padded(banned),
        bias_ids=bias_ids, bias_values=bias_values,
        presence=np.array([p.presence_penalty for p in rows], np.float32),
        frequency=np.array([p.frequency_penalty for p in rows], np.float32),
        repetition=np.array([p.repetition_penalty for p in rows], np.float32),
        min_p=np.array([p.min_p for p in rows], np.float32))


def _prompt_set(seq, first_output: int) -> list[int]:
    """The prompt's distinct tokens (all a repetition penalty asks of it), found once per sequence."""
    if seq.prompt_token_set is None:
        seq.prompt_token_set = sorted(set(seq.token_ids[:first_output]))
    return seq.prompt_token_set


def _padded(lists: list[list[int]]) -> np.ndarray:
    lengths = np.fromiter(map(len, lists), np.int64, len(lists))
    out = np.full((len(lists), max(1, int(lengths.max(initial=0)))), PAD, np.int64)
    out[np.arange(out.shape[1])[None, :] < lengths[:, None]] = np.fromiter(
        itertools.chain.from_iterable(lists), np.int64, int(lengths.sum()))
    return out


def to_device(arrays: list[torch.Tensor]) -> LogitsProcessing:
    return LogitsProcessing(*arrays)


def apply_logits_processing(logits: torch.Tensor, proc: LogitsProcessing, temperatures: torch.Tensor,
                            input_ids: torch.Tensor) -> torch.Tensor:
    """[N, vocab] logits -> float32 logits with every row's penalties, biases and masks applied
    (rows that use none come out unchanged). `input_ids`: the step's inputs (pending tokens filled)."""
    n, vocab = logits.shape
    x = torch.cat([logits.float(), logits.new_zeros(n, 1, dtype=torch.float32)], dim=1)   # column vocab: padding
    x.scatter_add_(1, _columns(proc.bias_ids, vocab), proc.bias_values)
    x.scatter_(1, _columns(proc.banned_ids, vocab), float("-inf"))
    output = _columns(_resolve_inputs(proc.output_ids, input_ids), vocab)
    counts = torch.zeros_like(x).scatter_add_(1, output, torch.ones_like(output, dtype=torch.float32))
    seen = counts > 0
    in_prompt = torch.zeros_like(seen).scatter_(1, _columns(proc.prompt_ids, vocab), True)
    rep = proc.repetition[:, None]
    x = torch.where(seen | in_prompt, torch.where(x > 0, x / rep, x * rep), x)
    x = x - proc.frequency[:, None] * counts - proc.presence[:, None] * seen.float()
    x = x[:, :vocab]
    return _apply_min_p(x, proc.min_p, temperatures)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Structured output's masks (engine/requests/structured_output.py): [N, ceil(vocab / 32)] int32, bit t of
    row i set where row i may sample token t; every other logit becomes -inf."""
    n, vocab = logits.shape
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> bits) & 1).view(n, -1)[:, :vocab].bool()
    return logits.masked_fill(~allowed, float("-inf"))


class MaskBuffers(StagingPair):
    """Structured output's bitmasks: the grammar engine fills them in place on the host (`take`),
    pinned where the device can copy from pinned memory, and each goes to the device in one copy
    (`upload`) into one device buffer, reused (the copy is queued on the stream that runs the
    sampling, after the previous step's sampling has read it). Two host buffers alternate
    (engine/runner/staging.py)."""

    device_buffer: torch.Tensor | None = None

    def take(self, rows: int, words: int) -> torch.Tensor:
        """A [rows, words] int32 host tensor to fill (its .numpy() shares its memory)."""
        i = self.next_buffer()
        buf = self.buffers[i]
        if buf is None or buf.numel() < rows * words:
            buf = self.buffers[i] = torch.empty(rows * words, dtype=torch.int32, pin_memory=self.pinned)
        return buf[:rows * words].view(rows, words)

    def upload(self, host: torch.Tensor | np.ndarray) -> torch.Tensor:
        """The bitmask on the device (a copy under way, ordered before what is queued next)."""
        if isinstance(host, np.ndarray):
            host = torch.from_numpy(host)
        if not self.pinned:
            return host
        n = host.numel()
        if self.device_buffer is None or self.device_buffer.numel() < n:
            self.device_buffer = torch.empty(n, dtype=torch.int32, device=self.device)
        dev = self.device_buffer[:n].view(host.shape)
        dev.copy_(host, non_blocking=True)
        ptr = host.untyped_storage().data_ptr()
        for i, buf in enumerate(self.buffers):
            if buf is not None and buf.untyped_storage().data_ptr() == ptr:
                self.copy_queued(i)
        return dev


def _apply_min_p(x: torch.Tensor, min_p: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability at the row's temperature is under min_p x the top one's."""
    top = x.max(dim=-1, keepdim=True).values
    on = (min_p > 0) & (temperatures > 0)
    margin = temperatures * torch.log(torch.where(on, min_p, torch.ones_like(min_p)))   # <= 0
    threshold = torch.where(on[:, None], top + margin[:, None], torch.full_like(top, float("-inf")))
    return x.masked_fill(x < threshold, float("-inf"))


def _columns(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """PAD -> the spare column `vocab`."""
    return torch.where(ids == PAD, torch.full_like(ids, vocab), ids)


def _resolve_inputs(ids: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """History entries that point at this step's inputs (-(position + 2)) -> those tokens."""
    pointed = ids <= -2
    where = torch.where(pointed, -ids - 2, torch.zeros_like(ids))
    return torch.where(pointed, input_ids[where], ids)
