"""The front's handle on its engine core (serving/worker/engine_core.py): start it, call its
commands, hear its per-step updates, and notice when it dies or hangs.

`ProcessCore` runs the core as a child process over two socket pairs (the default);
`LocalCore` runs it on this process's event loop (the in-memory KV backend, tools, tests).
Both hand the front the same messages, so the front has one code path.

The core pulses every 0.5 s from a thread of its own, saying what its engine thread is doing
and how long that may take (engine/step_clock.py): busy is not hung. A core that exits, goes
silent (a stopped process), or stays in one step `hang_timeout` seconds past that step's budget
(a deadlocked collective, an endless loop) is dead: every call in flight fails UNAVAILABLE and
`on_death` tells the front, which ends the worker (the supervisor and the router know what to
do about a dead worker). Torch-free.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable

import grpc

from baton.engine import step_clock
from baton.serving.grpc_server import ServiceError
from baton.serving.worker.core_protocol import (
    PROTOCOL_VERSION,
    Beat,
    Call,
    Command,
    CoreMessage,
    CoreStats,
    Fatal,
    FrameWriter,
    Hello,
    Init,
    MetricEvent,
    Pulse,
    Reply,
    TokenUpdate,
    Updates,
    decode_error,
    open_reader,
    read_frame,
)
from baton.serving.worker.worker_config import WorkerConfig

WATCH_EVERY_S = 1.0
SILENT_S = 1.0                     # a core quiet this long is reported stalled (it pulses every 0.5 s)
STOP_TIMEOUT_S = 15.0


class CoreDied(ServiceError):
    def __init__(self, reason: str):
        super().__init__(grpc.StatusCode.UNAVAILABLE, f"the worker's engine core {reason}")


class CoreClient:
    """What both kinds share: calls, the messages' dispatch, the watchdog."""

    def __init__(self, cfg: WorkerConfig, target: str, on_updates: Callable[[list[TokenUpdate]], None],
                 on_metrics: Callable[[list[MetricEvent]], None], on_death: Callable[[str], None]):
        self.cfg, self.target = cfg, target
        self.on_updates, self.on_metrics, self.on_death = on_updates, on_metrics, on_death
        self.stats = CoreStats()
        self.info: dict = {}
        self.dead: str | None = None
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._hello: asyncio.Future | None = None
        self._heard = 0.0
        self.pulse: step_clock.Pulse | None = None    # the last pulse, heard at _pulse_at (None: this core does not pulse)
        self._pulse_at = 0.0
        self._watch: asyncio.Task | None = None

    async def start(self) -> dict:
        """Until the core serves (its model loaded); ValueError with its one-line reason if it
        could not start."""
        loop = asyncio.get_running_loop()
        self._hello = loop.create_future()
        await self._launch()
        self.info = await self._hello
        self._heard = loop.time()
        self._watch = asyncio.ensure_future(self._watchdog())
        return self.info

    async def call(self, command: Command, *args, timeout: float | None = None):
        """Run a command of the core and return its result (or raise its error)."""
        if self.dead is not None:
            raise CoreDied(self.dead)
        return await asyncio.wait_for(self._call(command, args), timeout)

    def silent_seconds(self) -> float:
        """Since the core last sent anything (a pulse, a step's updates, an idle beat)."""
        return asyncio.get_running_loop().time() - self._heard if self.info else 0.0

    def busy(self) -> step_clock.Pulse:
        """What the engine thread is doing as of now (the last pulse, aged since it was heard)."""
        if self.pulse is None or not self.pulse.busy:
            return self.pulse or step_clock.Pulse()
        age = asyncio.get_running_loop().time() - self._pulse_at
        p = self.pulse
        return step_clock.Pulse(p.busy, p.busy_s + age, p.budget_s, p.tokens, p.seconds_per_token)

    def stalled_seconds(self) -> float:
        """How long the core has gone without the progress it should make: silent (a stopped
        process) past SILENT_S, or in one step or command past its budget; 0 while it works as it should."""
        silent = self.silent_seconds()
        if silent > SILENT_S:
            return silent
        return self.busy().overrun_s

    def cast(self, command: Command, *args) -> None:
        """A command whose result nobody waits for (abort)."""
        if self.dead is None:
            self._send(0, command, args)

    # -- the core's messages -------------------------------------------------------------------
    def _message(self, msg: CoreMessage) -> None:
        self._heard = asyncio.get_running_loop().time()
        match msg:
            case Pulse():
                self.pulse, self._pulse_at = msg.activity, self._heard
            case Updates():
                self.stats = msg.stats
                self.on_metrics(msg.metrics)
                self.on_updates(msg.updates)
            case Beat():
                self.stats = msg.stats
                self.on_metrics(msg.metrics)
            case Reply():
                self._replied(msg)
            case Hello():
                self.info, self.stats = msg.info, msg.info["stats"]
                _resolve(self._hello, self.info)
            case Fatal():
                self._fatal(msg.message)

    def _replied(self, reply: Reply) -> None:
        fut = self._calls.pop(reply.call_id, None)
        if reply.error is not None:
            _fail(fut, decode_error(reply.error))
        else:
            _resolve(fut, reply.value)

    def _fatal(self, message: str) -> None:
        if self.info:                       # serving already: its engine thread died
            self._died(message)
        else:                               # it could not start (or speaks another protocol version)
            _fail(self._hello, ValueError(message))

    def _died(self, reason: str) -> None:
        if self.dead is not None:
            return
        self.dead = reason
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(CoreDied(reason))
        self._calls.clear()
        if not self.info:                   # still starting: start() raises instead
            _fail(self._hello, ValueError(f"the engine core {reason} before it served"))
            return
        self.on_death(reason)

    async def _watchdog(self) -> None:
        limit = self.cfg.engine_hang_timeout
        while self.dead is None:
            await asyncio.sleep(WATCH_EVERY_S)
            if limit and self.stalled_seconds() > limit:
                self._died(self.hang_reason(limit))
                await self._kill()

    def hang_reason(self, limit: float) -> str:
        silent, busy = self.silent_seconds(), self.busy()
        if silent > SILENT_S:
            return f"sent nothing for {silent:.0f}s (limit --engine-hang-timeout {limit:g}s): hung"
        return (f"has been in one {busy.busy} for {busy.busy_s:.0f}s, {busy.overrun_s:.0f}s past its budget of "
                f"{busy.budget_s:.0f}s (limit --engine-hang-timeout {limit:g}s past it): hung")

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        self.dead = self.dead or "stopped"

    # -- transport, per kind ---------------------------------------------------------------------
    async def _launch(self) -> None:
        raise NotImplementedError

    async def _call(self, command: Command, args: tuple):
        raise NotImplementedError

    def _send(self, call_id: int, command: Command, args: tuple) -> None:
        raise NotImplementedError

    async def _kill(self) -> None:
        return None


