"""The router's token bus to one decode or colocated worker: ONE Decode.Subscribe stream that
carries the chunks of every request this router runs there, one TokenBatch per worker step
(decode_service/server.py), instead of one stream per request. Reading a stream message is
most of what relaying a token costs in Python; on the bus a step of 256 streams is one read,
not 256, and only the writes to the clients remain (each of which coalesces what piled up
while it waited: server.py).

Each request registers its worker request id and gets its chunks in its own `Inbox`, which
merges whatever piled up into one chunk when the request's writer comes for it. A bus
that breaks (the worker died, restarted or went away) breaks every request on it at once,
which is what a dead worker does anyway: each gets `BusBroken`, and the router retries or
migrates it. The next request opens the bus again.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import uuid

import grpc

from baton.v1 import decode_pb2

# this router process's name on every worker's bus (a restarted router gets a new one)
SUBSCRIBER = f"router-{uuid.uuid4().hex[:12]}"


class BusBroken(Exception):
    """The worker's token stream ended under a request; `code` is the gRPC status it ended with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class StreamStalled(BusBroken):
    """A running stream got no token for its stall limit while its worker answered health checks."""

    def __init__(self, message: str):
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)


class MoveAsked(Exception):
    """Put in a request's inbox to have its stream moved off its worker (a role switch,
    router/moves.py): `next` raises it once the chunks before it are taken."""


class Inbox:
    """One request's chunks off the bus. `next` returns every chunk that arrived since the
    last call merged into one: a client that fell behind gets one fuller message, and so does
    one whose writer `gather`s for a while (server.py paces writes under load)."""

    def __init__(self):
        self._items: collections.deque = collections.deque()
        self._wake = asyncio.Event()
        self._ended = asyncio.Event()        # the request's last chunk (or its end) is in

    def put(self, item) -> None:
        self._items.append(item)
        self._wake.set()
        if isinstance(item, MoveAsked):
            return
        if isinstance(item, BusBroken) or item.finish_reason or item.error_code:
            self._ended.set()

    async def gather(self, seconds: float) -> None:
        """Let chunks pile up for `seconds`, or until the request's end arrives (which goes out at once)."""
        if not self._ended.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(seconds):
                    await self._ended.wait()

    async def next(self, deadline: float = math.inf, stall_at: float = math.inf) -> decode_pb2.TokenChunk:
        """The next (merged) chunk; BusBroken if the bus broke; TimeoutError at `deadline`, and
        StreamStalled at `stall_at` when that comes first (loop times). A chunk with an error_code is
        returned alone: the caller raises it."""
        if not self._items:
            until = min(deadline, stall_at)
            try:
                async with asyncio.timeout_at(None if math.isinf(until) else until):
                    while not self._items:
                        self._wake.clear()
                        await self._wake.wait()
            except TimeoutError:
                if until < deadline:
                    raise StreamStalled("no token for its stall limit") from None
                raise
        item = self._items.popleft()
        if isinstance(item, (BusBroken, MoveAsked)):
            raise item
        while not (item.finish_reason or item.error_code) and self._items and _mergeable(self._items[0]):
            merge(item, self._items.popleft())
        return item


def _mergeable(item) -> bool:
    return not isinstance(item, (BusBroken, MoveAsked)) and not item.error_code


def merge(into: decode_pb2.TokenChunk, chunk: decode_pb2.TokenChunk) -> None:
    """`chunk` appended to `into`: its tokens and text after, its end (finish, usage) if any."""
    into.token_ids.extend(chunk.token_ids)
    into.text += chunk.text
    into.logprobs.extend(chunk.logprobs)
    if chunk.finish_reason:
        into.finish_reason = chunk.finish_reason
        into.usage.CopyFrom(chunk.usage)


class TokenBus:
    def __init__(self, stub, address: str):
        self.stub, self.address = stub, address
        self._inboxes: dict[str, Inbox] = {}
        self._open: asyncio.Future | None = None     # the Subscribe call, once its first (empty) batch came
        self._closing = ""

    async def register(self, worker_request_id: str, timeout: float) -> Inbox:
        """Where this request's chunks (then, if the bus breaks, a BusBroken) arrive; the bus
        is open once this returns, so the worker accepts the request's subscriber."""
        if self._open is None or (self._open.done() and (self._open.cancelled() or self._open.exception())):
            self._open = asyncio.ensure_future(self._subscribe())
        await asyncio.wait_for(asyncio.shield(self._open), timeout)
        inbox = self._inboxes[worker_request_id] = Inbox()
        return inbox

    def inbox(self, worker_request_id: str) -> Inbox | None:
        return self._inboxes.get(worker_request_id)

    def unregister(self, worker_request_id: str) -> None:
        self._inboxes.pop(worker_request_id, None)

    def close(self, reason: str = "the router closed its token stream") -> None:
        """End the bus now: every request on it gets BusBroken(UNAVAILABLE, reason)."""
        fut = self._open
        if fut is not None and fut.done() and not fut.cancelled() and fut.exception() is None:
            self._closing = reason
            fut.result().cancel()

    async def _subscribe(self):
        call = self.stub.Subscribe(decode_pb2.SubscribeRequest(subscriber=SUBSCRIBER))
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as exc:
            raise BusBroken(exc.code(), f"token stream of {self.address}: {exc.details()}") from None
        if first is grpc.aio.EOF:
            raise BusBroken(grpc.StatusCode.UNAVAILABLE, f"{self.address} ended its token stream at once")
        asyncio.ensure_future(self._read(call))
        return call

    async def _read(self, call) -> None:
        broken = BusBroken(grpc.StatusCode.UNAVAILABLE, f"{self.address} ended its token stream")
        try:
            while True:
                batch = await call.read()
                if batch is grpc.aio.EOF:
                    break
                inboxes = self._inboxes
                for chunk in batch.chunks:
                    inbox = inboxes.get(chunk.request_id)
                    if inbox is not None:
                        inbox.put(chunk)
        except grpc.aio.AioRpcError as exc:
            broken = BusBroken(exc.code(), f"token stream of {self.address}: {exc.code().name}: {exc.details()}")
            if self._closing:                    # we cancelled it: the worker was left
                broken = BusBroken(grpc.StatusCode.UNAVAILABLE, self._closing)
        except asyncio.CancelledError:
            broken = BusBroken(grpc.StatusCode.UNAVAILABLE, self._closing or "the router closed its token stream")
        finally:
            self._open, self._closing = None, ""
            inboxes, self._inboxes = self._inboxes, {}
            for inbox in inboxes.values():
                inbox.put(broken)
            with contextlib.suppress(Exception):
                call.cancel()
