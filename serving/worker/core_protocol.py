"""The wire between a worker's front process and its engine core (serving/worker/engine_core.py):
every message, every command, and the framing, defined here and nowhere else.

Two Unix stream sockets, one per direction, carrying length-prefixed pickle frames of the
dataclasses below. Pickle, not protobuf: both ends are the same code base (the front starts
the core from its own interpreter), the frames never leave the host, and a step's frame of
256 updates costs ~0.2 ms to pickle and unpickle, under twice bare tuples (`python -m
baton.benchmarks.core_frames`); msgpack or protobuf would need a dependency and a schema kept
in step with these classes. PROTOCOL_VERSION guards the one way the two ends can differ: a
core started from another install than its front's.

    front -> core   Init(version, target, config)     once, first; a core of another version refuses it (Fatal)
                    Call(call_id, command, args)      run `cmd_<command>`; call_id 0: no reply wanted
    core -> front   Hello(info)                       the core serves; what the front needs to know
                    Fatal(message)                    it could not start, or its engine thread died (one line)
                    Reply(call_id, error, value)      a Call's outcome; error: None or a CoreError
                    Updates(updates, stats, metrics)  after every engine step (and when a request fails
                                                      off the engine): one TokenUpdate per request
                    Beat(stats, metrics)              while idle (the engine thread)
                    Pulse(activity)                   every 0.5 s from a thread of its own, steps or not: what
                                                      the engine thread is doing and its budget (engine/step_clock.py)

A Call's command is a Command member (every role's commands are listed there; a core runs them
through a table built from the enum, serving/worker/engine_core.py). A TokenUpdate names one request's
tokens of a step; what only some updates carry (an error, the handover time, logprobs) is an
optional field. `stats` is CoreStats; `metrics` a list of (metric, labels, value) the front
records. Torch-free.
"""
from __future__ import annotations

import asyncio
import enum
import pickle
import socket
import struct
import threading
from dataclasses import dataclass
from itertools import starmap
from typing import TYPE_CHECKING, Any

import grpc

from baton.engine.scheduling.block_manager import KVCacheFull
from baton.serving.grpc_server import ServiceError, status_for

if TYPE_CHECKING:
    from baton.engine.output_processor import RequestOutput, TokenLogprob
    from baton.engine.step_clock import Pulse as Activity
    from baton.serving.worker.worker_config import WorkerConfig

PROTOCOL_VERSION = 1               # bump on any change to the classes below (their fields travel by position)
FRAME = struct.Struct("!I")
SOCKET_BUFFER_BYTES = 4 << 20      # a front that falls behind by a few steps never blocks the engine

MetricEvent = tuple[str, tuple[str, ...], float]    # (serving.metrics.Metrics attribute, labels, value)


class Command(enum.Enum):
    """Every command an engine core serves, across roles: a Call runs the core's `cmd_<value>`
    coroutine; a role without it answers an error (prefill has no ADMIT)."""
    PREFILL = "prefill"            # prefill: run a prompt, push its KV to a decode worker
    CONNECT = "connect"            # prefill: warm the KV sender to a decode worker
    ADMIT = "admit"                # decode: reserve a request's blocks, expect its KV
    ADD = "add"                    # decode (colocated): a whole request here, no transfer
    ABORT = "abort"                # every role: end a request wherever it is
    KV_EVENTS = "kv_events"        # every role: the prefix cache's changes since the last call
    PAUSE = "pause"                # decode: take a running stream out, its KV packed, to move it
    EXPORT = "export"              # decode: push a paused stream's KV to the worker continuing it

    @property
    def handler(self) -> str:
        return f"cmd_{self.value}"


@dataclass(frozen=True, slots=True)
class CoreStats:
    """The engine core's counters, as of its last step (plain ints: cheap to pickle)."""
    running: int = 0
    waiting: int = 0                   # queued in the engine, plus transfers not yet landed (decode)
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    # speculative decoding (engine/speculative.py), totals since start: guesses verified, guesses
    # kept, and sequence-steps that verified guesses
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verified: int = 0
    spec_accepted_lengths: tuple[int, ...] = ()   # ...and those sequence-steps by guesses kept (0..k)


@dataclass(frozen=True, slots=True)
class CoreError:
    """An exception across the boundary: what the front re-raises (decode_error)."""
    kind: str                          # "value", "kv_full", "timeout" or "status"
    code: str                          # its gRPC status name
    message: str
    retry_after: float | None = None


