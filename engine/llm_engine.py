"""The synchronous engine: add requests, step, read streamed outputs.

One instance per process; the services drive it from a dedicated thread, the offline `LLM`
drives it in a loop. All user input is validated here, before anything is queued, so a bad
request never changes engine state. Disaggregated serving goes through one seam,
`KVHandoff` (engine/kv_handoff.py): a prefill engine hands each handed-off request's prompt
KV to it as pieces; a decode engine reserves blocks for a request whose KV comes from
elsewhere and joins it once the hook says it landed.
"""
from __future__ import annotations

import gc
import itertools
import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from baton.engine.config import EngineConfig
from baton.engine.kv_handoff import InPlace, KVHandoff, KVPiece, KVState, KVTicket
from baton.engine.output_processor import RequestOutput, RequestState
from baton.engine.requests.limits import ModelLimits
from baton.engine.requests.logprobs import decode as decode_logprobs
from baton.engine.requests.logprobs import encode as encode_logprobs
from baton.engine.requests.sampling_params import SamplingParams, sampling_defaults
from baton.engine.requests.structured_output import StructuredOutputs
from baton.engine.requests.tokenizer import encode_text, eos_token_ids, load_tokenizer
from baton.engine.runner.model_runner import ModelRunner
from baton.engine.runner.step import LaunchedStep
from baton.engine.scheduling.block_manager import BlockManager
from baton.engine.scheduling.multimodal import POSITION_OFFSET_META, MultimodalPrompt
from baton.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from baton.engine.scheduling.sequence import FinishReason, Sequence, SequenceStatus
from baton.engine.speculation.speculative import HEAD_STATE_META, Speculator, accept
from baton.engine.step_clock import CostModel, StepClock
from baton.models.multimodal import ImageInput, ImagePlaceholders

log = logging.getLogger("baton.engine")


