"""A worker front's token streams: each request's tokens from its engine core become
TokenChunks (text, stop strings, usage) for whoever listens to them.

Two kinds of listener (`Sink`): the router's token bus (`Bus`: one Subscribe stream per
router, each message carrying the new chunks of all of its requests here) and one request's
own stream (`RequestSink`: Decode.Stream / Generate). Both coalesce: a request's tokens wait
in its `TokenStream` until its listener is ready to send, and then go as one chunk, so a
listener that falls behind sends fewer, fuller messages instead of one per token. Nothing a
client sees changes: the same tokens, text, stop strings, finish reason and usage.

Torch-free: the front never loads the engine.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from baton.engine.output_processor import TextStream
from baton.engine.requests.sampling_params import SamplingParams
from baton.serving.grpc_server import ServiceError, status_for
from baton.serving.wire import FINISH_TO_PROTO, STATUS_BY_NUMBER, logprobs_to_proto
from baton.serving.worker.core_protocol import TokenUpdate, decode_error
from baton.v1 import decode_pb2, router_pb2

MAX_BUS_INTERVAL_S = 0.02              # a stream on a busy bus still gets a chunk at least this often
BUS_INTERVAL_PER_STREAM_S = 40e-6      # 256 streams: a batch every 10 ms (two qwen3-0.6b steps on an H100)
MIN_BUS_INTERVAL_S = 0.001             # below this: after every step


class TokenStream:
    """One request's way out of the worker. `push` takes the core's updates; `take` makes the
    chunk of everything new since the last one (None: nothing new)."""

    __slots__ = ("request_id", "prompt_tokens", "text", "sink", "deadline", "heard", "on_done", "pending",
                 "finish", "error", "cached", "handover", "completion", "stopped", "done", "logprobs",
                 "prompt_logprobs")

    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams, tokenizer,
                 on_done: Callable[[TokenStream], None], deadline: float | None = None):
        self.request_id = request_id
        self.prompt_tokens = len(prompt)
        self.text = TextStream(tokenizer, prompt, params.stop, params.min_tokens) if tokenizer is not None else None
        self.sink: Sink | None = None
        self.deadline = deadline            # time.monotonic(); None: none
        self.heard = time.monotonic()       # when the core last sent something for it
        self.on_done = on_done              # the worker's: forget it, free what the core still holds
        self.pending: list[int] = []
        self.finish: str | None = None
        self.error: Exception | None = None
        self.cached = 0
        self.handover = 0.0
        self.completion = 0
        self.stopped = False                # a stop string ended it here, while the core may still run it
        self.done = False
        self.logprobs: list | None = [] if params.logprobs is not None else None    # of `pending`
        self.prompt_logprobs: list | None = None

    def attach(self, sink: Sink) -> None:
        self.sink = sink
        sink.attached(+1)
        if self.pending or self.finish or self.error:
            sink.mark(self)

    def detach(self) -> None:
        """Its worker forgot it (ended, aborted): its sink counts one stream less."""
        if self.sink is not None:
            self.sink.attached(-1)

    def push(self, update: TokenUpdate) -> None:
        self.heard = time.monotonic()
        self.pending += update.new_token_ids
        if update.logprobs is not None and self.logprobs is not None:
            self.logprobs += update.logprobs
        if update.prompt_logprobs is not None:
            self.prompt_logprobs = update.prompt_logprobs
        self.cached = update.cached_tokens
        if update.finish_reason:
            self.finish = update.finish_reason
        if update.handover_s:
            self.handover = update.handover_s
        if update.error is not None:
            self.error = decode_error(update.error)
        if self.sink is not None:
            self.sink.mark(self)

    def fail(self, exc: Exception) -> None:
        """End it with `exc` (a deadline, a dead core, a refused transfer), however far it got."""
        if not self.done and self.error is None:
            self.error = exc
            if self.sink is not None:
                self.sink.mark(self)

    def take(self) -> decode_pb2.TokenChunk | None:
        if self.done:
            return None
        if self.error is not None:
            return self._end(self._error_chunk())
        ids, self.pending = self.pending, []
        logprobs = None
        if self.logprobs is not None:
            logprobs, self.logprobs = self.logprobs, []
        if self.text is not None:
            for i, t in enumerate(ids):
                if self.text.add(t):            # a stop string: nothing after this token is sent
                    ids, self.stopped = ids[:i + 1], True
                    break
        finished = self.finish is not None or self.stopped
        text = self.text.take(finished) if self.text is not None else ""
        if not ids and not text and not finished:
            return None
        self.completion += len(ids)
        chunk = decode_pb2.TokenChunk(request_id=self.request_id, token_ids=ids, text=text,
                                      handover_seconds=self.handover)
        self.handover = 0.0                     # first chunk only
        if logprobs is not None:
            chunk.logprobs.extend(logprobs_to_proto(logprobs[:len(ids)]))
        if self.prompt_logprobs is not None:    # (first chunk only)
            chunk.prompt_logprobs.extend(logprobs_to_proto(self.prompt_logprobs[1:]))
            self.prompt_logprobs = None
        if not finished:
            return chunk
        chunk.finish_reason = FINISH_TO_PROTO["stop" if self.stopped else self.finish]
        chunk.usage.CopyFrom(router_pb2.Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion,
                                              cached_prompt_tokens=self.cached))
        return self._end(chunk)

    def _error_chunk(self) -> decode_pb2.TokenChunk:
        code, message = status_for(self.error)
        return decode_pb2.TokenChunk(request_id=self.request_id, error_code=code.value[0], error_message=message)

    def _end(self, chunk: decode_pb2.TokenChunk) -> decode_pb2.TokenChunk:
        self.done = True
        self.on_done(self)
        return chunk

    @property
    def finish_label(self) -> str:
        """How it ended, for the requests metric."""
        if self.error is not None:
            return "error"
        return "stop" if self.stopped else self.finish or "abort"


class Sink:
    """Who sends a stream's chunks; `mark` says a stream has something new."""

    def mark(self, stream: TokenStream) -> None:
        raise NotImplementedError

    def attached(self, delta: int) -> None:
        """A stream joined (+1) or left (-1)."""


