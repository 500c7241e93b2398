"""The wire between a worker's front process and its engine core (serving/engine_core.py).

Two Unix stream sockets, one per direction, carrying length-prefixed pickle frames. Pickle,
not protobuf: both ends are the same code base, the frames never leave the host, and one
frame of a step's 256 updates costs ~45 µs to pickle (msgpack would need a dependency and
a schema for the same). Messages are tuples whose first item is their kind:

    front -> core   (INIT, "module:Class", WorkerConfig)          once, first
                    (CALL, call_id, method, args)                call_id 0: no reply wanted
    core -> front   (HELLO, info)                                the core serves; what the front needs
                    (FATAL, message)                             it could not start (one line to show)
                    (REPLY, call_id, error, value)               error: None or encode_error(...)
                    (UPDATES, updates, stats, metrics)           after every engine step (and when a
                                                                 request fails off the engine)
                    (BEAT, stats, metrics)                       while idle (the engine thread)
                    (PULSE, pulse)                               every 0.5 s from a thread of its own,
                                                                 steps or not: what the engine thread is
                                                                 doing and its budget (engine/step_clock.py)

An update is (request_id, new_token_ids, finish_reason, cached_tokens, error, handover_s[,
logprobs, prompt_logprobs]): one request's tokens of that step; `error` (None or
encode_error(...)) ends the request; the last two (logprobs_of) only where the request asked.
`stats` is CoreStats; `metrics` a list of (metric, labels, value) the front records.
Torch-free.
"""
from __future__ import annotations

import asyncio
import pickle
import socket
import struct
import threading
from dataclasses import dataclass

import grpc

from baton.engine.scheduling.block_manager import KVCacheFull
from baton.serving.grpc_server import ServiceError, status_for

INIT, CALL, HELLO, FATAL, REPLY, UPDATES, BEAT, PULSE = (
    "init", "call", "hello", "fatal", "reply", "updates", "beat", "pulse")
FRAME = struct.Struct("!I")
SOCKET_BUFFER_BYTES = 4 << 20      # a front that falls behind by a few steps never blocks the engine


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


class FrameWriter:
    """Blocking, thread-safe: the engine thread and the core's event loop both write."""

    def __init__(self, sock: socket.socket):
        sock.setblocking(True)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        self.sock = sock
        self._lock = threading.Lock()

    def send(self, message: tuple) -> None:
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


async def read_frame(reader: asyncio.StreamReader) -> tuple:
    """The next message; asyncio.IncompleteReadError when the other end is gone."""
    (n,) = FRAME.unpack(await reader.readexactly(FRAME.size))
    return pickle.loads(await reader.readexactly(n))


def logprobs_of(out) -> tuple:
    """An update's tail: a RequestOutput's logprob records, if it has any."""
    if out.logprobs is None and out.prompt_logprobs is None:
        return ()
    return out.logprobs, out.prompt_logprobs


# -- errors across the boundary ---------------------------------------------------------------
def encode_error(exc: BaseException) -> tuple[str, str, str, float | None]:
    """(kind, grpc status name, message, retry_after): what the front re-raises (decode_error)."""
    code, message = status_for(exc)
    kind = ("value" if isinstance(exc, ValueError) else "kv_full" if isinstance(exc, KVCacheFull)
            else "timeout" if isinstance(exc, TimeoutError) else "status")
    return kind, code.name, str(exc) if kind != "status" else message, getattr(exc, "retry_after", None)


def decode_error(error: tuple[str, str, str, float | None]) -> Exception:
    kind, code, message, retry_after = error
    if kind == "value":
        return ValueError(message)
    if kind == "kv_full":
        return KVCacheFull(message)
    if kind == "timeout":
        return TimeoutError(message)
    return ServiceError(grpc.StatusCode[code], message, retry_after=retry_after)
