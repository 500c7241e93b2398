"""The synchronous engine: add requests, step, read streamed outputs.

One instance per process; the services drive it from a dedicated thread, the offline `LLM`
drives it in a loop. All user input is validated here, before anything is queued, so a bad
request never changes engine state.
"""
from __future__ import annotations

import itertools
import logging
import time

from baton.engine.block_manager import BlockManager
from baton.engine.config import EngineConfig
from baton.engine.model_runner import ModelRunner
from baton.engine.output_processor import RequestOutput, RequestState
from baton.engine.sampling_params import SamplingParams
from baton.engine.scheduler import Scheduler, SchedulerConfig
from baton.engine.sequence import FinishReason, Sequence
from baton.engine.tokenizer import encode_text, eos_token_ids, load_tokenizer

log = logging.getLogger("baton.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, runner: ModelRunner | None = None):
        self.config = config or EngineConfig()
        self.config.validate()
        self.runner = runner or ModelRunner(self.config)
        self.source = self.runner.source
        self.tokenizer = load_tokenizer(self.source)
        self.vocab_size = self.runner.vocab_size
        self.max_model_len = self.runner.max_model_len
        self.eos_token_ids = eos_token_ids(self.source, self.tokenizer)
        self.block_manager = BlockManager(self.runner.num_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(self.config.max_num_seqs, self.config.max_num_batched_tokens, self.max_model_len),
            self.block_manager, set(self.eos_token_ids))
        self.states: dict[str, RequestState] = {}
        # streaming text costs two tokenizer calls per token per request (5 ms a step at batch
        # 256 on an H100 host); the offline API turns it off and decodes each output once
        self.stream_text = True
        self.held: dict[str, Sequence] = {}      # finished hold_kv requests awaiting release
        self._ids = itertools.count()
        self.last_step_seconds = 0.0

    # -- requests ---------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return encode_text(self.tokenizer, prompt)
        return list(prompt)

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("prompt is empty: give at least one token")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len}, "
                             "which must leave room for at least one new token: shorten the prompt")
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        params.validate(self.vocab_size)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, hold_kv: bool = False, on_kv=None) -> str:
        """Queue a request. With hold_kv its KV blocks outlive it until `release` (handoff).
        `on_kv(first_block, block_ids, first_token)` is called on the engine thread, right after
        the step whose forward was the last to write them (its device work queued, maybe not
        finished), with the prompt blocks that became final, in order, each once (streamed
        handoff); `first_token` is the token that step sampled once the prompt is done, else None."""
        params = params or SamplingParams()
        token_ids = self.tokenize(prompt)
        self.validate(token_ids, params)
        request_id = request_id or self.new_request_id()
        if request_id in self.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        if request_id in self.held:
            raise ValueError(f"request id {request_id!r} is still handing off its KV")
        seq = Sequence(request_id, token_ids, params, self.max_model_len, arrival=time.monotonic())
        seq.hold_kv = hold_kv
        seq.on_kv = on_kv
        self.scheduler.add(seq)
        self.states[request_id] = RequestState(seq, self._detokenizer_for(params))
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        self.release(request_id)
        state = self.states.pop(request_id, None)
        if state is None:
            return None
        self.scheduler.abort(state.seq)
        return state.update()

    # -- handoff (disaggregated serving) ----------------------------------------------------
    def release(self, request_id: str) -> bool:
        """Free the KV a finished hold_kv request kept for its handoff (stays prefix-cached)."""
        seq = self.held.pop(request_id, None)
        if seq is None:
            return False
        self.block_manager.free_sequence(seq)
        return True

    def reserve_blocks(self, num_tokens: int) -> list[int]:
        """Blocks for KV that another worker computes; KVCacheFull if they are not free."""
        return self.block_manager.allocate_blocks(self.block_manager.blocks_needed(num_tokens))

    def free_blocks(self, block_ids: list[int]) -> None:
        self.block_manager.free_blocks(block_ids)

    def join(self, request_id: str, prompt_token_ids: list[int], first_token: int,
             params: SamplingParams, block_ids: list[int]) -> RequestOutput:
        """Adopt a request whose prompt KV already sits in block_ids, with its first token.

        The first token is emitted at once (no decode step needed); the request then runs
        in the continuous batch like any other. The blocks now belong to the request.
        """
        if request_id in self.states:
            self.free_blocks(block_ids)
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, prompt_token_ids, params, self.max_model_len, arrival=time.monotonic())
        seq.block_table = list(block_ids)
        seq.num_computed_tokens = len(prompt_token_ids)
        seq.append_token(first_token)
        self.block_manager.register_full_blocks(seq)
        self.states[request_id] = RequestState(seq, self._detokenizer_for(params))
        reason = self.scheduler.stop_reason(seq, first_token)
        if reason is None:
            self.scheduler.add_running(seq)
        else:
            self.scheduler.add_running(seq)
            self.scheduler.finish(seq, reason)
        return self._emit(request_id)

    def _detokenizer_for(self, params: SamplingParams):
        """The tokenizer when the request's text is needed while it runs, else None."""
        return self.tokenizer if self.stream_text or params.stop else None

    @property
    def has_unfinished(self) -> bool:
        return bool(self.states)

    # -- stepping ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduled model step; outputs for every request that advanced or finished."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        sampled = self.runner.execute(out)
        self._emit_kv(out, sampled)         # before postprocess frees a finished prefill's blocks
        self.scheduler.postprocess(out, sampled)
        self.last_step_seconds = time.perf_counter() - t0
        outputs = []
        for item, token in zip(out.scheduled, sampled, strict=True):
            if token is None:
                continue
            outputs.append(self._emit(item.seq.request_id))
        return outputs

    def _emit_kv(self, out, sampled: list[int | None]) -> None:
        """Pass each streamed request the prompt blocks this step made final: the full ones
        its prefill has covered, and the last, partial one once the prompt is done, with the
        token sampled after it."""
        bs = self.block_manager.block_size
        for item, token in zip(out.scheduled, sampled, strict=True):
            seq = item.seq
            if seq.on_kv is None:
                continue
            done = min(seq.num_computed_tokens + item.num_new_tokens, seq.num_prompt_tokens)
            final = -(-done // bs) if done == seq.num_prompt_tokens else done // bs
            if final <= seq.kv_emitted:
                continue
            first, seq.kv_emitted = seq.kv_emitted, final
            try:
                seq.on_kv(first, list(seq.block_table[first:final]), token if done == seq.num_prompt_tokens else None)
            except Exception:
                log.exception("the KV listener of request %s failed; it gets no more blocks", seq.request_id)
                seq.on_kv = None

    def _emit(self, request_id: str) -> RequestOutput:
        state = self.states[request_id]
        result = state.update()
        if result.finished and not state.seq.is_finished:      # a stop string matched
            self.scheduler.finish(state.seq, FinishReason.STOP)
        if result.finished:
            del self.states[request_id]
            if state.seq.hold_kv and state.seq.block_table:
                self.held[request_id] = state.seq
        return result
