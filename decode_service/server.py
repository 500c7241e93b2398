"""The decode worker's front: admits requests whose KV a prefill worker will push, and streams
their tokens; with role "colocated" it also starts whole requests (Start / Generate). Its
engine core (decode_service/core.py) reserves the blocks, takes the KV on its own port, joins
and decodes; after every step it sends this front every request's new tokens in one message.

Tokens leave on the router's token bus (Subscribe: one stream per router, every message
carrying the new chunks of all its requests here) or, for tools, on one request's own stream
(Stream / Generate). Either way a request's tokens wait in its `TokenStream` until its
listener can send, then go as one chunk (serving/worker/token_streams.py): under load, fewer and
fuller messages, never one per token.

A request admitted here ends when its engine core finishes it, when a stop string matches
here, on Abort, at its deadline, when its listener goes away, or when its KV never arrives
intact; the core frees its blocks exactly once whichever comes first. Or it moves: Pause takes
it out of the batch with its KV packed, Export pushes that KV to the worker its router chose to
continue it (router/moves.py), and it leaves here without a last chunk.

The role can change in place (SwitchRole, an operator's call): the worker stops taking new
work of its old role, reports `switching_to` in its status so that every router moves its
streams off it with their KV (queued prompts finish here), then serves the new role; a switch
whose streams could not all move within its timeout rolls back. It serves `baton.v1.Prefill`
for that (serving/worker/prefill_front.py), refusing prompts unless its role is prefill.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

import grpc

from baton.engine.requests.sampling_params import SamplingParams
from baton.engine.requests.tokenizer import load_decoder
from baton.serving import tracing
from baton.serving.grpc_server import ServiceError, check_admin
from baton.serving.server_config import ROLES
from baton.serving.wire import media_from_proto, sampling_from_proto
from baton.serving.worker.core_protocol import Command, TokenUpdate
from baton.serving.worker.prefill_front import PrefillFront, PrefillServicer
from baton.serving.worker.token_streams import Bus, RequestSink, TokenStream
from baton.serving.worker.worker import EngineWorker
from baton.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2_grpc, worker_pb2

log = logging.getLogger("baton.decode")

DEFAULT_ADMIT_TIMEOUT_S = 60.0
# a stream with no deadline of its own ends only if its engine goes this long without a token for
# it (a wedged engine, never a long answer)
STREAM_IDLE_LIMIT_S = 600.0
SWEEP_EVERY_S = 0.1
SWITCH_TIMEOUT_S = 60.0         # a role switch whose streams have not all moved by then rolls back
SWITCH_POLL_S = 0.02
EXPORT_TIMEOUT_S = 30.0
PAUSE_HOLD_S = 60.0             # a paused stream its router never moves is ended then (the core drops its KV too)


class DecodeWorker(PrefillFront, EngineWorker):
    service_names = ("baton.v1.Decode", "baton.v1.Prefill")
    core_target = "baton.decode_service.core:DecodeCore"
    switchable = True

    def __init__(self, cfg):
        super().__init__(cfg)
        self.active: set[str] = set()             # prompts prefilling here (the prefill role)
        self.paused: set[str] = set()             # streams taken out to move, until their Export
        self.moved = 0                            # streams that left with their KV
        self.streams: dict[str, TokenStream] = {}
        self.spans: dict[str, object] = {}         # request id -> its trace span (tracing on only)
        self.buses: dict[str, Bus] = {}
        self.tokenizer = None
        self._sweeper: asyncio.Task | None = None

    def prepare(self, info: dict) -> None:
        # (a core with no tokenizer, a synthetic one: chunks carry token ids and no text)
        self.tokenizer = load_decoder(info["tokenizer_dir"]) if info["tokenizer_dir"] else None
        self._sweeper = asyncio.ensure_future(self._sweep())

    def add_services(self, server) -> None:
        decode_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(self), server)
        prefill_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(self), server)

    def ready_note(self) -> str:
        if self.cfg.role != "decode":
            return ""
        return f"; prefill workers push KV to {self.kv_address} (--advertise-host / --kv-advertise to change)"

    @property
    def kv_address(self) -> str:
        return self.info["kv_address"]

    def num_active(self) -> int:
        return len(self.streams) + len(self.active)

    def check_prefill_role(self) -> None:
        self._check_role("prefill")

    def _check_role(self, *roles: str) -> None:
        """New work of a role this worker does not serve now (or is switching away from) goes elsewhere."""
        if self.role not in roles or self.switching:
            now = f"is switching from {self.role} to {self.switching}" if self.switching else f"serves {self.role}"
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"this worker {now}: {' or '.join(roles)} work goes to another worker")

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        await super().stop()

    # -- requests ------------------------------------------------------------------------------
    async def admit(self, req: decode_pb2.AdmitRequest, metadata=()) -> decode_pb2.AdmitResponse:
        self.check_accepting()
        self._check_role("decode", "colocated")
        rid = self._new_id(req.request_id)
        backend = req.backend or self.cfg.kv_backend
        if backend not in self.kv_backends():
            raise ValueError(f"KV backend {backend!r} not supported here; this worker accepts {self.kv_backends()}")
        bus = self._bus(req.subscriber) if req.subscriber else None
        prompt, params = list(req.prompt_token_ids), sampling_from_proto(req.sampling)
        self.limits.validate(prompt, params)
        timeout = req.timeout_ms / 1000 if req.timeout_ms else DEFAULT_ADMIT_TIMEOUT_S
        # on a bus: until the request's deadline; else a Stream must attach before the KV is due
        limit = (req.stream_timeout_ms / 1000 or None) if bus else timeout
        stream = self._open(rid, prompt, params, limit, tracing.start("decode", metadata, attributes={"baton.request_id": rid}))
        try:
            admitted = await self.core.call(Command.ADMIT, rid, prompt, _for_core(params), backend, timeout,
                                            req.reuse_prefix)
        except BaseException as exc:
            self._forget(stream, exc)
            if isinstance(exc, asyncio.CancelledError):     # the caller left: the core may have reserved
                self.core.cast(Command.ABORT, rid)
            raise
        if bus is not None:
            stream.attach(bus)
        return decode_pb2.AdmitResponse(**admitted)

    async def start_request(self, req: decode_pb2.WorkerGenerateRequest, metadata=()) -> TokenStream:
        """Colocated: a whole request here, no transfer."""
        self.check_accepting()
        if self.role != "colocated":
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"Start and Generate are served by colocated workers; this one is a {self.role} worker")
        self._check_role("colocated")
        rid = self._new_id(req.request_id or f"gen-{time.monotonic_ns()}")
        prompt, params = list(req.prompt_token_ids), sampling_from_proto(req.sampling)
        self.limits.validate(prompt, params)
        images = media_from_proto(req)          # images or audio clips
        stream = self._open(rid, prompt, params, req.timeout_ms / 1000 or None,
                            tracing.start("colocated", metadata, attributes={"baton.request_id": rid}))
        try:
            await self.core.call(Command.ADD, rid, prompt, _for_core(params), images)
        except BaseException as exc:
            self._forget(stream, exc)
            if isinstance(exc, asyncio.CancelledError):     # the caller left: the core may have queued it
                self.core.cast(Command.ABORT, rid)
            raise
        return stream

    async def start_on_bus(self, req: decode_pb2.WorkerGenerateRequest, metadata=()) -> decode_pb2.StartResponse:
        if not req.subscriber:
            raise ValueError("Start needs the subscriber whose token bus takes the request's chunks")
        bus = self._bus(req.subscriber)
        (await self.start_request(req, metadata)).attach(bus)
        return decode_pb2.StartResponse()

    def abort_request(self, rid: str, reason: str = "was aborted") -> bool:
        stream = self.streams.get(rid)
        self.core.cast(Command.ABORT, rid)
        self.paused.discard(rid)
        if stream is None:
            return rid in self.active
        stream.fail(ServiceError(grpc.StatusCode.ABORTED, f"request {rid} {reason}"))
        self.requests_served += 1
        self._forget(stream)
        return True

    def _new_id(self, rid: str) -> str:
        if not rid:
            raise ValueError("request_id is required")
        if rid in self.streams:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is already running here")
        return rid

    def _open(self, rid: str, prompt: list[int], params: SamplingParams, limit: float | None,
              span=None) -> TokenStream:
        deadline = time.monotonic() + limit if limit else None
        stream = TokenStream(rid, prompt, params, self.tokenizer, self._ended, deadline)
        self.streams[rid] = stream
        if span is not None:                  # tracing on: the span ends with the stream (_forget)
            self.spans[rid] = span
        return stream

    def _ended(self, stream: TokenStream) -> None:
        """Its last chunk was taken: count it, and free what the core may still run (a stop
        string matched here, or it failed)."""
        if self.streams.get(stream.request_id) is not stream:
            return                            # aborted before: counted then
        self.metrics.requests.labels(self.metrics.model, stream.finish_label).inc()
        self.requests_served += 1
        if stream.stopped or stream.error is not None:
            self.core.cast(Command.ABORT, stream.request_id)
        self._forget(stream)

    def _forget(self, stream: TokenStream, error: BaseException | None = None) -> None:
        if self.streams.get(stream.request_id) is stream:
            del self.streams[stream.request_id]
            stream.detach()
            if self.spans:
                tracing.end(self.spans.pop(stream.request_id, None), error or stream.error)

    # -- the core's tokens -----------------------------------------------------------------------
    def on_updates(self, updates: list[TokenUpdate]) -> None:
        streams = self.streams
        for update in updates:
            stream = streams.get(update.request_id)
            if stream is not None:
                stream.push(update)

    def fail_all(self, exc: ServiceError) -> None:
        for stream in list(self.streams.values()):
            stream.fail(exc)

    async def _sweep(self) -> None:
        """Deadlines, and streams whose engine went silent on them (a wedged core is caught
        sooner by the core's watchdog)."""
        while True:
            await asyncio.sleep(SWEEP_EVERY_S)
            now = time.monotonic()
            for s in list(self.streams.values()):
                if s.deadline is not None and now > s.deadline:
                    self._expire(s, "unattached" if s.sink is None else "deadline")
                elif now - s.heard > STREAM_IDLE_LIMIT_S:
                    s.fail(ServiceError(grpc.StatusCode.UNAVAILABLE, f"request {s.request_id}: the decode engine "
                                        f"produced no token for {STREAM_IDLE_LIMIT_S:.0f}s"))

    def _expire(self, stream: TokenStream, why: str) -> None:
        if why == "unattached":           # nobody opened its stream in time (router gone): reclaim it
            self.abort_request(stream.request_id, "had no stream attached before its admission deadline")
            return
        stream.deadline = None
        stream.fail(TimeoutError(f"request {stream.request_id} passed its client's deadline while decoding"))

    # -- moving streams, switching roles ---------------------------------------------------------
    async def pause(self, rid: str) -> decode_pb2.PauseResponse:
        """Take a running stream out of the batch, its KV packed, for its router to move it (Export);
        every token it made here is in the reply (the last chunks may still be on their way)."""
        stream = self.streams.get(rid)
        if stream is None or stream.done or rid in self.paused:
            return decode_pb2.PauseResponse(found=False)
        reply = await self.core.call(Command.PAUSE, rid)
        if reply.get("paused"):
            self.paused.add(rid)
            asyncio.get_running_loop().call_later(PAUSE_HOLD_S, self._unclaimed, rid, stream)
        return decode_pb2.PauseResponse(**reply)

    def _unclaimed(self, rid: str, stream: TokenStream) -> None:
        if rid in self.paused and self.streams.get(rid) is stream:
            self.abort_request(rid, f"was paused to move, and its router did not move it within {PAUSE_HOLD_S:.0f}s")

    async def export(self, req: decode_pb2.ExportRequest) -> decode_pb2.ExportResponse:
        """Push a paused stream's KV to the worker continuing it; the stream leaves here either way."""
        rid = req.request_id
        if rid not in self.paused:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, f"request {rid!r} is not paused here")
        if not req.kv_address or not req.transfer_id:
            raise ValueError("kv_address and transfer_id are required (the receiving worker's AdmitResponse)")
        timeout = req.timeout_ms / 1000 if req.timeout_ms else EXPORT_TIMEOUT_S
        try:
            reply = await self.core.call(Command.EXPORT, rid, req.kv_address, req.transfer_id,
                                         req.backend or self.cfg.kv_backend, timeout)
        finally:
            self.paused.discard(rid)
            stream = self.streams.get(rid)
            if stream is not None:            # its router goes on elsewhere: no last chunk from here
                self._forget(stream)
        self.moved += 1
        return decode_pb2.ExportResponse(**reply)

    async def switch_role(self, req: decode_pb2.SwitchRoleRequest, metadata=()) -> decode_pb2.SwitchRoleResponse:
        """Serve `req.role` from now on, without a restart: no new work of the old role; the old
        role's work leaves (streams moved by their routers, prompts finished); then the new role.
        Rolls back (ABORTED) if that work has not left within the timeout."""
        check_admin(self.cfg.admin_token, metadata)
        to = req.role
        if to not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {to!r}")
        if self.switching:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, f"a switch to {self.switching} is under way")
        if self.server is not None and self.server.draining:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "worker is draining")
        old, t0, moved = self.role, time.monotonic(), self.moved
        timeout = req.timeout_ms / 1000 if req.timeout_ms else SWITCH_TIMEOUT_S
        streaming = ("decode", "colocated")
        if to != old and not (old in streaming and to in streaming):     # (decode <-> colocated: its streams stay)
            self.switching = to
            log.info("switching role %s -> %s: %d stream(s) and %d prompt(s) to leave first", old, to,
                     len(self.streams), len(self.active))
            try:
                while self.streams or self.active:
                    if time.monotonic() - t0 > timeout:
                        raise ServiceError(grpc.StatusCode.ABORTED, (
                            f"the switch to {to} rolled back: after {timeout:g}s {len(self.streams)} stream(s) and "
                            f"{len(self.active)} prompt(s) were still here (no peer of role {old} to take them?); "
                            f"it serves as {old} again"))
                    await asyncio.sleep(SWITCH_POLL_S)
            finally:
                self.switching = ""
        self.role = to
        seconds = time.monotonic() - t0
        log.info("role %s -> %s in %.2fs (%d stream(s) moved)", old, to, seconds, self.moved - moved)
        return decode_pb2.SwitchRoleResponse(from_role=old, to_role=to, seconds=seconds,
                                             streams_moved=self.moved - moved)

    # -- listeners -----------------------------------------------------------------------------
    def _bus(self, name: str) -> Bus:
        bus = self.buses.get(name)
        if bus is None:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"no token bus {name!r} is open here: Subscribe first (a router does at start)")
        return bus

    async def subscribe(self, req: decode_pb2.SubscribeRequest):
        if not req.subscriber:
            raise ValueError("subscriber is required: the router's name for itself")
        old = self.buses.pop(req.subscriber, None)
        if old is not None:
            self._close_bus(old, "its router subscribed again")
        bus = self.buses[req.subscriber] = Bus(req.subscriber)
        try:
            async for batch in bus.batches():
                yield batch
        finally:
            if self.buses.get(req.subscriber) is bus:
                del self.buses[req.subscriber]
            self._close_bus(bus, "its router's token stream ended")

    def _close_bus(self, bus: Bus, why: str) -> None:
        """Nobody listens to its requests any more: end them (blocks freed)."""
        bus.close()
        for stream in [s for s in self.streams.values() if s.sink is bus]:
            self.abort_request(stream.request_id, f"ended because {why}")

    async def stream(self, rid: str, timeout_ms: int):
        """Decode.Stream: one admitted request's chunks."""
        stream = self.streams.get(rid)
        if stream is None:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, f"request {rid!r} is not admitted here")
        if stream.sink is not None:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} already has a stream")
        stream.deadline = time.monotonic() + timeout_ms / 1000 if timeout_ms else None
        async for chunk in self._relay(stream):
            yield chunk

    async def generate(self, req: decode_pb2.WorkerGenerateRequest):
        """Decode.Generate (colocated): one request, its chunks on this call."""
        async for chunk in self._relay(await self.start_request(req)):
            yield chunk

    async def _relay(self, stream: TokenStream):
        try:
            async for chunk in RequestSink(stream).chunks():
                yield chunk
        finally:
            if not stream.done:              # cancelled by its caller: free everything, once
                self.abort_request(stream.request_id, "was cancelled by its caller")