class Bus(Sink):
    """One router's token bus on this worker (Decode.Subscribe). A batch goes out after every
    engine step while few streams ride the bus; with many, batches are spaced out (at most
    MAX_BUS_INTERVAL_S) so each stream's chunk carries several steps' tokens: the router's cost
    is per chunk, and 1000 streams at a chunk per 5 ms step are 200k chunks a second."""

    def __init__(self, name: str):
        self.name = name
        self._dirty: dict[str, TokenStream] = {}
        self._wake = asyncio.Event()
        self.streams = 0                    # attached and not ended (sets the interval)
        self.closed = False

    def mark(self, stream: TokenStream) -> None:
        self._dirty[stream.request_id] = stream
        self._wake.set()

    def close(self) -> None:
        self.closed = True
        self._wake.set()

    def attached(self, delta: int) -> None:
        self.streams += delta

    def interval(self) -> float:
        return min(MAX_BUS_INTERVAL_S, self.streams * BUS_INTERVAL_PER_STREAM_S)

    async def batches(self) -> AsyncIterator[decode_pb2.TokenBatch]:
        yield decode_pb2.TokenBatch()       # open: the router may name this bus now
        while not self.closed:
            await self._wake.wait()
            self._wake.clear()
            streams, self._dirty = list(self._dirty.values()), {}
            chunks = [chunk for s in streams if (chunk := s.take()) is not None]
            if chunks:
                yield decode_pb2.TokenBatch(chunks=chunks)
                if self.interval() >= MIN_BUS_INTERVAL_S:
                    await asyncio.sleep(self.interval())


class RequestSink(Sink):
    """One request's own stream: its chunks, then the end (an error raises its status)."""

    def __init__(self, stream: TokenStream):
        self.stream = stream
        self._wake = asyncio.Event()
        stream.attach(self)

    def mark(self, stream: TokenStream) -> None:
        self._wake.set()

    async def chunks(self) -> AsyncIterator[decode_pb2.TokenChunk]:
        s = self.stream
        while not s.done:
            await self._wake.wait()
            self._wake.clear()
            chunk = s.take()
            if chunk is None:
                continue
            if chunk.error_code:
                raise ServiceError(STATUS_BY_NUMBER[chunk.error_code], chunk.error_message)
            chunk.request_id = ""               # (the caller knows whose stream this is)
            yield chunk
