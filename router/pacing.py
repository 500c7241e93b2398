"""How often the router writes to each client stream (RouterService.relay).

A message costs the router ~40-160 us of CPU whatever it carries (gRPC's own machinery, on the
event loop and its poller thread: docs/benchmarks.md, "the router is the limit"), so hundreds of
streams sent a token at a time take more than the one core a router process has, and new requests
then wait behind the writes. Streams are paced instead: each waits `interval(streams)` between two
messages, its tokens gathering meanwhile, so that all of them together stay within a message rate.

That rate is --stream-message-rate at most, and follows the router's own CPU: while the event
loop's thread is busier than BUSY of the time, the rate falls by a step; below IDLE it climbs back.
What one core carries differs from host to host, and so does the share the requests themselves
take: a fixed rate of 10,000 messages a second saturated a router on an H200 host at ~250 short
requests a second (TTFT climbing while TPOT held); following its CPU it met 280.
"""
from __future__ import annotations

import time

MAX_INTERVAL_S = 0.1        # a paced stream still gets a message at least this often
MIN_INTERVAL_S = 0.002      # shorter waits buy nothing (a decode step is longer)
SAMPLE_S = 0.5              # how often the busy share is read and the rate adjusted
BUSY, IDLE = 0.8, 0.5       # share of the event loop thread's time: above, fewer messages; below, more
DOWN, UP = 0.7, 1.25        # the rate's steps
MIN_RATE = 500.0            # messages a second, all streams together (MAX_INTERVAL_S bounds it too)


class MessagePacer:
    def __init__(self, max_rate: float, clock=time.monotonic, cpu=time.thread_time):
        """`max_rate`: --stream-message-rate (0: no pacing). `cpu`: CPU seconds of the thread that
        calls `interval` (the event loop's); both clocks injectable for tests."""
        self.max_rate = self.rate = max_rate
        self.busy = 0.0                          # the last reading: share of the thread's time it was working
        self._clock, self._cpu = clock, cpu
        self._t, self._c = clock(), cpu()

    def interval(self, streams: int) -> float:
        """Seconds a stream waits after a message before the next, `streams` being relayed now."""
        if not self.max_rate:
            return 0.0
        self.sample()
        pace = min(MAX_INTERVAL_S, streams / self.rate)
        return pace if pace >= MIN_INTERVAL_S else 0.0

    def sample(self) -> None:
        """Read the busy share if SAMPLE_S has passed since the last reading, and adjust the rate.
        Called from the thread it measures: by `interval`, and after each round of health checks
        (so the reading stays current while no stream is relayed)."""
        now = self._clock()
        if now - self._t < SAMPLE_S:
            return
        cpu = self._cpu()
        self.busy = busy = (cpu - self._c) / (now - self._t)
        self._t, self._c = now, cpu
        if not self.max_rate:
            return
        if busy > BUSY:
            self.rate = max(min(MIN_RATE, self.max_rate), self.rate * DOWN)
        elif busy < IDLE:
            self.rate = min(self.max_rate, self.rate * UP)