def _for_core(params: SamplingParams) -> SamplingParams:
    """Stop strings are matched here, on the text; the core only needs to know the tokens'."""
    return replace(params, stop=[]) if params.stop else params


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    """Thin: decode the request, call the worker, encode the reply."""

    def __init__(self, worker: DecodeWorker):
        self.w = worker

    async def Admit(self, request, context):
        return await self.w.admit(request, context.invocation_metadata())

    async def Stream(self, request, context):
        async for chunk in self.w.stream(request.request_id, request.timeout_ms):
            yield chunk

    async def Generate(self, request, context):
        async for chunk in self.w.generate(request):
            yield chunk

    async def Start(self, request, context):
        return await self.w.start_on_bus(request, context.invocation_metadata())

    async def Subscribe(self, request, context):
        async for batch in self.w.subscribe(request):
            yield batch

    async def Abort(self, request, context):
        return worker_pb2.WorkerAbortResponse(found=self.w.abort_request(request.request_id))

    async def GetStatus(self, request, context):
        return self.w.status()

    async def GetMetrics(self, request, context):
        return self.w.metrics_text()

    async def GetKVEvents(self, request, context):
        return await self.w.get_kv_events(request)

    async def Pause(self, request, context):
        return await self.w.pause(request.request_id)

    async def Export(self, request, context):
        return await self.w.export(request)

    async def SwitchRole(self, request, context):
        return await self.w.switch_role(request, context.invocation_metadata())


__all__ = ["DecodeWorker"]
