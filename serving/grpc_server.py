"""gRPC plumbing every Baton server shares: options, health, reflection, error mapping, drain.

Torch-free (the router uses it too). Servicers raise plain exceptions; `ErrorMapper` turns
them into gRPC statuses in one place: ValueError -> INVALID_ARGUMENT, KVCacheFull ->
RESOURCE_EXHAUSTED, TimeoutError -> DEADLINE_EXCEEDED, ServiceError -> its own code.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hmac
import inspect
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from baton import environment
from baton.engine.scheduling.block_manager import KVCacheFull
from baton.serving.security import TLSConfig, bearer

log = logging.getLogger("baton")

MAX_MESSAGE_BYTES = 64 << 20
MAX_PENDING_CALLS = 1 << 16
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
    # gRPC's core cancels calls that arrive while over 1,000 wait to be taken up by the event loop
    # (a bare CANCELLED, nothing logged): a burst of new streams lost ~3 % of them. The services'
    # own bounds (the router's admission queue, a worker's waiting queue) shed instead, with a reason.
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
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


class PortInUse(OSError):
    """A port this process must listen on is taken: found before anything is loaded."""


class ServiceError(Exception):
    """An error with an explicit gRPC status code and a message a person can act on.

    `retry_after` (seconds) goes to the client as the `retry-after-ms` trailer: when an
    overloaded server expects capacity again.
    """

    def __init__(self, code: grpc.StatusCode, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.code = code
        self.retry_after = retry_after


RETRY_AFTER_KEY = "retry-after-ms"
KV_FULL = "out of KV cache memory"       # how a KVCacheFull reads on the wire (the router waits for room)


def retry_after_ms(metadata) -> int | None:
    """The retry hint an overloaded Baton server attached to its error, if any."""
    for key, value in metadata or ():
        if key == RETRY_AFTER_KEY:
            return int(value)
    return None


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, ServiceError):
        return exc.code, str(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, KVCacheFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"{KV_FULL}: {exc}; retry later or elsewhere"
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "deadline exceeded"
    if isinstance(exc, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED, "cancelled"
    return grpc.StatusCode.INTERNAL, f"internal error: {exc!r}"


class ErrorMapper(grpc.aio.ServerInterceptor):
    """Every exception of a unary or server-streaming handler becomes its status (status_for);
    a request body that does not decode is INVALID_ARGUMENT, not an UNKNOWN with a traceback."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        decode = _tolerant(handler.request_deserializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary), decode, handler.response_serializer)
        if handler.unary_stream is not None:
            stream = handler.unary_stream
            wrap = _wrap_stream if inspect.isasyncgenfunction(stream) else _wrap_unary   # (a writer: context.write)
            return grpc.unary_stream_rpc_method_handler(wrap(stream), decode, handler.response_serializer)
        return handler


class _Undecodable:
    """A request body its message type could not parse (carried to the handler, which refuses it)."""

    def __init__(self, error: Exception):
        self.error = error


def _tolerant(deserializer):
    if deserializer is None:
        return None

    def decode(raw: bytes):
        try:
            return deserializer(raw)
        except Exception as exc:              # DecodeError and the like: the client's bytes are bad
            return _Undecodable(exc)
    return decode


async def _refuse_undecodable(request, context) -> None:
    if isinstance(request, _Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"the request body is not a valid message for this method ({request.error}); "
                            "check that the client uses Baton's baton.v1 protos")


