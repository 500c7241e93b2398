"""The decode side's registry of expected transfers, whatever backend brings the bytes.

Admission calls `expect` with the payload size, a deadline and two callbacks. Exactly one
of them runs, once, on the event loop: `on_complete(transfer_id, payload, first_token,
extra)` when every byte arrived intact (payload: a writable memoryview, or a uint8 device
tensor from a device-direct backend, that the callee now owns, e.g. for `unpack_blocks`), or `on_fail(transfer_id, reason)` on a rejection, a broken stream
or the deadline (the reaper) -- that is where the decode engine frees the blocks it
reserved. `cancel` (the decode side gave up, e.g. abort) ends a transfer with no callback.
Everything is bounded: staged bytes, remembered ids, and time. Callbacks must be quick
(hand work to the engine thread) and should not raise.

Writing in place: admission may name the blocks it reserved (`pages`, with `on_release`). A
backend that writes straight into them (nixl) takes them with `write_in_place` instead of
staging, and completes with an `InPlace` payload (nothing to copy). Should such a transfer end
any other way (failed, cancelled), a write the sender posted may still land, so its blocks are
*held*: `held(transfer_id)` is true (from before on_fail runs), the callee must keep them out
of its pool, and `on_release(transfer_id)` runs once, when the sender can no longer write --
after the backend's quarantine time, or sooner on the backend's word (`release`).

Every method runs on the event loop thread.
"""
from __future__ import annotations

import asyncio
import logging
import mmap
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from baton.engine.kv_handoff import InPlace

log = logging.getLogger("baton.kvtransfer")

DEFAULT_MAX_STAGED_BYTES = 4 << 30
REMEMBERED_ENDED = 4096          # ids of ended transfers kept, to answer late chunks precisely
MMAP_MIN_BYTES = 1 << 20

OnComplete = Callable[[str, memoryview, int, dict[str, str]], None]
OnFail = Callable[[str, str], None]


