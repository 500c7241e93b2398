"""Coalesced writes on one control stream (both ends use it)."""
from __future__ import annotations

import asyncio


class Outbox:
    """The writes of one control stream. A gRPC stream takes one write at a time, and waiting
    for each in turn made a message pay for every one queued before it (under load, dozens of
    OPENs and PIECEs); here what is put while a write is under way goes out together in the
    next one, in order (`batch` wraps several), and an idle stream writes at once. A message
    may come with `then`, run once its write has gone out, in the order of the messages (the
    sender posts a PIECE's bytes there: the PIECE is on its way first, and sends are posted in
    the order of their PIECEs)."""

    def __init__(self, write, batch, on_error):
        self._write = write
        self._batch = batch
        self._on_error = on_error
        self._queued: list = []              # (message, then)
        self._task: asyncio.Task | None = None
        self.closed = False
        self.messages = self.writes = 0      # how well it coalesces

    def put(self, msg, then=None) -> None:
        if self.closed:
            return
        self._queued.append((msg, then))
        if self._task is None:              # (not an eager task: grpc.aio's write fails in one)
            self._task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            while self._queued:
                queued, self._queued = self._queued, []
                msgs = [m for m, _ in queued]
                self.messages += len(msgs)
                self.writes += 1
                await self._write(msgs[0] if len(msgs) == 1 else self._batch(msgs))
                for _, then in queued:
                    if then is not None:
                        then()
        except Exception as exc:             # the stream (or the pair, in a `then`) broke: nothing more goes
            self.closed = True
            self._queued.clear()
            self._on_error(exc)
        finally:
            self._task = None

    def close(self) -> None:
        self.closed = True
        self._queued.clear()
        if self._task is not None:
            self._task.cancel()