def _wrap_unary(fn):
    async def wrapped(request, context):
        await _refuse_undecodable(request, context)
        try:
            return await fn(request, context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:
            await _abort_with(context, exc)
    return wrapped


def _wrap_stream(fn):
    async def wrapped(request, context):
        await _refuse_undecodable(request, context)
        try:
            async for item in fn(request, context):
                yield item
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:
            await _abort_with(context, exc)
    return wrapped


async def _abort_with(context, exc: Exception) -> None:
    code, msg = status_for(exc)
    _log_unexpected(code, exc)
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        context.set_trailing_metadata(((RETRY_AFTER_KEY, str(max(1, int(retry_after * 1000)))),))
    try:
        await context.abort(code, msg)
    except grpc.aio.AbortError:
        raise
    except Exception as err:
        # The call ended under us (the client cancelled, or its deadline passed as we answered):
        # nobody is left to tell, and grpc would log the failed send with a traceback.
        log.debug("%s could not be answered (%s: %s): the call had ended", code.name, type(err).__name__, err)
        raise asyncio.CancelledError from err


def _log_unexpected(code: grpc.StatusCode, exc: Exception) -> None:
    if code is grpc.StatusCode.INTERNAL:
        log.exception("unexpected error", exc_info=exc)


class HealthService(health.aio.HealthServicer):
    """The whole standard `grpc.health.v1.Health`: Check, Watch (streams every change) and List
    (every service this server reports on)."""

    async def List(self, request, context) -> health_pb2.HealthListResponse:
        return health_pb2.HealthListResponse(statuses={
            name: health_pb2.HealthCheckResponse(status=status) for name, status in self._server_status.items()})


class Server:
    """A grpc.aio server with health + reflection, bound to one address, drained on SIGTERM.

    Plaintext unless `tls` is enabled (then TLS, mutual when it requires client certs).
    `max_concurrent_rpcs` is a hard bound: gRPC itself answers RESOURCE_EXHAUSTED beyond it.
    `reuse_port`: other servers started so may listen on the same port (SO_REUSEPORT: the kernel
    deals connections out among them); off, a taken port is an error.
    """

    def __init__(self, host: str, port: int, service_names: Iterable[str], tls: TLSConfig | None = None,
                 interceptors: Iterable[grpc.aio.ServerInterceptor] = (), max_concurrent_rpcs: int | None = None,
                 reuse_port: bool = False):
        options = [(k, 1 if k == "grpc.so_reuseport" and reuse_port else v) for k, v in SERVER_OPTIONS]
        self.server = grpc.aio.server(interceptors=[*interceptors, ErrorMapper()], options=options,
                                      maximum_concurrent_rpcs=max_concurrent_rpcs)
        self.health = HealthService()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            [*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME], self.server)
        self.address = f"{host}:{port}"
        wrong_host = host_problem(host)
        if wrong_host:                  # before the port check: a host this machine lacks is no taken port
            raise PortInUse(f"cannot listen on {self.address}: {wrong_host}")
        wrong_tls = pem_problem(tls)
        if wrong_tls:
            raise ValueError(wrong_tls)
        if port and not reuse_port and not port_is_free(host, port):
            raise PortInUse(f"cannot listen on {self.address}: the port is in use (another Baton process?); stop "
                            "the other process or pick another with --port")
        try:
            if tls is not None and tls.cert:
                self.port = self.server.add_secure_port(self.address, tls.server_credentials())
            else:
                self.port = self.server.add_insecure_port(self.address)
        except RuntimeError:              # grpcio >= 1.6x raises "Failed to bind" where older ones returned 0
            self.port = 0
        if self.port == 0:
            raise PortInUse(f"cannot listen on {self.address}: the port is in use (another Baton process?) or the "
                            "address is not this host's; stop the other process or pick another with --port")
        self.address = f"{host}:{self.port}"
        self.draining = False

    async def start(self) -> None:
        await self.server.start()
        await self.set_serving(True)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def drain_and_stop(self, grace: float, busy: Callable[[], int] | None = None) -> None:
        """Health to NOT_SERVING and refuse new work (servicers check `draining`), let the
        `busy()` in-flight requests finish within `grace` seconds, then stop the server.

        The port stays open while draining: in-flight requests still need RPCs that are new
        to gRPC (a KV push into an admitted request, an Abort, a status poll).
        """
        self.draining = True
        await self.set_serving(False)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        last_report = 0.0
        while busy is not None and loop.time() < deadline:
            n = busy()
            if n == 0:
                break
            if loop.time() - last_report > 5:
                print(f"[baton] draining {self.address}: {n} request(s) in flight, "
                      f"{deadline - loop.time():.0f}s of grace left", file=sys.stderr, flush=True)
                last_report = loop.time()
            await asyncio.sleep(0.05)
        await self.server.stop(max(0.0, min(1.0, deadline - loop.time())))

    async def wait_for_signal(self, grace: float, on_stop=None, busy: Callable[[], int] | None = None) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        print(f"[baton] draining {self.address} (grace {grace:.0f}s)", file=sys.stderr, flush=True)
        await self.drain_and_stop(grace, busy)
        if on_stop is not None:
            result = on_stop()
            if asyncio.iscoroutine(result):
                await result
        print(f"[baton] {self.address} stopped", file=sys.stderr, flush=True)


def open_channel(address: str, tls: TLSConfig | None = None, options=None) -> grpc.aio.Channel:
    """An asyncio channel to a Baton peer: TLS when this process has a TLS config.
    `options` replace the defaults (CHANNEL_OPTIONS), e.g. the KV channel's own."""
    opts = list(CHANNEL_OPTIONS if options is None else options)
    if tls is not None and tls.enabled:
        return grpc.aio.secure_channel(address, tls.channel_credentials(), options=opts + tls.channel_options())
    return grpc.aio.insecure_channel(address, options=opts)


