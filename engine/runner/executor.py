"""One step on the device: its host inputs uploaded in one copy, the forward dispatched (decode
graphs, piecewise prefill graphs, a multimodal forward or eager), logprobs, the sampling rows'
logits, sampling (penalties, structured output's mask, a draft head's rejection sampler), and the
sampled tokens' copy back to the host.
"""
from __future__ import annotations

import torch

from baton.engine.platforms import Platform
from baton.engine.runner.forward import Forward
from baton.engine.runner.logits_processing import apply_logits_processing, apply_token_bitmask, to_device
from baton.engine.runner.logprobs_device import StepLogprobs, log_softmax, sampled_logprobs
from baton.engine.runner.logprobs_device import prompt as prompt_logprobs
from baton.engine.runner.sampler import Sampler, SamplingBatch
from baton.engine.runner.staging import HostUpload
from baton.engine.runner.step import DeviceInputs, HeadPass, LaunchedStep, StepInputs, StepLogits, StepOutput
from baton.models.attention_metadata import AttnMetadata


class StepExecutor:
    """`graphs`, `prefill_graphs`: the decode graphs and the piecewise prefill graphs, once captured
    (engine/runner/graph_runner.py, engine/runner/prefill_graphs.py); None: eager. `drafts`: an EAGLE-3 head."""

    def __init__(self, forward: Forward, platform: Platform, upload: HostUpload, sampler: Sampler, drafts,
                 hf_config, tp_rank: int = 0, max_num_seqs: int = 1):
        self.forward = forward
        self.model = forward.model
        self.platform = platform
        self.device = platform.device
        self.upload = upload
        self.sampler = sampler
        self.drafts = drafts
        self.hf_config = hf_config             # (a multimodal step's vision tower reads it)
        self.tp_rank = tp_rank
        self.max_num_seqs = max_num_seqs
        self.graphs = None
        self.prefill_graphs = None
        self.cp = None                         # context parallelism's side of this rank (engine/runner/context_parallel.py)
        # tensor parallelism: the group over which rank 0 shares each step's sampled tokens with the other ranks
        # (the next step, queued before they are back on the host, takes its pending inputs from them); None: not shared
        self.token_group = None
        self._token_buffers: list[torch.Tensor | None] = [None, None]   # pinned copies of sampled tokens
        self._turn = 0

    def graphs_replay(self, rows: int) -> bool:
        """Can the decode graphs replay a step of `rows` rows with prompt tokens among them."""
        return self.platform.graphs_take_prompt_rows and self.graphs is not None and self.graphs.can_run(rows)

    @torch.inference_mode()
    def run(self, inputs: StepInputs, prev_tokens: torch.Tensor | None = None) -> StepOutput:
        """Forward (and, on rank 0, sampling) for host inputs; every rank runs this. `prev_tokens`:
        the step in flight's sampled tokens, which hold this step's pending ones."""
        dev = self.upload_inputs(inputs)
        meta, input_ids, positions = dev.meta, dev.input_ids, dev.positions
        if len(inputs.pending_dst):                    # tokens sampled by the step still in flight
            input_ids.index_copy_(0, dev.pending_dst, prev_tokens.index_select(0, dev.pending_src).to(input_ids.dtype))
        graphed = self.graphs is not None and meta.is_decode and self.graphs.can_run(meta.num_seqs)
        hidden = self.graphs.run(input_ids, positions, meta) if graphed else self._eager(inputs, dev)
        hidden, aux = self.forward.split_aux(hidden)
        head = None
        if aux is not None:                            # the head's pass runs once the step's tokens are drawn
            head = HeadPass(meta, positions, aux, self.graphs if graphed else None, inputs.draft)
        step_lp = StepLogprobs() if inputs.num_logprobs >= 0 or inputs.prompt_logprob_rows else None
        if inputs.prompt_logprob_rows:                 # (every rank: the LM head may gather across them;
            prompt_logprobs(hidden, self.model.compute_logits, inputs.prompt_logprob_rows, step_lp)  # and a
        if not len(inputs.rows):                       # prompt's earlier chunks sample nothing)
            return StepOutput(None, step_lp, head)
        if inputs.logit_rows is not None:
            picked = hidden[dev.logit_rows]
        else:                                          # every item samples, at its last token
            picked = hidden[meta.query_start_loc[1:].long() - 1]
        logits = StepLogits(inputs, dev, self.model.compute_logits(picked))
        if self.tp_rank != 0:                          # the LM head's gather was the last collective
            return StepOutput(self._receive_tokens(picked.shape[0]), step_lp, head)
        if inputs.constrained:                         # the engine calls ModelRunner.sample with the masks
            return StepOutput(None, step_lp, head, deferred=logits)
        return StepOutput(self.sample(logits, step_lp), step_lp, head)

    def _eager(self, inputs: StepInputs, dev: DeviceInputs) -> torch.Tensor:
        ctx = self.forward.context(dev.meta)
        if inputs.mrope_positions is not None:        # images in the step: vision embeddings and MRoPE
            from baton.engine.runner.vision_step import multimodal_step  # (text models never load it)
            mm = multimodal_step(self.model, self.hf_config, inputs.image_chunks, inputs.mrope_positions, self.device)
            return self.model(dev.input_ids, dev.positions, ctx, mm=mm)
        if self.cp is not None:                       # a prefill step split across the context-parallel ranks
            hidden = self.cp.forward(self.model, self.forward, inputs, dev.input_ids, dev.positions)
            if hidden is not None:
                return hidden
        if self.prefill_graphs is not None and self.prefill_graphs.can_run(dev.input_ids.shape[0]):
            return self.prefill_graphs.run(dev.input_ids, dev.positions, ctx)   # all but attention replayed
        return self.model(dev.input_ids, dev.positions, ctx)

    def sample(self, step: StepLogits, logprobs: StepLogprobs | None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The sampled token of each sampling row (`mask`: structured output's bitmask on the device)."""
        inputs, dev, logits = step.inputs, step.device, step.logits
        raw = log_softmax(logits) if inputs.num_logprobs >= 0 else None     # of the raw logits, as vLLM
        if dev.processing is not None:                 # penalties, biases, min_tokens, min_p
            if mask is not None:                       # (of the allowed tokens: structured output's mask first)
                logits, mask = apply_token_bitmask(logits, mask), None
            logits = apply_logits_processing(logits, dev.processing, dev.sampling.temperatures, dev.input_ids)
        sampled = self.sampler(logits, dev.sampling, mask)     # (the mask, if any, read in the sampling pass)
        if inputs.draft is not None and inputs.draft.checks is not None:   # drafts drawn from a distribution:
            sampled = self.drafts.reject(logits, dev.sampling, sampled, inputs.draft.checks)   # rejection sampling
        if raw is not None:
            sampled_logprobs(raw, sampled, inputs.num_logprobs, logprobs)
        if self.token_group is not None:               # the other ranks' copy (_receive_tokens), in stream order
            torch.distributed.broadcast(sampled.to(torch.int64).contiguous(), src=0, group=self.token_group)
        return sampled

    def _receive_tokens(self, rows: int) -> torch.Tensor | None:
        """A rank other than 0: the step's sampled tokens, as rank 0 broadcasts them when it samples."""
        if self.token_group is None:
            return None
        tokens = torch.empty(rows, dtype=torch.int64, device=self.device)
        torch.distributed.broadcast(tokens, src=0, group=self.token_group)
        return tokens

    def finish(self, launched: LaunchedStep, output: StepOutput, sampled: torch.Tensor | None) -> None:
        """Hand the sampled tokens to the launched step: the draft head's pass over the step first (it
        reads them), then their copy back to the host, under way."""
        if output.head is not None:
            launched.head_hidden = self.drafts.pass_over_step(output.head, sampled)
            launched.head_rows = output.head.draft.sample_logit_rows
        launched.device_tokens = sampled
        launched.host_tokens, launched.event = self._copy_back(sampled)
        launched.step_logprobs = output.logprobs

    def _copy_back(self, sampled: torch.Tensor | None):
        """A host copy of the sampled tokens, under way (pinned buffers alternate: a step's copy is
        read only after the next step has been queued)."""
        if sampled is None or sampled.device.type == "cpu":
            return sampled, None
        self._turn ^= 1
        buf = self._token_buffers[self._turn]
        if buf is None or buf.numel() < sampled.numel():
            buf = self._token_buffers[self._turn] = torch.empty(max(sampled.numel(), self.max_num_seqs),
                                                                dtype=torch.int64, pin_memory=True)
        host = buf[:sampled.numel()]
        host.copy_(sampled, non_blocking=True)
        return host, self.platform.record_event()

    def upload_inputs(self, h: StepInputs) -> DeviceInputs:
        """Everything to the device in one copy (HostUpload)."""
        # (the sampled rows' indices too, when not every row samples: a pageable copy would wait for the device)
        rows = (h.logit_rows,) if h.logit_rows is not None else ()
        extra = h.processing.arrays() if h.processing is not None else ()
        (ids, pos, slots, starts, lens, tables, temperatures, top_ks, top_ps, seeds, has_seed, sample_pos,
         pending_dst, pending_src, *processing) = self.upload(
            h.input_ids, h.positions, h.slots, h.query_starts, h.seq_lens, h.block_tables, h.temperatures, h.top_ks,
            h.top_ps, h.seeds, h.has_seed, h.sample_positions, h.pending_dst, h.pending_src, *rows, *extra)
        logit_rows = None
        if rows:
            logit_rows, *processing = processing
        seq_lens = h.seq_lens.tolist()
        meta = AttnMetadata(
            is_decode=h.is_decode, slot_mapping=slots, query_start_loc=starts, seq_lens=lens, block_tables=tables,
            max_query_len=h.max_query_len, max_seq_len=max(seq_lens), has_context=h.has_context,
            query_start_loc_cpu=h.query_starts.tolist(), seq_lens_cpu=seq_lens, num_decode_rows=h.num_decode_rows,
        )
        sampling = SamplingBatch(
            temperatures=temperatures, top_ks=top_ks, top_ps=top_ps, seeds=seeds, has_seed=has_seed,
            positions=sample_pos, all_greedy=bool((h.temperatures == 0).all()),
            any_greedy=bool((h.temperatures == 0).any()), any_top_k=bool((h.top_ks > 0).any()),
            any_top_p=bool((h.top_ps < 1.0).any()), any_seed=bool(h.has_seed.any()),
        )
        return DeviceInputs(meta, ids, pos, sampling, pending_dst, pending_src, logit_rows,
                            to_device(processing) if processing else None)

