"""The synchronous engine: add requests, step, read streamed outputs.

One instance per process; the services drive it from a dedicated thread, the offline `LLM`
drives it in a loop. All user input is validated here, before anything is queued, so a bad
request never changes engine state. Disaggregated serving goes through one seam, `KVHandoff`
(engine/kv_handoff.py), driven by the engine's `KVExchange` (engine/kv_exchange.py): a prefill
engine hands a request's prompt KV to it as pieces; a decode engine reserves blocks for a request
whose KV comes from elsewhere and joins it once the hook says it landed."""
from __future__ import annotations

import gc
import itertools
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from baton.engine.config import EngineConfig
from baton.engine.kv_exchange import KVExchange, KVSpec
from baton.engine.kv_handoff import KVHandoff, KVPiece, KVState, KVTicket
from baton.engine.output_processor import RequestOutput, RequestState
from baton.engine.requests.limits import ModelLimits
from baton.engine.requests.sampling_params import SamplingParams, sampling_defaults
from baton.engine.requests.structured_output import StructuredOutputs
from baton.engine.requests.tokenizer import encode_text, eos_token_ids, load_tokenizer
from baton.engine.runner.model_runner import ModelRunner
from baton.engine.runner.step import LaunchedStep
from baton.engine.scheduling.block_manager import BlockManager
from baton.engine.scheduling.multimodal import MultimodalPrompt
from baton.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from baton.engine.scheduling.sequence import FinishReason, Sequence, SequenceStatus
from baton.engine.speculation.speculative import Speculator
from baton.engine.step_clock import CostModel, StepClock
from baton.models.multimodal import MediaInput, media_placeholders


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


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, runner: ModelRunner | None = None,
                 handoff: KVHandoff | None = None, tokens_only: bool = False):
        """`tokens_only`: prompt ids in, text made elsewhere (an engine core): no text streamed, a light tokenizer."""
        self.config = config or EngineConfig()
        self.config.validate()
        self.runner = runner or ModelRunner(self.config)
        self.source = self.runner.source
        self.tokenizer = load_tokenizer(self.source, core=tokens_only)
        self.vocab_size = self.runner.vocab_size
        self.max_model_len = self.runner.max_model_len
        self.eos_token_ids = eos_token_ids(self.source, self.tokenizer)
        self.runner.eos_token_ids = list(self.eos_token_ids)
        self.structured = StructuredOutputs(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.sampling_defaults = sampling_defaults(self.source.generation_config(self.config.generation_config))
        self.block_manager = BlockManager(self.runner.num_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching, lower=self.runner.host_tier)
        self.scheduler = Scheduler(
            SchedulerConfig(self.config.max_num_seqs, self.config.max_num_batched_tokens, self.max_model_len,
                            self.config.scheduling_policy),
            self.block_manager, set(self.eos_token_ids))
        self.states: dict[str, RequestState] = {}
        # streaming text costs two tokenizer calls per token per request (5 ms a step at batch
        # 256 on an H100 host); the offline API turns it off and decodes each output once
        self.stream_text = not tokens_only
        self.placeholders = media_placeholders(self.source.hf_config)   # images or audio; None: a text-only model
        self.kv = KVExchange(self.runner, self.block_manager, self.scheduler, self.placeholders,
                             handoff or KVHandoff())
        self.scheduler.may_admit = lambda: self.handoff.may_admit()
        # asynchronous scheduling: on accelerators by default (the CPU gains nothing: its kernels run on
        # the host), where every rank holds the sampled tokens (ModelRunner.tokens_on_every_rank)
        auto = self.runner.device.type != "cpu" and self.runner.tokens_on_every_rank
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
                    images: Seq[MediaInput] = (), skip_blocks: int = 0) -> str:
        """Queue a request. With `hand_off_kv` (prefill side) its prompt's KV goes to the
        handoff hook as pieces, each right after the step that made its blocks final; the last
        piece carries the token that step sampled; the first `skip_blocks` blocks (the decode side
        has them) go in none. Its ticket: `kv_ticket(request_id)`. `images`: a multimodal model's
        images or audio clips, in order; the prompt holds their placeholders already expanded."""
        params = params or SamplingParams()
        token_ids = self.tokenize(prompt)
        self.validate(token_ids, params)
        mm = self._multimodal(token_ids, list(images))
        request_id = request_id or self.new_request_id()
        seq = self._new_sequence(request_id, token_ids, params)
        seq.mm = mm
        if hand_off_kv:
            seq.kv_ticket = self.kv.prefill_ticket(seq, skip_blocks)
        self.scheduler.add(seq)
        self.states[request_id] = RequestState(seq, self._detokenizer_for(params))
        return request_id

    def check_images(self, token_ids: list[int], images: list[MediaInput]) -> None:
        """ValueError unless the prompt's expanded placeholders match `images` (add_request checks too)."""
        self._multimodal(token_ids, images)

    def _multimodal(self, token_ids: list[int], images: list[MediaInput]) -> MultimodalPrompt | None:
        return MultimodalPrompt.of(token_ids, images, self.placeholders, self.source.name)

    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                reuse_prefix: bool = False) -> KVTicket:
        """Decode side: blocks for a request whose prompt KV another worker computes (KVCacheFull
        if they are not free), its cached prefix reused if `reuse_prefix` (KVExchange.reserve). It joins
        the running batch once the hook reports its KV landed; `abort` frees the blocks in any state before."""
        self.validate(prompt_token_ids, params)
        seq = self._new_sequence(request_id, prompt_token_ids, params)
        ticket = self.kv.reserve(seq, reuse_prefix)
        self.states[request_id] = RequestState(seq, self._detokenizer_for(params))
        return ticket

    def _new_sequence(self, request_id: str, token_ids: list[int], params: SamplingParams) -> Sequence:
        """A new sequence, and a structured-output request's matcher (ValueError: the id is in use, or
        a bad spec). Its output starts after the prompt, or at a resumed request's earlier output,
        which the matcher reads first; a decode worker's reads the prefill worker's first token too
        (structured_output.GrammarState)."""
        if request_id in self.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, token_ids, params, self.max_model_len, arrival=time.monotonic())
        spec = seq.params.structured
        if spec is not None:
            seq.grammar = self.structured.state(spec, seq.num_prompt_tokens - seq.params.prior_output_tokens)
        return seq

    def kv_ticket(self, request_id: str) -> KVTicket | None:
        seq = self.sequence(request_id)
        return seq.kv_ticket if seq is not None else None

    def sequence(self, request_id: str) -> Sequence | None:
        """The request's sequence; None: unknown here (never added, finished or aborted)."""
        state = self.states.get(request_id)
        return state.seq if state is not None else None

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
                self.kv.hold(hold_as, seq)
        self.scheduler.abort(seq)
        if seq.kv_ticket is not None and not seq.kv_ticket.try_advance(KVState.FREED):
            seq.kv_ticket.try_advance(KVState.FINISHED)
        return state.update()

    def pause(self, request_id: str) -> tuple[KVPiece, list[int]] | str:
        """A decoding request out, its KV to go on elsewhere (KVExchange.export), its blocks freed once."""
        taken = self.kv.export(self.states[request_id].seq)
        if not isinstance(taken, str):
            self.abort(request_id)
        return taken

    def release_held(self, key: str) -> int:
        """Free the blocks `abort(..., hold_as=key)` held (once; 0 when none are held under key)."""
        return self.kv.release_held(key)

    def _detokenizer_for(self, params: SamplingParams):
        """The tokenizer when the request's text is needed while it runs, else None."""
        return self.tokenizer if self.stream_text or params.stop else None

    @property
    def has_unfinished(self) -> bool:
        return bool(self.states)

    @property
    def has_work(self) -> bool:
        """Something to step for: scheduled work, a step in flight, or landed KV to join."""
        return self.scheduler.has_work or self.in_flight is not None or self.kv.has_landed()

    @property
    def handoff(self) -> KVHandoff:
        """The services' hook the KV goes through (engine/kv_handoff.py); the base class hands nothing off."""
        return self.kv.handoff

    @handoff.setter
    def handoff(self, hook: KVHandoff) -> None:
        self.kv.handoff = hook

    @property
    def platform(self):
        """The device platform (streams, events) the KV transports share with the engine."""
        return self.runner.platform

    @property
    def kv_spec(self) -> KVSpec:
        """The paged cache's shape, what a KV transfer's two ends must agree on."""
        return self.kv.spec

    def stats(self) -> EngineStats:
        bm = self.block_manager
        awaiting = sum(s.seq.status is SequenceStatus.AWAITING_KV for s in list(self.states.values()))
        spec = self.speculator.stats if self.speculator is not None else None
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), awaiting, bm.num_blocks,
                           bm.num_free_blocks,
                           *((spec.proposed, spec.accepted, sum(spec.accepted_lengths)) if spec else ()),
                           kv_blocks_held=self.kv.num_held_blocks,
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
        outputs = self.kv.join_landed(self)
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
            self.speculator.launched(out.scheduled, past_in_flight=prev is not None)
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
        return [self.fail_request(seq.request_id, "preempted for KV space, and its images are not on this "
                                                  "worker to recompute its prompt; retry the request")
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
            launched.record_logprobs(sampled)
        if verified:
            kept = self.speculator.keep(launched.out.scheduled, drawn)
            sampled = [tokens[-1] if tokens else None for tokens in kept]
        if self.runner.drafts is not None:      # a draft head's state at each sequence's last kept token
            self.runner.drafts.keep_last_states(launched, kept if verified else None)
        failed = self.kv.hand_off(launched.out, sampled)   # before resolve frees a finished prefill's blocks
        if verified:
            self.scheduler.resolve_many(launched.out, launched.slots, kept)
        else:
            self.scheduler.resolve(launched.out, launched.slots, sampled)
        return launched, sampled, failed

    def _emit_settled(self, launched: LaunchedStep, sampled: list[int | None],
                      failed: dict[str, str]) -> list[RequestOutput]:
        outputs = [self.take_output(item.seq.request_id)
                   for item, token in zip(launched.out.scheduled, sampled, strict=True)
                   if token is not None and item.seq.request_id not in failed
                   and self.sequence(item.seq.request_id) is item.seq]
        return outputs + [self.fail_request(rid, why) for rid, why in failed.items()]

    def fail_request(self, request_id: str, why: str) -> RequestOutput:
        """End a request that cannot go on (its KV hand-off failed, ...): freed like an abort, its
        output carries `why`."""
        out = self.abort(request_id)
        if out is None:
            out = RequestOutput(request_id, [], "", finished=True, finish_reason="abort")
        out.error = why
        return out

    def take_output(self, request_id: str) -> RequestOutput:
        """The request's output since the last one; a finished request is forgotten here."""
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