def open_sync_channel(address: str, tls: TLSConfig | None = None) -> grpc.Channel:
    """The blocking twin of `open_channel`, for CLIs and health checks."""
    if tls is not None and tls.enabled:
        return grpc.secure_channel(address, tls.channel_credentials(), options=tls.channel_options())
    return grpc.insecure_channel(address)


def insecure_channel(address: str) -> grpc.aio.Channel:
    return open_channel(address)


def port_is_free(host: str, port: int) -> bool:
    """Can this process listen on (host, port)? Checked with a plain socket before gRPC tries,
    so a clash gets one clear line instead of gRPC core's log."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # as gRPC binds: a dead server's connections lingering in TIME_WAIT don't count, a listener does
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host.strip("[]"), port))
        except OSError:
            return False
    return True


def pem_problem(tls: TLSConfig | None) -> str | None:
    """A TLS file that holds no PEM block of its kind, named by its flag: gRPC core would only log
    "Invalid cert chain file" and fail the listen (read as a taken port) or every connection."""
    if tls is None:
        return None
    for name, path, kinds in (("--tls-cert", tls.cert, ("CERTIFICATE",)), ("--tls-ca", tls.ca, ("CERTIFICATE",)),
                              ("--tls-key", tls.key, ("PRIVATE KEY", "RSA PRIVATE KEY", "EC PRIVATE KEY"))):
        if not path:
            continue
        try:
            text = Path(path).read_bytes()
        except OSError as exc:
            return f"{name} {path}: {exc.strerror or exc}"
        if not any(f"-----BEGIN {kind}-----".encode() in text for kind in kinds):
            what = "private key" if name == "--tls-key" else "certificate"
            return f"{name} {path}: no PEM {what} in it (a '-----BEGIN {kinds[0]}-----' block)"
    return None


def host_problem(host: str) -> str | None:
    """Why this process cannot listen on `host` at all (a name that does not resolve, an address
    of another machine), in one line naming --host; None when it can (a taken port is not this)."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host.strip("[]"), 0))
        except OSError as exc:
            why = exc.strerror or str(exc)
            return (f"--host {host}: not an address of this machine ({why}); give one of its own, "
                    "127.0.0.1 (this machine only) or 0.0.0.0 (every interface)")
    return None


def run_server(main, name: str) -> None:
    """asyncio.run(main) for a server process. What a user can fix ends it with one line and no
    traceback: a port clash (exit 1), a ValueError from the model, the device or a setting
    (exit 2; `--log-level debug` adds the traceback). Started by `baton serve`, it ends with it."""
    end_with_supervisor()
    try:
        asyncio.run(main)
    except PortInUse as exc:
        print(f"baton {name}: {exc}", file=sys.stderr)
        sys.exit(1)
    except ValueError as exc:
        log.debug("%s failed to start", name, exc_info=exc)
        print(f"baton {name}: {exc}", file=sys.stderr)
        sys.exit(2)


def signal_on_parent_death(sig: int) -> None:
    """Linux: the kernel sends this process `sig` when its parent dies (PR_SET_PDEATHSIG); elsewhere nothing."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, sig)


def end_with_supervisor() -> None:
    """Linux, under `baton serve` (BATON_SUPERVISOR_PID): the kernel sends this process SIGTERM, which drains
    it as a stop does, when the supervisor dies, even by kill -9, so no server outlives it holding its port.
    A supervisor already gone before the request was made: the same SIGTERM now."""
    pid = environment.SUPERVISOR_PID.get()
    if not pid or not sys.platform.startswith("linux"):
        return
    signal_on_parent_death(signal.SIGTERM)
    if os.getppid() != int(pid):
        os.kill(os.getpid(), signal.SIGTERM)


def check_admin(token: str | None, metadata) -> None:
    """An operator's call (a role switch): its bearer token must be `token` (--admin-token); with
    none configured every such call is refused."""
    if not token:
        raise ServiceError(grpc.StatusCode.PERMISSION_DENIED, "operators' calls are off here: start the router and "
                           "its workers with the same --admin-token (env BATON_ADMIN_TOKEN)")
    presented = bearer(metadata)
    if presented is None:
        raise ServiceError(grpc.StatusCode.UNAUTHENTICATED,
                           "missing admin token: send metadata 'authorization: Bearer <--admin-token>'")
    if not hmac.compare_digest(token.encode(), presented.encode()):
        raise ServiceError(grpc.StatusCode.UNAUTHENTICATED, "wrong admin token")
