"""Runs an LLMEngine on its own thread for an asyncio server.

The model never runs on the event loop. The services call the engine through the named
methods here (`add`, `reserve`, `abort`, `stats`); each runs as a command between steps, so
engine state is only ever touched by the engine thread. A request opened with `open_stream`
gets its outputs on its asyncio.Queue; every other output of a step goes, as one list, to
`on_step` on the engine thread (a worker's engine core batches them to its front that way).
"""
from __future__ import annotations

import asyncio
import queue
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from baton.engine.kv_handoff import KVTicket
from baton.engine.llm_engine import EngineStats, LLMEngine
from baton.engine.output_processor import RequestOutput
from baton.engine.requests.sampling_params import SamplingParams
from baton.models.multimodal import ImageInput

IDLE_WAIT_S = 0.05


class EngineDead(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop):
        self.engine = engine
        self.loop = loop
        self._commands: queue.Queue[tuple[Callable[[LLMEngine], Any], asyncio.Future | None]] = queue.Queue()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._stop = threading.Event()
        self.error: BaseException | None = None
        # engine thread: after each step, with the outputs no stream of this loop took; and after
        # each idle wait (nothing to step for), so a caller can tell a live engine from a hung one
        self.on_step: Callable[[LLMEngine, list[RequestOutput]], None] | None = None
        self.on_idle: Callable[[LLMEngine], None] | None = None
        self._thread = threading.Thread(target=self._run, name="baton-engine", daemon=True)
        self._thread.start()

    # -- the services' calls (event loop) ------------------------------------------------------
    async def add(self, request_id: str, prompt: list[int], params: SamplingParams,
                  hand_off_kv: bool = False, images: Sequence[ImageInput] = (),
                  skip_blocks: int = 0) -> tuple[asyncio.Queue, KVTicket | None]:
        """Queue a request; its outputs arrive on the returned queue (close_stream when done).
        With `hand_off_kv`, also its KV ticket (its prompt's KV goes to the engine's handoff, but
        for the first `skip_blocks` blocks). `images`: a vision-language prompt's images, its
        placeholders already expanded."""
        queue = self.open_stream(request_id)

        def add(engine: LLMEngine) -> KVTicket | None:
            engine.add_request(prompt, params, request_id=request_id, hand_off_kv=hand_off_kv, images=images,
                               skip_blocks=skip_blocks)
            return engine.kv_ticket(request_id)
        try:
            ticket = await self.call(add)
        except BaseException:
            self.close_stream(request_id)
            raise
        return queue, ticket

    async def reserve(self, request_id: str, prompt: list[int], params: SamplingParams) -> tuple[KVTicket, asyncio.Queue]:
        """Decode side: reserve the request's blocks (KVCacheFull if they are not free); its
        outputs, from the join on, arrive on the queue."""
        queue = self.open_stream(request_id)
        try:
            ticket = await self.call(lambda e: e.reserve(request_id, prompt, params))
        except BaseException:
            self.close_stream(request_id)
            self.abort(request_id)           # in case the reservation ran after this call gave up
            raise
        return ticket, queue

    def abort(self, request_id: str, hold_as: str | None = None) -> None:
        """End the request wherever it is; its blocks are freed once (a no-op if it is over), or,
        with `hold_as`, held until `release_held(hold_as)` (LLMEngine.abort)."""
        self.submit(lambda e: e.abort(request_id, hold_as))

    def release_held(self, key: str) -> None:
        """Free the blocks an abort held under `key` (once)."""
        self.submit(lambda e: e.release_held(key))

    def wake(self) -> None:
        """Something arrived for the engine (landed KV): step now, not after the idle wait."""
        self._commands.put((_noop, None))

    def stats(self) -> EngineStats:
        return self.engine.stats()

    # -- commands ---------------------------------------------------------------------------
    async def call(self, fn: Callable[[LLMEngine], Any], timeout: float = 30.0) -> Any:
        """Run fn(engine) on the engine thread between steps and return its result."""
        if self.error is not None:
            raise EngineDead(f"engine thread failed: {self.error!r}")
        fut = self.loop.create_future()
        self._commands.put((fn, fut))
        return await self._result(fut, timeout)

    async def _result(self, fut: asyncio.Future, timeout: float) -> Any:
        """fut's result within `timeout`, not counting the time the engine thread spends in a step
        within its budget (a command waits for the step to end: a long prompt is not a fault)."""
        end = self.loop.time() + timeout
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(fut), max(0.0, end - self.loop.time()))
            except TimeoutError:
                pulse = self.engine.clock.pulse()
                if pulse.busy != "step" or pulse.overrun_s > 0:
                    fut.cancel()
                    raise
                end = self.loop.time() + max(1.0, pulse.budget_s - pulse.busy_s)

    def submit(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Fire-and-forget variant of `call` (usable from any thread)."""
        self._commands.put((fn, None))

    def open_stream(self, request_id: str) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = q
        return q

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def deliver(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Hand each output to its stream (engine thread -> event loop); returns those of
        requests with no stream here."""
        rest = []
        for out in outputs:
            q = self._streams.get(out.request_id)
            if q is not None:
                self.loop.call_soon_threadsafe(q.put_nowait, out)
            else:
                rest.append(out)
        return rest

    def shutdown(self, wait_s: float = 10.0) -> bool:
        """Stop the engine thread after its step; True once it has ended (within wait_s)."""
        self._stop.set()
        self._commands.put((lambda e: None, None))
        self._thread.join(timeout=wait_s)
        return not self._thread.is_alive()

    # -- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine.runner.platform.bind_thread()      # cuda:1 etc.: launch on the right device
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_work)
                if self.engine.has_work:
                    rest = self.deliver(self.engine.step())
                    if self.on_step is not None:
                        self.on_step(self.engine, rest)
                elif self.on_idle is not None:
                    self.on_idle(self.engine)
        except BaseException as exc:         # a dead engine must fail every waiter, not hang them
            self.error = exc
            traceback.print_exc()
            for q in list(self._streams.values()):
                self.loop.call_soon_threadsafe(q.put_nowait, EngineDead(repr(exc)))

    def _drain(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._execute(*item)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _execute(self, fn, fut: asyncio.Future | None) -> None:
        clock = self.engine.clock
        clock.begin_command()
        try:
            result = fn(self.engine)
        except BaseException as exc:
            if fut is not None:
                self.loop.call_soon_threadsafe(_set_exception, fut, exc)
            else:
                traceback.print_exc()
            return
        finally:
            clock.end()
        if fut is not None:
            self.loop.call_soon_threadsafe(_set_result, fut, result)


def _noop(engine: LLMEngine) -> None:
    return None


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
