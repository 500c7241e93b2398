"""The prefill role's front (the `baton.v1.Prefill` service): checks a Prefill request and hands
it to its engine core (serving/worker/kv_push.py), which runs the prompt, pushes its KV to the
decode worker the router chose, and answers with the first token; Abort ends it there. The
front holds no KV and no model: only what the RPCs need. The prefill worker is this
(prefill_service/server.py); a decode worker serves it too, once switched to the prefill role.
"""
from __future__ import annotations

import asyncio

import grpc

from baton.serving import tracing
from baton.serving.grpc_server import ServiceError
from baton.serving.wire import media_from_proto, sampling_from_proto
from baton.serving.worker.core_protocol import Command
from baton.v1 import prefill_pb2, prefill_pb2_grpc, worker_pb2

DEFAULT_TIMEOUT_S = 120.0
CONNECT_TIMEOUT_S = 60.0        # a KV warm-up without a timeout: a device pair's communicator may take seconds


class PrefillFront:
    """Mixed into an EngineWorker whose core is a PushingCore: the Prefill RPCs' bodies."""

    active: set[str]            # prompts prefilling here

    def check_prefill_role(self) -> None:
        """A worker of another role refuses prompts (a decode worker serves the service to switch)."""

    async def prefill(self, req: prefill_pb2.PrefillRequest, metadata=()) -> prefill_pb2.PrefillResponse:
        self.check_accepting()
        self.check_prefill_role()
        rid = req.request_id
        if not rid:
            raise ValueError("request_id is required")
        if rid in self.active:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is already prefilling here")
        handoff = req.handoff
        if not handoff.decode_address or not handoff.transfer_id:
            raise ValueError("handoff.decode_address and handoff.transfer_id are required")
        backend = self._backend(handoff.backend)
        prompt, params = list(req.prompt_token_ids), sampling_from_proto(req.sampling)
        self.limits.validate(prompt, params)
        most = (len(prompt) - 1) // self.info["block_size"]      # (LLMEngine.add_request checks it too)
        if handoff.skip_blocks > most:
            raise ValueError(f"handoff.skip_blocks {handoff.skip_blocks} is past the {most} full blocks a decode "
                             f"worker's prefix cache can hold of this {len(prompt)}-token prompt")
        images = media_from_proto(req)          # images or audio clips
        timeout = req.timeout_ms / 1000 if req.timeout_ms else DEFAULT_TIMEOUT_S
        self.active.add(rid)
        span = tracing.start("prefill.worker", metadata, attributes={
            "baton.request_id": rid, "baton.prompt_tokens": len(prompt), "baton.kv_backend": backend})
        failure: BaseException | None = None
        try:
            reply = await self.core.call(Command.PREFILL, rid, prompt, params, images,
                                         (handoff.decode_address, handoff.transfer_id, backend), timeout,
                                         handoff.skip_blocks)
            tracing.child_from_timing(span, "kv_transfer", reply.get("transfer_seconds", 0.0),
                                      {"baton.kv_bytes": reply.get("transfer_bytes", 0), "baton.kv_backend": backend})
        except BaseException as exc:
            failure = exc
            if isinstance(exc, asyncio.CancelledError):     # the router gave up on it: so does the core
                self.core.cast(Command.ABORT, rid)
            raise
        finally:
            self.requests_served += 1
            self.active.discard(rid)
            tracing.end(span, failure)
        return prefill_pb2.PrefillResponse(**reply)

    def _backend(self, asked: str) -> str:
        backend = asked or self.cfg.kv_backend
        if backend not in self.kv_backends():
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, f"KV backend {backend!r} is not available on "
                               f"this prefill worker (it speaks {self.kv_backends()}); start it with --kv-backend "
                               f"{backend}")
        return backend

    async def connect_kv(self, req: prefill_pb2.ConnectKVRequest) -> prefill_pb2.ConnectKVResponse:
        """Warm this worker's KV sender to a decode worker (the core's cmd_connect); an error status
        within the timeout when it cannot."""
        if not req.decode_address:
            raise ValueError("decode_address is required")
        backend = self._backend(req.backend)
        timeout = req.timeout_ms / 1000 if req.timeout_ms else CONNECT_TIMEOUT_S
        reply = await self.core.call(Command.CONNECT, req.decode_address, backend, timeout)
        return prefill_pb2.ConnectKVResponse(**reply)

    def abort_prefill(self, rid: str) -> bool:
        self.core.cast(Command.ABORT, rid)
        return rid in self.active


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, worker):
        self.w = worker

    async def Prefill(self, request, context):
        return await self.w.prefill(request, context.invocation_metadata())

    async def Abort(self, request, context):
        return worker_pb2.WorkerAbortResponse(found=self.w.abort_request(request.request_id))

    async def ConnectKV(self, request, context):
        return await self.w.connect_kv(request)

    async def GetStatus(self, request, context):
        return self.w.status()

    async def GetMetrics(self, request, context):
        return self.w.metrics_text()

    async def GetKVEvents(self, request, context):
        return await self.w.get_kv_events(request)


__all__ = ["PrefillFront", "PrefillServicer"]
