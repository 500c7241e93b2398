"""gRPC plumbing every Baton server shares: options, health, reflection, error mapping, drain.

Torch-free (the router uses it too). Servicers raise plain exceptions; `ErrorMapper` turns
them into gRPC statuses in one place: ValueError -> INVALID_ARGUMENT, MemoryError ->
RESOURCE_EXHAUSTED, TimeoutError -> DEADLINE_EXCEEDED, ServiceError -> its own code.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger("baton")

MAX_MESSAGE_BYTES = 64 << 20
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),      # otherwise a second server on a taken port silently "succeeds"
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    *KEEPALIVE_OPTIONS,
]
CHANNEL_OPTIONS = [
    # a restarted worker must be seen again within seconds, not after gRPC's 2-minute backoff
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.enable_retries", 0),    # retries are the router's decision, never implicit
    *KEEPALIVE_OPTIONS,
]


class ServiceError(Exception):
    """An error with an explicit gRPC status code and a message a person can act on."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, ServiceError):
        return exc.code, str(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, MemoryError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"out of KV cache memory: {exc}; retry later or elsewhere"
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "deadline exceeded"
    if isinstance(exc, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED, "cancelled"
    return grpc.StatusCode.INTERNAL, f"internal error: {exc!r}"


class ErrorMapper(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream), handler.request_deserializer, handler.response_serializer)
        return handler


def _wrap_unary(fn):
    async def wrapped(request, context):
        try:
            return await fn(request, context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:
            code, msg = status_for(exc)
            _log_unexpected(code, exc)
            await context.abort(code, msg)
    return wrapped


def _wrap_stream(fn):
    async def wrapped(request, context):
        try:
            async for item in fn(request, context):
                yield item
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:
            code, msg = status_for(exc)
            _log_unexpected(code, exc)
            await context.abort(code, msg)
    return wrapped


def _log_unexpected(code: grpc.StatusCode, exc: Exception) -> None:
    if code is grpc.StatusCode.INTERNAL:
        log.exception("unexpected error", exc_info=exc)


class Server:
    """A grpc.aio server with health + reflection, bound to one address, drained on SIGTERM."""

    def __init__(self, host: str, port: int, service_names: Iterable[str]):
        self.server = grpc.aio.server(interceptors=[ErrorMapper()], options=SERVER_OPTIONS)
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            [*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME], self.server)
        self.address = f"{host}:{port}"
        self.port = self.server.add_insecure_port(self.address)
        if self.port == 0:
            raise OSError(f"cannot listen on {self.address}: address in use or not available")
        self.address = f"{host}:{self.port}"
        self.draining = False

    async def start(self) -> None:
        await self.server.start()
        await self.set_serving(True)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.service_names]:
            result = self.health.set(name, status)
            if asyncio.iscoroutine(result):
                await result

    async def drain_and_stop(self, grace: float) -> None:
        """Health to NOT_SERVING, refuse new work, let in-flight calls finish, then stop."""
        self.draining = True
        await self.set_serving(False)
        await self.server.stop(grace)

    async def wait_for_signal(self, grace: float, on_stop=None) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        print(f"[baton] draining {self.address} (grace {grace:.0f}s)", file=sys.stderr, flush=True)
        await self.drain_and_stop(grace)
        if on_stop is not None:
            on_stop()


def insecure_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)