@dataclass(slots=True)                 # not frozen: a frozen __init__ costs ~4x, 256 times a step on both ends
class TokenUpdate:
    """One request's tokens of one engine step; `error` ends the request."""
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    cached_tokens: int = 0
    error: CoreError | None = None
    handover_s: float = 0.0            # decode: the prefill's last forward -> its join (first update only)
    logprobs: list[TokenLogprob | None] | None = None          # only where the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @classmethod
    def of(cls, out: RequestOutput, error: CoreError | None = None, handover_s: float = 0.0) -> TokenUpdate:
        return cls(out.request_id, out.new_token_ids, out.finish_reason, out.cached_tokens, error, handover_s,
                   out.logprobs, out.prompt_logprobs)


# -- the messages ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Init:
    version: int                       # first, always: fields travel by position, so any core reads it here
    target: str                        # "package.module:Class": the role's core
    config: WorkerConfig


@dataclass(frozen=True, slots=True)
class Call:
    call_id: int
    command: Command
    args: tuple


@dataclass(frozen=True, slots=True)
class Hello:
    info: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Fatal:
    message: str


@dataclass(frozen=True, slots=True)
class Reply:
    call_id: int
    error: CoreError | None
    value: Any = None


@dataclass(frozen=True, slots=True)
class Updates:
    updates: list[TokenUpdate]
    stats: CoreStats
    metrics: list[MetricEvent]

    def __reduce__(self):
        # the updates travel as plain tuples: pickled object by object, a frame costs ~3x more
        return _updates_from_rows, (_update_rows(self.updates), self.stats, self.metrics)


def _update_rows(updates: list[TokenUpdate]) -> list[tuple]:
    """TokenUpdate's fields in their order, spelt out: twice as fast as an attrgetter."""
    return [(u.request_id, u.new_token_ids, u.finish_reason, u.cached_tokens, u.error, u.handover_s, u.logprobs,
             u.prompt_logprobs) for u in updates]


def _updates_from_rows(rows: list[tuple], stats: CoreStats, metrics: list[MetricEvent]) -> Updates:
    return Updates(list(starmap(TokenUpdate, rows)), stats, metrics)


@dataclass(frozen=True, slots=True)
class Beat:
    stats: CoreStats
    metrics: list[MetricEvent]


@dataclass(frozen=True, slots=True)
class Pulse:
    activity: Activity


CoreMessage = Hello | Fatal | Reply | Updates | Beat | Pulse      # what a core sends
FrontMessage = Init | Call                                         # what a front sends


def check_init(msg: object) -> Init:
    """The front's first message, if it speaks this core's protocol; else ValueError, the
    one line the core's Fatal carries (a front and a core from different installs)."""
    if isinstance(msg, Init) and msg.version == PROTOCOL_VERSION:
        return msg
    theirs = msg.version if isinstance(msg, Init) else "none (an unversioned front)"
    raise ValueError(f"engine core protocol mismatch: the front speaks version {theirs}, this core version "
                     f"{PROTOCOL_VERSION} (the two come from different installs of baton; restart the worker)")


# -- framing ---------------------------------------------------------------------------------
class FrameWriter:
    """Blocking, thread-safe: the engine thread and the core's event loop both write."""

    def __init__(self, sock: socket.socket):
        sock.setblocking(True)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        self.sock = sock
        self._lock = threading.Lock()

    def send(self, message: CoreMessage | FrontMessage) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self.sock.sendall(FRAME.pack(len(data)) + data)

    def close(self) -> None:
        self.sock.close()


async def open_reader(sock: socket.socket) -> asyncio.StreamReader:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
    reader, writer = await asyncio.open_unix_connection(sock=sock, limit=SOCKET_BUFFER_BYTES)
    reader.writer = writer              # a StreamWriter closes its transport when collected
    return reader


async def read_frame(reader: asyncio.StreamReader) -> CoreMessage | FrontMessage:
    """The next message; asyncio.IncompleteReadError when the other end is gone."""
    (n,) = FRAME.unpack(await reader.readexactly(FRAME.size))
    return pickle.loads(await reader.readexactly(n))


# -- errors across the boundary ---------------------------------------------------------------
def encode_error(exc: BaseException) -> CoreError:
    code, message = status_for(exc)
    kind = ("value" if isinstance(exc, ValueError) else "kv_full" if isinstance(exc, KVCacheFull)
            else "timeout" if isinstance(exc, TimeoutError) else "status")
    return CoreError(kind, code.name, str(exc) if kind != "status" else message, getattr(exc, "retry_after", None))


def decode_error(error: CoreError) -> Exception:
    if error.kind == "value":
        return ValueError(error.message)
    if error.kind == "kv_full":
        return KVCacheFull(error.message)
    if error.kind == "timeout":
        return TimeoutError(error.message)
    return ServiceError(grpc.StatusCode[error.code], error.message, retry_after=error.retry_after)