def freeze_startup_objects() -> None:
    """Move everything alive after start-up (modules, weights' Python objects, the tokenizer)
    out of the garbage collector's reach: a full collection otherwise walks them all, and it
    stalls the engine thread for 0.2 s on an H200 run of qwen3-8b (B1), a decode step's worth
    twenty times over. Objects made later are collected as usual."""
    gc.collect()
    gc.freeze()


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot for status replies and metrics (plain ints: readable from any thread)."""
    running: int
    waiting: int
    awaiting_kv: int
    kv_blocks_total: int
    kv_blocks_free: int
    spec_draft_tokens: int = 0         # speculative decoding's totals (engine/speculation/speculative.py)
    spec_accepted_tokens: int = 0
    spec_verified: int = 0
    kv_blocks_held: int = 0            # blocks of failed in-place transfers, until no late write can land
    spec_accepted_lengths: tuple[int, ...] = ()   # verified sequence-steps by guesses kept (index 0..k)


@dataclass(frozen=True, slots=True)
class KVSpec:
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_scales: str = ""                # a float8 cache's scales, as a checksum (engine/runner/kv_scales.py); "" = none


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, runner: ModelRunner | None = None,
                 handoff: KVHandoff | None = None):
        self.config = config or EngineConfig()
        self.config.validate()
        self.runner = runner or ModelRunner(self.config)
        self.source = self.runner.source
        self.tokenizer = load_tokenizer(self.source)
        self.vocab_size = self.runner.vocab_size
        self.max_model_len = self.runner.max_model_len
        self.eos_token_ids = eos_token_ids(self.source, self.tokenizer)
        self.runner.eos_token_ids = list(self.eos_token_ids)
        self.structured = StructuredOutputs(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.sampling_defaults = sampling_defaults(self.source.generation_config(self.config.generation_config))
        self.block_manager = BlockManager(self.runner.num_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(self.config.max_num_seqs, self.config.max_num_batched_tokens, self.max_model_len,
                            self.config.scheduling_policy),
            self.block_manager, set(self.eos_token_ids))
        self.states: dict[str, RequestState] = {}
        self.held: dict[str, list[int]] = {}        # abort(hold_as=key): blocks kept out of the pool until released
        # streaming text costs two tokenizer calls per token per request (5 ms a step at batch
        # 256 on an H100 host); the offline API turns it off and decodes each output once
        self.stream_text = True
        self.handoff = handoff or KVHandoff()     # the services' hook; the base class hands nothing off
        self.scheduler.may_admit = lambda: self.handoff.may_admit()
        self.placeholders = ImagePlaceholders.from_config(self.source.hf_config)   # None: a text-only model
        # asynchronous scheduling: on accelerators by default (the CPU gains nothing: its kernels
        # run on the host); one rank only, since other tensor-parallel ranks don't sample
        auto = self.runner.device.type != "cpu" and self.config.tp_size == 1
        self.look_ahead = auto if self.config.async_scheduling is None else self.config.async_scheduling
        self.in_flight: LaunchedStep | None = None
        self.speculator = None if self.config.speculative_method is None else Speculator(
            self.config.speculative_method, self.config.speculative_tokens, self.config.speculative_max_batch,
            self.block_manager, self.runner.drafts)
        # n-gram guesses, scheduled ahead: the step after a verifying one is queued before its tokens are
        # back, as if every guess held (the sequences that kept fewer roll back: engine/speculation/speculative.py)
        self.guesses_ahead = self.look_ahead and self.speculator is not None and self.speculator.drafter is None
        self._ids = itertools.count()
        self.last_step_seconds = 0.0
        self.clock = StepClock(CostModel.of(self.source.hf_config))   # what the hang detector reads mid-step

    # -- requests ---------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return encode_text(self.tokenizer, prompt)
        return list(prompt)

    @property
    def limits(self) -> ModelLimits:
        return ModelLimits(self.vocab_size, self.max_model_len, self.config.scheduling_policy)

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        self.limits.validate(token_ids, params)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, hand_off_kv: bool = False,
                    images: Seq[ImageInput] = ()) -> str:
        """Queue a request. With `hand_off_kv` (prefill side) its prompt's KV goes to the
        handoff hook as pieces, each right after the step that made its blocks final; the last
        piece carries the token that step sampled. Its ticket: `kv_ticket(request_id)`.
        `images`: a vision-language model's images, in order; the prompt holds each one's
        placeholders already expanded (ImagePlaceholders.expand)."""
        params = params or SamplingParams()
        token_ids = self.tokenize(prompt)
        self.validate(token_ids, params)
        mm = self._multimodal(token_ids, list(images))
        request_id = request_id or self.new_request_id()
        if request_id in self.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, token_ids, params, self.max_model_len, arrival=time.monotonic())
        seq.mm = mm
        self._constrain(seq)
        if hand_off_kv:
            seq.kv_ticket = KVTicket(request_id, "prefill")
        self.scheduler.add(seq)
        self.states[request_id] = RequestState(seq, self._detokenizer_for(params))
        return request_id

    def check_images(self, token_ids: list[int], images: list[ImageInput]) -> None:
        """ValueError unless the prompt's expanded placeholders match `images` (add_request checks too)."""
        self._multimodal(token_ids, images)

    def _multimodal(self, token_ids: list[int], images: list[ImageInput]) -> MultimodalPrompt | None:
        """The prompt's images and MRoPE positions (None: a text prompt); ValueError when the
        placeholders and the images disagree or the model takes no images."""
        ph = self.placeholders
        if ph is None:
            if images:
                raise ValueError(f"model {self.source.name} takes no images; send text only")
            return None
        if not images and ph.image_token_id not in token_ids:
            return None
        return MultimodalPrompt.for_prompt(token_ids, images, ph)

    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> KVTicket:
        """Decode side: blocks for a request whose prompt KV another worker computes (KVCacheFull
        if they are not free). It joins the running batch once the hook reports its KV landed;
        `abort` frees the blocks in any state before that."""
        self.validate(prompt_token_ids, params)
        if request_id in self.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, prompt_token_ids, params, self.max_model_len, arrival=time.monotonic())
        self._constrain(seq)
        # fresh blocks only (no prefix match): a backend may write the KV straight into them, so
        # none may be shared with another sequence until the join
        self.block_manager.allocate(seq, seq.num_prompt_tokens)
        seq.status = SequenceStatus.AWAITING_KV
        seq.kv_ticket = KVTicket(request_id, "decode")
        seq.kv_ticket.block_ids = tuple(seq.block_table)
        self.states[request_id] = RequestState(seq, self._detokenizer_for(params))
        return seq.kv_ticket

    def _constrain(self, seq: Sequence) -> None:
        """A structured-output request's matcher (ValueError for a bad spec). Its output starts after
        the prompt, or at a resumed request's earlier output, which the matcher reads first; a decode
        worker's reads the prefill worker's first token too (structured_output.GrammarState)."""
        spec = seq.params.structured
        if spec is not None:
            seq.grammar = self.structured.state(spec, seq.num_prompt_tokens - seq.params.prior_output_tokens)

    def kv_ticket(self, request_id: str) -> KVTicket | None:
        state = self.states.get(request_id)
        return state.seq.kv_ticket if state is not None else None

    def abort(self, request_id: str, hold_as: str | None = None) -> RequestOutput | None:
        """End a request in whatever state it is; its blocks are freed (once). None: unknown here.
        `hold_as`: a request still awaiting its KV keeps its blocks out of the pool under that key
        until `release_held(key)` (a sender it handed them to may still write into them)."""
        state = self.states.pop(request_id, None)
        if state is None:
            return None
        seq = state.seq
        if seq.status is SequenceStatus.AWAITING_KV:
            seq.status = SequenceStatus.WAITING      # nowhere in the scheduler's queues: finish frees it
            if hold_as is not None:
                self.held[hold_as], seq.block_table = seq.block_table, []
        self.scheduler.abort(seq)
        if seq.kv_ticket is not None and not seq.kv_ticket.try_advance(KVState.FREED):
            seq.kv_ticket.try_advance(KVState.FINISHED)
        return state.update()

    def release_held(self, key: str) -> int:
        """Free the blocks `abort(..., hold_as=key)` held (once; 0 when none are held under key)."""
        blocks = self.held.pop(key, [])
        self.block_manager.free_blocks(blocks)
        return len(blocks)

    def _detokenizer_for(self, params: SamplingParams):
        """The tokenizer when the request's text is needed while it runs, else None."""
        return self.tokenizer if self.stream_text or params.stop else None

    @property
    def has_unfinished(self) -> bool:
        return bool(self.states)

    @property
    def has_work(self) -> bool:
        """Something to step for: scheduled work, a step in flight, or landed KV to join."""
        return self.scheduler.has_work or self.in_flight is not None or self.handoff.has_landed()

    @property
    def platform(self):
        """The device platform (streams, events) the KV transports share with the engine."""
        return self.runner.platform

    @property
    def kv_spec(self) -> KVSpec:
        """The paged cache's shape, what a KV transfer's two ends must agree on."""
        m = self.runner.model
        return KVSpec(str(self.runner.kv_dtype).removeprefix("torch."), self.config.block_size,
                      self.runner.num_cache_layers,
                      m.num_kv_heads, m.head_dim, self.runner.kv_scales_checksum)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        awaiting = sum(s.seq.status is SequenceStatus.AWAITING_KV for s in list(self.states.values()))
        spec = self.speculator.stats if self.speculator is not None else None
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), awaiting, bm.num_blocks,
                           bm.num_free_blocks,
                           *((spec.proposed, spec.accepted, sum(spec.accepted_lengths)) if spec else ()),
                           kv_blocks_held=sum(map(len, list(self.held.values()))),
                           spec_accepted_lengths=tuple(spec.accepted_lengths) if spec else ())

    # -- stepping ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Join what landed, launch the next model step, and return the outputs of every
        request that joined, advanced or finished.

        With asynchronous scheduling the step launched here runs on the device while the host
        handles the step before it (whose tokens are then back): scheduling, input building and
        the upload of step N+1 overlap step N's compute, and step N+1 takes the tokens step N
        sampled straight from the device. A request that finishes at step N has one row of
        step N+1 wasted (dropped); nothing else differs, token for token."""
        started = time.monotonic()
        self.clock.begin_step([], started)
        try:
            return self._step(started)
        finally:
            self.clock.end()

    def _step(self, started: float) -> list[RequestOutput]:
        outputs = self._join_landed()
        t0 = time.perf_counter()
        prev, out, settled = self.in_flight, None, None
        guessing = self._speculating()
        if prev is not None and self._may_schedule_ahead(prev) and (not guessing or self._guess_ahead_of(prev)):
            if guessing:        # past the step in flight: guesses as if its tokens were the ones predicted
                self.speculator.propose(self.scheduler.running)
            out = self.scheduler.schedule(preempt=False)       # None: it would preempt; wait first
        if out is None:
            if prev is not None:
                # its outputs are emitted once the next step is queued (below), while the device runs it
                settled = self._settle(prev)
                prev = self.in_flight = None
            if guessing:                       # guesses need every token known: no step is in flight now
                self.speculator.propose(self.scheduler.running)
            out = self.scheduler.schedule()
            outputs += self._fail_unrecomputable(out.preempted)
        if out.is_empty:
            if prev is not None:
                outputs += self._resolve(prev)
                self.in_flight = None
            if settled is not None:
                outputs += self._emit_settled(*settled)
            return outputs
        self.clock.begin_step([(s.num_new_tokens, s.seq.num_computed_tokens) for s in out.scheduled], started)
        launched = self.runner.launch(out, prev)
        launched.slots = self.scheduler.advance(out, ahead=self.guesses_ahead)
        if self.speculator is not None:
            self.speculator.clock += 1
            self.speculator.stats.ahead += prev is not None and _verifies_ahead(launched)
        if launched.deferred is not None:     # structured output: masks from every token before this step's
            # (`prev`'s are the first thing back), filled on a thread while this thread resolves `prev` and
            # schedules and builds the next step; its sampling is queued when the next step is launched or
            # its tokens are read (LaunchedStep.complete)
            masks = self.structured.masks_async(launched, prev, self.runner.masks.take)
            launched.finish = lambda step=launched: self.runner.sample(step, masks())
        if prev is not None:
            outputs += self._resolve(prev)
        if settled is not None:
            outputs += self._emit_settled(*settled)
        self.in_flight = launched
        # a step verifying guesses stays in flight too: the next call settles it before anything is
        # scheduled (_may_schedule_ahead), and emits its outputs after queueing the step after it
        if not self.look_ahead:
            outputs += self._resolve(launched)
            self.in_flight = None
        self.last_step_seconds = time.perf_counter() - t0
        return outputs

    def _fail_unrecomputable(self, preempted: list[Sequence]) -> list[RequestOutput]:
        """A preempted sequence is recomputed from its tokens later; one whose images stayed on
        the prefill worker cannot be, so it ends now, with an error, rather than run without them."""
        return [self._fail(seq.request_id, "preempted for KV space, and its images are not on this worker "
                                           "to recompute its prompt; retry the request")
                for seq in preempted if seq.mm is not None and not seq.mm.images_available]

    def _speculating(self) -> bool:
        """Should the next step verify guesses (engine/speculation/speculative.py: the batch is small and enough
        of its sequences are due to guess); else it decodes plainly, scheduled ahead as usual."""
        return self.speculator is not None and self.speculator.wants(self.scheduler.running)

    def _guess_ahead_of(self, prev: LaunchedStep) -> bool:
        """Guess past the step in flight (`guesses_ahead`) while its tokens are not back: its verified
        guesses as if all held, a plain step's token as the n-gram match predicts it (speculative.py).
        Once they are back, settling it first costs no wait and voids no step."""
        return self.guesses_ahead and not prev.ready()

    def _may_schedule_ahead(self, prev: LaunchedStep) -> bool:
        """Not past a step whose prompt KV is handed off (the pieces need its sampled token), nor
        past one verifying guesses (how many it keeps sets the next step's positions) unless its guesses
        went in as tokens (`guesses_ahead`: the next step assumes they all hold)."""
        return self.look_ahead and not any(item.draft and not item.ahead or item.seq.kv_ticket is not None
                                           and item.seq.kv_ticket.side == "prefill" for item in prev.out.scheduled)

    def _resolve(self, launched: LaunchedStep) -> list[RequestOutput]:
        """The step's tokens are back: hand off the prompt KV it finished, fill in its tokens,
        finish what ended, and emit."""
        return self._emit_settled(*self._settle(launched))

    def _settle(self, launched: LaunchedStep) -> tuple[LaunchedStep, list[int | None], dict[str, str]]:
        """`_resolve` up to the outputs: wait for the step's tokens, hand off the prompt KV it
        finished, fill in its tokens and finish what ended. An item with guesses
        (engine/speculation/speculative.py) keeps them up to the first the model disagreed with, and the
        token sampled there. Returns what `_emit_settled` needs."""
        verified = any(item.draft for item in launched.out.scheduled)
        if verified:
            drawn = launched.token_lists()
            sampled = [tokens[-1] if tokens else None for tokens in drawn]
        else:
            sampled = launched.tokens()
        if launched.step_logprobs is not None:      # (requests with logprobs never guess: one row each)
            _record_logprobs(launched, sampled)
        if verified:
            kept = []
            for item, tokens in zip(launched.out.scheduled, drawn, strict=True):
                if tokens is not None and item.draft and item.epoch == item.seq.spec_epoch \
                        and not item.seq.is_finished:               # (a void item's tokens are dropped)
                    tokens = accept(item.draft, tokens)
                    self.speculator.verified(item.seq, len(item.draft), len(tokens) - 1)
                    self.speculator.stats.rolled_back += item.ahead and len(tokens) <= len(item.draft)
                kept.append(tokens)
            self.speculator.stats.steps += 1
            sampled = [tokens[-1] if tokens else None for tokens in kept]
        if self.runner.drafts is not None:
            self._keep_head_states(launched, kept if verified else None)
        failed = self._hand_off_kv(launched.out, sampled)   # before resolve frees a finished prefill's blocks
        if verified:
            self.scheduler.resolve_many(launched.out, launched.slots, kept)
        else:
            self.scheduler.resolve(launched.out, launched.slots, sampled)
        return launched, sampled, failed

    def _keep_head_states(self, launched: LaunchedStep, kept: list[list[int] | None] | None) -> None:
        """A draft head's output at each sampling sequence's last kept token (engine/runner/draft_head.py):
        its first sampled row, plus the guesses it kept."""
        if launched.head_hidden is None:         # its pass wrote only the head's KV (a batch too large to draft)
            self.runner.drafts.drop_states(launched.out.scheduled)
            return
        first: dict[int, int] = {}
        for m, item in enumerate(launched.rows):
            first.setdefault(item, m)
        picks = [(launched.out.scheduled[item].seq, m + (len(kept[item]) - 1 if kept is not None else 0))
                 for item, m in first.items()]
        self.runner.drafts.keep_states(launched, picks)

    def _emit_settled(self, launched: LaunchedStep, sampled: list[int | None],
                      failed: dict[str, str]) -> list[RequestOutput]:
        outputs = [self._emit(item.seq.request_id) for item, token in zip(launched.out.scheduled, sampled, strict=True)
                   if token is not None and item.seq.request_id not in failed and item.seq.request_id in self.states
                   and self.states[item.seq.request_id].seq is item.seq]
        return outputs + [self._fail(rid, why) for rid, why in failed.items()]

    def _hand_off_kv(self, out, sampled: list[int | None]) -> dict[str, str]:
        """Pack the prompt blocks this step made final, for every handed-off request: the full
        ones its prefill has covered, and the last, partial one once the prompt is done, with
        the token sampled after it. Returns the requests whose hook failed (and why)."""
        bs = self.block_manager.block_size
        failed: dict[str, str] = {}
        for item, token in zip(out.scheduled, sampled, strict=True):
            seq = item.seq
            ticket = seq.kv_ticket
            if ticket is None or ticket.side != "prefill" or ticket.done:
                continue
            done = min(seq.num_computed_tokens, seq.num_prompt_tokens)      # (the step is counted in)
            last = done == seq.num_prompt_tokens
            final = -(-done // bs) if last else done // bs
            if final <= seq.num_blocks_handed_off:
                continue
            first, seq.num_blocks_handed_off = seq.num_blocks_handed_off, final
            try:
                self._hand_off_piece(seq, ticket, first, final, token if last else None)
            except Exception as exc:
                log.exception("the KV hand-off of request %s failed", seq.request_id)
                failed[seq.request_id] = f"its KV could not be handed off: {exc!r}"
        return failed

    def _hand_off_piece(self, seq: Sequence, ticket: KVTicket, first: int, final: int, token: int | None) -> None:
        data, ready = self.runner.pack_kv(seq.block_table[first:final])
        meta = {}
        if token is not None:
            meta = {"prefill_done_unix": repr(time.time()), "cached_tokens": str(seq.num_cached_tokens)}
            if seq.mm is not None and seq.mm.position_offset:      # generated tokens' rotary shift
                meta[POSITION_OFFSET_META] = str(seq.mm.position_offset)
            meta.update(_logprobs_meta(seq))
            if seq.spec_hidden is not None:       # a draft head's last state: the decode side drafts from it
                meta[HEAD_STATE_META] = self.runner.drafts.encode_state(seq.spec_hidden)
        self.handoff.on_prompt_kv(KVPiece(seq.request_id, first, final - first, data, ready, token, meta))
        state = KVState.PREFILLED if token is not None else KVState.PREFILLING
        if ticket.state is not state:           # (pieces after the first leave it PREFILLING)
            ticket.advance(state)

    def _join_landed(self) -> list[RequestOutput]:
        """Decode side: copy every landed payload into its request's reserved blocks (unless a
        backend wrote it there: InPlace) and run the request from the next step on; its first
        token is emitted now."""
        outputs = []
        for ticket in self.handoff.take_landed():
            state = self.states.get(ticket.request_id)
            if state is None or state.seq.kv_ticket is not ticket or ticket.state is not KVState.LANDED:
                continue                              # aborted meanwhile: its blocks are free already
            try:
                if not isinstance(ticket.payload, InPlace):
                    self.runner.write_kv(state.seq.block_table, ticket.payload)
                elif tuple(ticket.payload.block_ids) != tuple(state.seq.block_table):
                    raise ValueError(f"the KV was written into blocks {list(ticket.payload.block_ids)[:8]}..., "
                                     f"not the request's {state.seq.block_table[:8]}...")
            except Exception as exc:
                log.warning("request %s: the landed KV could not be joined: %s", ticket.request_id, exc)
                outputs.append(self._fail(ticket.request_id, f"could not join the transferred KV: {exc}"))
                continue
            outputs.append(self._join(state.seq, ticket))
        return outputs

    def _join(self, seq: Sequence, ticket: KVTicket) -> RequestOutput:
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.num_cached_tokens = int(ticket.meta.get("cached_tokens") or 0)   # the prefill's prefix-cache hit
        if self.placeholders is not None:     # images were encoded on the prefill side: only the offset comes
            seq.mm = MultimodalPrompt.remote(seq.token_ids, self.placeholders.image_token_id,
                                             int(ticket.meta.get(POSITION_OFFSET_META) or 0))
        seq.append_token(ticket.first_token)
        _join_logprobs(seq, ticket.meta)
        if self.runner.drafts is not None and HEAD_STATE_META in ticket.meta:
            seq.spec_hidden = self.runner.drafts.decode_state(ticket.meta[HEAD_STATE_META])
        self.block_manager.register_full_blocks(seq)
        ticket.joined_at = time.time()
        ticket.advance(KVState.JOINED)
        self.scheduler.add_running(seq)
        reason = self.scheduler.stop_reason(seq, ticket.first_token)
        if reason is not None:
            self.scheduler.finish(seq, reason)
        return self._emit(seq.request_id)

    def _fail(self, request_id: str, why: str) -> RequestOutput:
        """End a request whose KV hand-off failed: freed like an abort, its output carries `why`."""
        out = self.abort(request_id)
        if out is None:
            out = RequestOutput(request_id, [], "", finished=True, finish_reason="abort")
        out.error = why
        return out

    def _emit(self, request_id: str) -> RequestOutput:
        state = self.states[request_id]
        result = state.update()
        if result.finished and not state.seq.is_finished:      # a stop string matched
            self.scheduler.finish(state.seq, FinishReason.STOP)
        if result.finished:
            del self.states[request_id]
            ticket = state.seq.kv_ticket
            if ticket is not None and ticket.state is KVState.JOINED:
                ticket.advance(KVState.FINISHED)
        return result


def _verifies_ahead(launched: LaunchedStep) -> bool:
    """A step verifying guesses that went in as tokens (scheduled past as if all held)."""
    return any(item.ahead for item in launched.out.scheduled)


# -- logprobs (engine/requests/logprobs.py) ----------------------------------------------------------------
FIRST_LOGPROBS_META, PROMPT_LOGPROBS_META = "first_logprobs", "prompt_logprobs"


def _record_logprobs(launched: LaunchedStep, sampled: list[int | None]) -> None:
    """Keep the step's logprob records on their sequences, by token index."""
    scheduled = launched.out.scheduled
    for item, entry in enumerate(launched.token_logprobs(sampled)):
        slot = launched.slots[item]
        if entry is not None and slot is not None:
            seq = scheduled[item].seq
            seq.logprobs = seq.logprobs or {}
            seq.logprobs[slot] = entry
    for item, first, entries in launched.prompt_logprobs():
        seq = scheduled[item].seq
        seq.prompt_logprobs = seq.prompt_logprobs or {}
        seq.prompt_logprobs.update(enumerate(entries, first))


def _logprobs_meta(seq: Sequence) -> dict[str, str]:
    """Prefill side: the first token's and the prompt's records go with the KV hand-off."""
    meta = {}
    if seq.params.logprobs is not None:
        meta[FIRST_LOGPROBS_META] = encode_logprobs([(seq.logprobs or {}).get(seq.num_prompt_tokens)])
    if seq.params.prompt_logprobs is not None:
        records = seq.prompt_logprobs or {}
        meta[PROMPT_LOGPROBS_META] = encode_logprobs([records.get(i) for i in range(seq.num_prompt_tokens)])
    return meta


def _join_logprobs(seq: Sequence, meta: dict[str, str]) -> None:
    """Decode side: the records that came with the KV."""
    if FIRST_LOGPROBS_META in meta:
        seq.logprobs = {seq.num_prompt_tokens: decode_logprobs(meta[FIRST_LOGPROBS_META])[0]}
    if PROMPT_LOGPROBS_META in meta:
        seq.prompt_logprobs = dict(enumerate(decode_logprobs(meta[PROMPT_LOGPROBS_META])))
