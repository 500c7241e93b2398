"""Admission control: how many requests the router runs, queues and refuses.

At most `max_inflight` requests are routed to workers at once; up to `max_queued` more wait
for a slot (lowest `priority` first, then first come, first served; the workers' own queues
follow --scheduling-policy), each for no longer than `queue_timeout` or its own
deadline. Beyond that a request is refused at once with RESOURCE_EXHAUSTED and a
`retry-after-ms` hint, so overload costs a bounded amount of router memory. Each client
(its bearer token's name, else its address) may also hold at most
`max_per_client` requests, queued or running, so one client cannot starve the rest.
"""
from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import itertools
import time
from collections.abc import Callable

import grpc

from baton.serving.grpc_server import ServiceError


class Admission:
    def __init__(self, max_inflight: int, max_queued: int, queue_timeout: float, max_per_client: int = 0):
        self.max_inflight = max_inflight
        self.max_queued = max_queued
        self.queue_timeout = queue_timeout
        self.max_per_client = max_per_client
        self.inflight = 0
        self.queue: list[tuple[int, int, asyncio.Future]] = []    # (priority, arrival, waiter), sorted
        self._arrivals = itertools.count()
        self.per_client: collections.Counter[str] = collections.Counter()
        self.refused = 0
        self.peak_inflight = 0
        self.peak_queued = 0
        self._done: collections.deque[float] = collections.deque(maxlen=256)   # completion times

    def retry_after(self) -> float:
        """Seconds until a slot is likely free: the queue ahead over the recent completion rate."""
        now = time.monotonic()
        recent = [t for t in self._done if now - t < 30]
        rate = len(recent) / max(1e-3, now - recent[0]) if len(recent) >= 2 else 1.0
        return min(30.0, max(0.1, (len(self.queue) + 1) / max(rate, 1e-3)))

    @contextlib.asynccontextmanager
    async def slot(self, client: str, deadline: float, priority: int = 0):
        """Hold one running slot for the body; raises ServiceError when refused."""
        if self.max_per_client and self.per_client[client] >= self.max_per_client:
            self.refused += 1
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"client {client!r} already has {self.per_client[client]} requests in flight "
                               f"(limit {self.max_per_client}); wait for one to finish", retry_after=self.retry_after())
        self.per_client[client] += 1
        try:
            await self._acquire(deadline, priority)
            try:
                yield
            finally:
                self._release()
        finally:
            self.per_client[client] -= 1
            if self.per_client[client] <= 0:
                del self.per_client[client]

    async def _acquire(self, deadline: float, priority: int) -> None:
        if self.inflight < self.max_inflight and not self.queue:
            self._take()
            return
        if len(self.queue) >= self.max_queued:
            self.refused += 1
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"router is at capacity ({self.inflight} running, {len(self.queue)} queued); "
                               "retry later", retry_after=self.retry_after())
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        bisect.insort(self.queue, (priority, next(self._arrivals), waiter), key=lambda e: e[:2])
        self.peak_queued = max(self.peak_queued, len(self.queue))
        wait = min(self.queue_timeout, deadline - loop.time())
        try:
            await asyncio.wait_for(asyncio.shield(waiter), max(0.0, wait))
        except TimeoutError:
            self._drop(waiter)
            self.refused += 1
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"no capacity within {wait:.1f}s ({self.inflight} running, {len(self.queue)} queued); "
                               "retry later", retry_after=self.retry_after()) from None
        except BaseException:
            self._drop(waiter)
            raise

    def _drop(self, waiter: asyncio.Future) -> None:
        """A waiter leaves: if it was already handed a slot, pass that slot on."""
        if waiter.done() and not waiter.cancelled():
            self._release()
        else:
            waiter.cancel()
            self.queue = [e for e in self.queue if e[2] is not waiter]

    def _take(self) -> None:
        self.inflight += 1
        self.peak_inflight = max(self.peak_inflight, self.inflight)

    def _release(self) -> None:
        self.inflight -= 1
        self._done.append(time.monotonic())
        while self.queue and self.inflight < self.max_inflight:
            waiter = self.queue.pop(0)[2]
            if not waiter.done():
                self._take()
                waiter.set_result(None)


class KVWaitLine:
    """Requests that fit the model but not the decode KV free right now wait here instead of
    failing: first come, first served (a request keeps its place across tries), each until a
    decode worker reports room for it or its deadline passes. At most `max_waiting` wait; beyond
    that a request is refused with RESOURCE_EXHAUSTED and a retry hint."""

    POLL_S = 0.25                    # the workers' status is refreshed every 0.5 s

    def __init__(self, max_waiting: int):
        self.max_waiting = max_waiting
        self.line: list[int] = []    # tickets of those waiting, in arrival order
        self._tickets = itertools.count()
        self.waits = 0               # requests that waited at least once
        self.refused = 0

    def ticket(self) -> int:
        return next(self._tickets)

    async def wait(self, ticket: int, fits: Callable[[], bool], deadline: float,
                   hopeless: Callable[[], str | None] = lambda: None, grace: float = 0.0) -> None:
        """Until `ticket` is first in line and `fits()`; TimeoutError at `deadline`; UNAVAILABLE
        once `hopeless()` has said why it can never fit (no decode worker left that could hold it)
        for `grace` seconds on end: a wait for room on workers there are none of has no end."""
        if ticket not in self.line and len(self.line) >= self.max_waiting:
            self.refused += 1
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"out of KV cache memory and {len(self.line)} requests already wait for it; retry later",
                               retry_after=1.0)
        bisect.insort(self.line, ticket)
        loop = asyncio.get_running_loop()
        since = None                 # when `hopeless` began to hold
        try:
            while not (self.line[0] == ticket and fits()):
                if loop.time() >= deadline:
                    raise TimeoutError("the request's deadline passed while it waited for KV cache memory")
                why = hopeless()
                since = None if why is None else loop.time() if since is None else since
                if since is not None and loop.time() - since >= grace:
                    raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"{why}, for {grace:g}s, while the request "
                                       "waited for KV cache memory")
                await asyncio.sleep(min(self.POLL_S, max(0.0, deadline - loop.time())))
        finally:
            self.line.remove(ticket)