class TransferRejected(Exception):
    """A transfer (or one message of it) was refused; `code` is the status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class Transfer:
    """One expected transfer. Backends read it and fill `buffer`; the registry owns the rest."""

    transfer_id: str
    nbytes: int
    deadline: float                      # event-loop time
    on_complete: OnComplete
    on_fail: OnFail
    on_claim: Callable[[str], None] | None = None
    timer: asyncio.TimerHandle | None = None
    buffer: object | None = None         # staging (memoryview, or a device tensor), from `stage`
    claimed: bool = False                # a sender is pushing it
    pages: tuple[int, ...] = ()          # the decode worker's reserved blocks (write_in_place)
    on_release: Callable[[str], None] | None = None
    quarantine_s: float = 0.0            # > 0 once a backend handed `pages` to a sender


@dataclass(frozen=True, slots=True)
class RegistryStats:
    active: int                          # expected and not ended
    staged_bytes: int                    # staging buffers allocated for active transfers
    completed: int
    failed: int
    cancelled: int
    in_place: int = 0                    # completed straight in the decode worker's blocks (no staging)
    held: int = 0                        # ended transfers whose blocks wait out their quarantine


class PendingTransfers:
    def __init__(self, max_staged_bytes: int = DEFAULT_MAX_STAGED_BYTES):
        if max_staged_bytes < 1:
            raise ValueError(f"max_staged_bytes must be positive, got {max_staged_bytes}")
        self.max_staged_bytes = max_staged_bytes
        self._active: dict[str, Transfer] = {}
        self._ended: OrderedDict[str, tuple[grpc.StatusCode, str]] = OrderedDict()   # id -> what late messages get
        self._staging_freed: asyncio.Event | None = None    # set (and replaced) when room frees
        self._staging_queue: deque[Transfer] = deque()      # transfers waiting for staging room, in order
        self._held: dict[str, tuple[asyncio.TimerHandle, Callable[[str], None]]] = {}   # id -> release
        self.staged_bytes = 0
        self.completed = 0
        self.failed = 0
        self.cancelled = 0
        self.in_place = 0

    def __len__(self) -> int:
        return len(self._active)

    def __contains__(self, transfer_id: str) -> bool:
        return transfer_id in self._active

    def stats(self) -> RegistryStats:
        return RegistryStats(len(self._active), self.staged_bytes, self.completed, self.failed, self.cancelled,
                             self.in_place, len(self._held))

    # -- the decode engine's side -------------------------------------------------------------
    def expect(self, transfer_id: str, nbytes: int, deadline_s: float, on_complete: OnComplete,
               on_fail: OnFail, on_claim: Callable[[str], None] | None = None,
               pages: tuple[int, ...] | list[int] = (), on_release: Callable[[str], None] | None = None) -> None:
        """Register a transfer of `nbytes`; unless it completes within `deadline_s`, on_fail runs.
        `on_claim(transfer_id)`: a sender started pushing it (the bytes are on their way).
        `pages`: the blocks reserved for it, which a backend may write straight into; then
        `on_release(transfer_id)` frees them after a hold (see the module's docstring)."""
        if pages and on_release is None:
            raise ValueError("pages need an on_release callback (blocks held after a failure are freed there)")
        if not transfer_id:
            raise ValueError("transfer_id must not be empty")
        if transfer_id in self._active or transfer_id in self._ended:
            raise ValueError(f"transfer id {transfer_id!r} was already used")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if deadline_s <= 0:
            raise ValueError(f"deadline_s must be positive, got {deadline_s}")
        loop = asyncio.get_running_loop()
        t = Transfer(transfer_id, nbytes, loop.time() + deadline_s, on_complete, on_fail, on_claim,
                     pages=tuple(pages), on_release=on_release)
        t.timer = loop.call_later(deadline_s, self._reap, transfer_id, deadline_s)
        self._active[transfer_id] = t

    def cancel(self, transfer_id: str) -> bool:
        """End a transfer without calling back (the caller frees its blocks). False: not active."""
        t = self._end(transfer_id, (grpc.StatusCode.CANCELLED,
                                    f"transfer {transfer_id} was cancelled by the decode worker"))
        if t is None:
            return False
        self.cancelled += 1
        return True

    def fail(self, transfer_id: str, reason: str, code: grpc.StatusCode = grpc.StatusCode.ABORTED) -> bool:
        """End a transfer and call its on_fail(transfer_id, reason). False: it had already ended."""
        late = grpc.StatusCode.DEADLINE_EXCEEDED if code is grpc.StatusCode.DEADLINE_EXCEEDED \
            else grpc.StatusCode.FAILED_PRECONDITION
        t = self._end(transfer_id, (late, f"transfer {transfer_id} already failed: {reason}"))
        if t is None:
            return False
        self.failed += 1
        try:
            t.on_fail(transfer_id, reason)
        except Exception:
            log.exception("on_fail of KV transfer %s raised", transfer_id)
        return True

    def held(self, transfer_id: str) -> bool:
        """Are the blocks of this ended transfer held (a late write may still land in them)?"""
        return transfer_id in self._held

    def release(self, transfer_id: str) -> bool:
        """End a hold now (the backend knows no write can land any more): on_release runs once."""
        held = self._held.pop(transfer_id, None)
        if held is None:
            return False
        timer, on_release = held
        timer.cancel()
        try:
            on_release(transfer_id)
        except Exception:
            log.exception("on_release of KV transfer %s raised", transfer_id)
        return True

    # -- the backends' side --------------------------------------------------------------------
    def lookup(self, transfer_id: str) -> Transfer:
        """The active transfer, or TransferRejected saying why there is none."""
        t = self._active.get(transfer_id)
        if t is not None:
            return t
        ended = self._ended.get(transfer_id)
        if ended is not None:
            raise TransferRejected(*ended)
        raise TransferRejected(grpc.StatusCode.NOT_FOUND, f"unknown KV transfer id {transfer_id!r}: the "
                               "decode worker never admitted it here (or has restarted)")

    def check_active(self, t: Transfer) -> None:
        """Raise the right TransferRejected if `t` ended (reaped, cancelled) since it was looked up."""
        if self._active.get(t.transfer_id) is not t:
            self.lookup(t.transfer_id)
            raise TransferRejected(grpc.StatusCode.FAILED_PRECONDITION, f"transfer {t.transfer_id} has ended")

    def time_left(self, t: Transfer) -> float:
        return t.deadline - asyncio.get_running_loop().time()

    def claim(self, t: Transfer, nbytes: int) -> None:
        """A sender starts pushing `t`: one sender per transfer, and the size it announces must match."""
        self.check_active(t)
        if t.claimed:
            raise TransferRejected(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"transfer {t.transfer_id} is already being pushed on another stream")
        if nbytes != t.nbytes:
            msg = f"payload size {nbytes} does not match the {t.nbytes} bytes reserved for transfer {t.transfer_id}"
            self.fail(t.transfer_id, msg)
            raise TransferRejected(grpc.StatusCode.INVALID_ARGUMENT, msg)
        t.claimed = True
        if t.on_claim is not None:
            t.on_claim(t.transfer_id)

    async def stage(self, t: Transfer, allocate: Callable[[int], object] | None = None) -> None:
        """Allocate t.buffer (host memory by default; `allocate(nbytes)` for e.g. a device tensor),
        first waiting (until t's deadline) for room under max_staged_bytes. A payload over the limit
        by itself (a long prompt's KV) waits until nothing else is staged, then stages alone; where
        even that does not fit, `allocate` fails and the backend refuses the transfer. Waiters stage
        in arrival order: a payload that would fit does not pass one already waiting, so a steady
        stream of small transfers cannot starve a long prompt's."""
        if self._must_wait(t):
            self._staging_queue.append(t)
            try:
                while self._must_wait(t):
                    if self._staging_freed is None:
                        self._staging_freed = asyncio.Event()
                    try:
                        await asyncio.wait_for(self._staging_freed.wait(), max(0.0, self.time_left(t)))
                    except TimeoutError:
                        self.fail(t.transfer_id, f"no room to stage the {t.nbytes}-byte KV of transfer "
                                  f"{t.transfer_id} before its deadline ({self.staged_bytes} of "
                                  f"{self.max_staged_bytes} bytes staged, {len(self._staging_queue) - 1} other "
                                  "transfer(s) waiting)", grpc.StatusCode.DEADLINE_EXCEEDED)
                    self.check_active(t)
            finally:
                self._staging_queue.remove(t)
                self._notify_staging()               # the next in line looks again
        t.buffer = (allocate or staging_buffer)(t.nbytes)
        self.staged_bytes += t.nbytes

    def _must_wait(self, t: Transfer) -> bool:
        """Someone waits ahead of t, or t does not fit beside what is staged (alone it always may)."""
        if self._staging_queue and self._staging_queue[0] is not t:
            return True
        return bool(self.staged_bytes) and self.staged_bytes + t.nbytes > self.max_staged_bytes

    def write_in_place(self, t: Transfer, quarantine_s: float) -> tuple[int, ...]:
        """A backend hands t's reserved blocks to its sender, to write straight into (no
        staging); returns them. Should t end without completing, they are held for up to
        `quarantine_s` (how long a write the sender posted may still land), or until `release`."""
        self.check_active(t)
        if not t.pages or quarantine_s <= 0:
            raise ValueError(f"transfer {t.transfer_id} cannot be written in place (pages {len(t.pages)}, "
                             f"quarantine {quarantine_s}s)")
        t.quarantine_s = quarantine_s
        return t.pages

    def complete(self, t: Transfer, first_token: int, extra: dict[str, str], payload: object = None) -> None:
        """Every byte is in `t.buffer`: hand it (or `payload`, a view of it in parts) and its
        ownership to on_complete. Written in place: on_complete gets an InPlace payload."""
        self.check_active(t)
        self._end(t.transfer_id, (grpc.StatusCode.FAILED_PRECONDITION, f"transfer {t.transfer_id} already completed"),
                  completed=True)
        self.completed += 1
        if t.quarantine_s:
            self.in_place += 1
            payload = InPlace(t.pages, t.nbytes)
        if payload is None:
            payload = t.buffer if t.buffer is not None else memoryview(bytearray())
        try:
            t.on_complete(t.transfer_id, payload, first_token, extra)
        except Exception as exc:
            log.exception("on_complete of KV transfer %s raised", t.transfer_id)
            raise TransferRejected(grpc.StatusCode.INTERNAL,
                                   f"the decode worker could not take the KV of {t.transfer_id}: {exc}") from exc

    # -- internals ------------------------------------------------------------------------------
    def _reap(self, transfer_id: str, deadline_s: float) -> None:
        self.fail(transfer_id, f"the KV of transfer {transfer_id} did not arrive within its {deadline_s:g}s "
                  "deadline", grpc.StatusCode.DEADLINE_EXCEEDED)

    def _end(self, transfer_id: str, later: tuple[grpc.StatusCode, str], completed: bool = False) -> Transfer | None:
        t = self._active.pop(transfer_id, None)
        if t is None:
            return None
        if t.timer is not None:
            t.timer.cancel()
        if t.quarantine_s and not completed:       # its sender may still write into its blocks: hold them
            timer = asyncio.get_running_loop().call_later(t.quarantine_s, self.release, transfer_id)
            self._held[transfer_id] = (timer, t.on_release)
        if t.buffer is not None:
            self.staged_bytes -= t.nbytes
        self._notify_staging()
        self._ended[transfer_id] = later
        while len(self._ended) > REMEMBERED_ENDED:
            self._ended.popitem(last=False)
        return t

    def _notify_staging(self) -> None:
        """Wake every claim waiting for staging room; each checks again."""
        if self._staging_freed is not None:
            self._staging_freed.set()
            self._staging_freed = None


def staging_buffer(nbytes: int) -> memoryview:
    """A writable byte buffer. Large ones are anonymous mappings: the kernel's zero pages cost
    nothing until written, where bytearray(n) would first write n zeros."""
    if nbytes < MMAP_MIN_BYTES:
        return memoryview(bytearray(nbytes))
    return memoryview(mmap.mmap(-1, nbytes))