class ProcessCore(CoreClient):
    """The core in a child process: `python -m baton.serving.worker.engine_core --fds C,E`."""

    proc: subprocess.Popen | None = None

    async def _launch(self) -> None:
        front_cmd, core_cmd = socket.socketpair()
        front_evt, core_evt = socket.socketpair()
        fds = (core_cmd.fileno(), core_evt.fileno())
        self.proc = subprocess.Popen([sys.executable, "-m", "baton.serving.worker.engine_core", "--fds",
                                      ",".join(map(str, fds))], pass_fds=fds)
        core_cmd.close()
        core_evt.close()
        self._writer = FrameWriter(front_cmd)
        self._writer.send(Init(PROTOCOL_VERSION, self.target, self.cfg))
        self._reader = asyncio.ensure_future(self._read(await open_reader(front_evt)))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                self._message(await read_frame(reader))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        code = await asyncio.get_running_loop().run_in_executor(None, self._wait_exit)
        self._died(f"exited (code {code})" if code is not None else "closed its socket")

    def _wait_exit(self, timeout: float = 5.0) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    async def _call(self, command: Command, args: tuple):
        call_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            self._send(call_id, command, args)
            return await fut
        finally:
            self._calls.pop(call_id, None)

    def _send(self, call_id: int, command: Command, args: tuple) -> None:
        try:
            self._writer.send(Call(call_id, command, args))
        except OSError as exc:
            self._died(f"is unreachable ({exc})")
            raise CoreDied(self.dead) from None

    async def stop(self) -> None:
        """Close the command socket (the core stops its engine and exits); kill it if it doesn't."""
        await super().stop()
        if self.proc is None:
            return
        self._writer.close()
        loop = asyncio.get_running_loop()
        if await loop.run_in_executor(None, self._wait_exit, STOP_TIMEOUT_S) is None:
            await self._kill()

    async def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            await asyncio.get_running_loop().run_in_executor(None, self._wait_exit)


class LocalCore(CoreClient):
    """The core on this event loop (its engine on a thread of this process)."""

    core = None

    async def _launch(self) -> None:
        from baton.serving.worker.engine_core import load_core  # the engine (torch) only in this mode
        loop = asyncio.get_running_loop()
        self.core = load_core(self.target)(self.cfg, lambda msg: loop.call_soon_threadsafe(self._message, msg))
        try:
            info = await self.core.start()
        except ValueError:
            raise
        except Exception as exc:            # a bug, not a setting: its traceback, then one line
            traceback.print_exc()
            raise ValueError(f"{type(exc).__name__}: {exc}") from exc
        self._message(Hello(info))

    async def _call(self, command: Command, args: tuple):
        return await self.core.handle(command, args)

    def _send(self, call_id: int, command: Command, args: tuple) -> None:
        task = asyncio.ensure_future(self.core.handle(command, args))
        task.add_done_callback(_retrieve)

    async def stop(self) -> None:
        await super().stop()
        if self.core is not None:
            await self.core.stop()


def start_core(cfg: WorkerConfig, target: str, **callbacks) -> CoreClient:
    """The core the config asks for: its own process unless --no-engine-process."""
    return (ProcessCore if cfg.engine_process else LocalCore)(cfg, target, **callbacks)


def _resolve(fut: asyncio.Future | None, value) -> None:
    if fut is not None and not fut.done():
        fut.set_result(value)


def _fail(fut: asyncio.Future | None, exc: BaseException) -> None:
    if fut is not None and not fut.done():
        fut.set_exception(exc)


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        with contextlib.suppress(Exception):
            task.exception()
