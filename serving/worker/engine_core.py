"""A worker's engine core: the step loop and everything that touches the device and the KV
cache (the KV-transfer plane too), apart from the worker's front (serving/worker/worker.py), which
serves its RPCs, makes the text and streams the tokens.

The core runs in a process of its own (`python -m baton.serving.worker.engine_core`, started by
the front through serving/worker/core_client.py), so the step loop never waits for the front's
event loop and its gRPC writes: they don't share an interpreter. After every step it sends
the front ONE message with every request's new tokens (serving/worker/core_protocol.py). For
in-process tools and tests (the in-memory KV backend) the same core runs on the front's event
loop instead; nothing else differs.

`EngineCore` is what every role shares; prefill_service/core.py and decode_service/core.py
add their commands (`cmd_<name>` coroutines, each named by a core_protocol.Command member) and
their half of the KV plane.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import importlib
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import ClassVar

import grpc

from baton.engine.async_engine import AsyncEngine
from baton.engine.kv_handoff import KVHandoff
from baton.engine.llm_engine import LLMEngine, freeze_startup_objects
from baton.engine.output_processor import RequestOutput
from baton.kvtransfer import registry
from baton.kvtransfer.layout import KVLayout
from baton.serving.grpc_server import ServiceError, signal_on_parent_death
from baton.serving.logs import setup_logging
from baton.serving.worker.core_protocol import (
    Beat,
    Call,
    Command,
    CoreMessage,
    CoreStats,
    Fatal,
    FrameWriter,
    Hello,
    Pulse,
    Reply,
    TokenUpdate,
    Updates,
    check_init,
    encode_error,
    open_reader,
    read_frame,
)
from baton.serving.worker.worker_config import WorkerConfig

BEAT_INTERVAL_S = 0.5              # an idle core still says it is alive this often
PULSE_INTERVAL_S = 0.5             # and, busy or not, says what its engine thread is doing
STOP_TIMEOUT_S = 10.0
STEP_WAIT_S = 2.0                  # stopping: how long the step in progress may take to finish (a GPU's: well under)

Emit = Callable[[CoreMessage], None]


class MetricEvents:
    """Observations made in the core (step time, KV bytes, ...), recorded by the front's
    Prometheus registry: (metric attribute of serving.metrics.Metrics, labels, value).
    Appended from any thread; taken with the next message."""

    def __init__(self):
        self._events: collections.deque = collections.deque()

    def add(self, metric: str, value: float, *labels: str) -> None:
        self._events.append((metric, labels, value))

    def take(self) -> list[tuple[str, tuple[str, ...], float]]:
        taken = []
        while self._events:
            taken.append(self._events.popleft())
        return taken


class EngineCore:
    """What every role's core shares. A role's commands are its `cmd_<name>` coroutines, one per
    core_protocol.Command member it serves; COMMANDS, built from the enum as the class is
    defined, is what a Call runs through."""

    COMMANDS: ClassVar[dict[Command, Callable[..., Awaitable]]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.COMMANDS = command_table(cls)

    def __init__(self, cfg: WorkerConfig, emit: Emit):
        self.cfg = cfg
        self.emit = emit
        self.engine: AsyncEngine | None = None
        self.handoff: KVHandoff | None = None      # the role's side of the engine's KV seam
        self.metrics = MetricEvents()
        self._last_emit = 0.0
        self._sent_stats: CoreStats | None = None
        self._pulsing = threading.Event()
        self._prefill_tokens = 0                   # the engine's count, as last reported
        self._offload_seen = (0, 0)                # its host tier's blocks out and in, as last reported

    @property
    def llm(self) -> LLMEngine:
        return self.engine.engine

    async def start(self) -> dict:
        """Load the model, start the step loop and the KV plane; returns the hello info."""
        if self.cfg.gil_switch_ms:
            sys.setswitchinterval(self.cfg.gil_switch_ms / 1e3)
        print(f"[baton] {self.cfg.role}: loading {self.cfg.engine.model} on {self.cfg.engine.device}",
              file=sys.stderr, flush=True)
        loop = asyncio.get_running_loop()
        # tokens only: the front makes the text (and applies stop strings)
        llm = await loop.run_in_executor(None, lambda: LLMEngine(self.cfg.engine, handoff=self.handoff,
                                                                 tokens_only=True))
        freeze_startup_objects()
        self.engine = AsyncEngine(llm, loop)
        self.engine.on_step = self._stepped
        self.engine.on_idle = self._idle
        self._pulsing.set()
        threading.Thread(target=self._pulse, name="baton-pulse", daemon=True).start()
        if self.cfg.fault_hooks:
            hold_steps_on_signal(llm)
        await self.start_transport()
        return self.hello()

    def _pulse(self) -> None:
        """Its own thread: the engine thread's activity every PULSE_INTERVAL_S, whatever that thread
        is doing, so the front tells a long step from a hung one (and a stopped process by silence)."""
        clock = self.llm.clock
        while self._pulsing.is_set():
            try:
                if self.engine.error is not None:      # the step loop died (a device OOM, a bug): so does the core
                    self.emit(Fatal(f"failed: its engine thread raised {self.engine.error!r}"))
                    return
                self.emit(Pulse(clock.pulse()))
            except OSError:              # the front is gone: the core is ending anyway
                return
            time.sleep(PULSE_INTERVAL_S)

    async def start_transport(self) -> None:
        """The role's KV plane (decode: the receivers' server; prefill: nothing until a push)."""

    def hello(self) -> dict:
        llm, src = self.llm, self.llm.source
        return {"model": src.name, "architecture": src.architecture, "vocab_size": llm.vocab_size,
                "max_model_len": llm.max_model_len, "block_size": llm.config.block_size,
                "eos_token_ids": list(llm.eos_token_ids), "tokenizer_dir": src.tokenizer_dir(),
                "kv_backends": self.kv_backends(), "device": self.cfg.engine.device, "stats": self.stats()}

    def kv_backends(self) -> list[str]:
        return registry.spoken(self.cfg.kv_backend)

    def kv_layout(self) -> KVLayout:
        """This worker's KV layout, for the transfer handshake (both ends must agree)."""
        spec = self.llm.kv_spec
        return KVLayout(model=self.llm.source.name, architecture=self.llm.source.architecture, dtype=spec.dtype,
                        block_size=spec.block_size, num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
                        head_dim=spec.head_dim, tp_size=1, tp_rank=0, backends=self.kv_backends(),
                        kv_scales=spec.kv_scales)

    async def handle(self, command: Command, args: tuple):
        """Run a command through the role's table (COMMANDS); ValueError for one it lacks."""
        fn = self.COMMANDS.get(command) if isinstance(command, Command) else None
        if fn is None:
            raise ValueError(self._no_command(command))
        return await fn(self, *args)

    def _no_command(self, command: object) -> str:
        if isinstance(command, Command):
            return f"the {self.cfg.role} engine core has no command {command.value!r}"
        known = ", ".join(c.name for c in Command)
        return f"{command!r} is no engine-core command (core_protocol.Command: {known})"

    async def cmd_kv_events(self) -> tuple[list[tuple[bool, int]], bool]:
        """The prefix cache's changes since the last call, and whether they are a snapshot
        (BlockManager.take_kv_events): what the front numbers for routers (GetKVEvents)."""
        return await self.engine.call(lambda e: e.block_manager.take_kv_events())

    async def stop(self) -> None:
        """Release the KV plane (device communicators), then stop the engine."""
        self._pulsing.clear()
        await self.stop_transport()
        if self.engine is not None and not self.engine.shutdown(STEP_WAIT_S):
            # the front stops us after its drain: whatever this step computes, nobody waits for it (a long
            # prompt's chunk the router gave up on, on a CPU: seconds); the process exits without it
            print(f"[baton] engine core: a step still running after {STEP_WAIT_S:.0f}s; stopping without it",
                  file=sys.stderr, flush=True)

    async def stop_transport(self) -> None:
        return None

    # -- what the front hears ------------------------------------------------------------------
    def num_pending(self) -> int:
        """Requests admitted whose KV has not landed yet (decode)."""
        return 0

    def stats(self) -> CoreStats:
        s = self.engine.stats()
        return CoreStats(s.running, s.waiting + self.num_pending(), s.kv_blocks_total, s.kv_blocks_free,
                         s.spec_draft_tokens, s.spec_accepted_tokens, s.spec_verified, s.spec_accepted_lengths)

    def update_of(self, out: RequestOutput) -> TokenUpdate:
        return TokenUpdate.of(out, encode_error(self.failure(out)) if out.error else None)

    def failure(self, out: RequestOutput) -> Exception:
        """What a request the engine ended with an error (out.error) ends with for its client."""
        return ServiceError(grpc.StatusCode.UNAVAILABLE, f"request {out.request_id} failed: {out.error}")

    def send_updates(self, updates: list[TokenUpdate]) -> None:
        self._sent_stats = self.stats()
        self.emit(Updates(updates, self._sent_stats, self.metrics.take()))
        self._last_emit = time.monotonic()

    def _stepped(self, llm: LLMEngine, outputs: list[RequestOutput]) -> None:
        """Engine thread, after each step: one message with every request's new tokens."""
        self.metrics.add("step_seconds", llm.last_step_seconds, "step")
        computed = llm.scheduler.prefill_tokens
        if computed != self._prefill_tokens:
            self.metrics.add("prefill_tokens", computed - self._prefill_tokens)
            self._prefill_tokens = computed
        tier = llm.runner.host_tier
        if tier is not None and (tier.offloaded, tier.loaded) != self._offload_seen:
            self.metrics.add("kv_offload_blocks", tier.offloaded - self._offload_seen[0], "out")
            self.metrics.add("kv_offload_blocks", tier.loaded - self._offload_seen[1], "in")
            self._offload_seen = (tier.offloaded, tier.loaded)
        self.send_updates([self.update_of(out) for out in outputs])

    def _idle(self, llm: LLMEngine) -> None:
        """Engine thread, between idle waits: a beat every BEAT_INTERVAL_S, and at once when the
        counters moved (an abort freed blocks: the front's status shows it now, not in 0.5 s)."""
        now, stats = time.monotonic(), self.stats()
        if stats != self._sent_stats or now - self._last_emit >= BEAT_INTERVAL_S:
            self._last_emit, self._sent_stats = now, stats
            self.emit(Beat(stats, self.metrics.take()))


def command_table(cls: type) -> dict[Command, Callable[..., Awaitable]]:
    """Command -> `cls`'s coroutine for it; TypeError for a `cmd_` coroutine that no Command
    names (the front could never call it: add it to core_protocol.Command)."""
    stray = {name for name in dir(cls) if name.startswith("cmd_")} - {c.handler for c in Command}
    if stray:
        raise TypeError(f"{cls.__name__}: {', '.join(sorted(stray))} named by no core_protocol.Command member")
    return {c: getattr(cls, c.handler) for c in Command if hasattr(cls, c.handler)}


def hold_steps_on_signal(llm: LLMEngine) -> None:
    """Tests (--fault-hooks): SIGUSR1 makes the next model step hang inside itself, its pulse still
    going (an endless loop, a deadlocked collective), until SIGUSR2."""
    held = threading.Event()
    launch = llm.runner.launch

    def held_launch(*args, **kwargs):
        while held.is_set():
            time.sleep(0.05)
        return launch(*args, **kwargs)
    llm.runner.launch = held_launch
    signal.signal(signal.SIGUSR1, lambda *_: held.set())
    signal.signal(signal.SIGUSR2, lambda *_: held.clear())


# -- the core's own process ------------------------------------------------------------------
class CoreHost:
    """Serves one core over the front's sockets: runs each Call as a task, replies, and ends
    everything when the front goes away (its socket closes)."""

    def __init__(self, core: EngineCore, writer: FrameWriter):
        self.core, self.writer = core, writer
        self.tasks: set[asyncio.Task] = set()

    async def serve(self, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                msg = await read_frame(reader)
                if isinstance(msg, Call):
                    task = asyncio.ensure_future(self._run(msg))
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)

    async def _run(self, call: Call) -> None:
        try:
            value, error = await self.core.handle(call.command, call.args), None
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            value, error = None, encode_error(exc)
            if not isinstance(exc, (ValueError, TimeoutError)) and error.code == "INTERNAL":
                traceback.print_exc()
        if call.call_id:
            self.writer.send(Reply(call.call_id, error, value))


def load_core(target: str) -> type[EngineCore]:
    """"package.module:Class" -> the class (the front names its role's core; serving never
    imports a service)."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


async def _serve(command_fd: int, event_fd: int) -> int:
    writer = FrameWriter(socket.socket(fileno=event_fd))
    reader = await open_reader(socket.socket(fileno=command_fd))
    core = await _start(reader, writer)
    if core is None:
        return 2
    await CoreHost(core, writer).serve(reader)
    try:                                # the front is gone or asked us to stop: release the device
        await asyncio.wait_for(core.stop(), STOP_TIMEOUT_S)
    except TimeoutError:
        print("[baton] engine core: stopping took too long; exiting anyway", file=sys.stderr, flush=True)
    return 0


async def _start(reader: asyncio.StreamReader, writer: FrameWriter) -> EngineCore | None:
    """The core the front's Init names, serving (Hello sent); None once a Fatal said why not."""
    try:
        init = check_init(await read_frame(reader))
    except ValueError as exc:           # a front of another protocol version: its config may not even read
        writer.send(Fatal(str(exc)))
        return None
    setup_logging(init.config.log_level, init.config.log_format)
    core = load_core(init.target)(init.config, front_emit(writer))
    try:
        info = await core.start()
    except Exception as exc:            # the front shows one line and exits; tracebacks for bugs only
        if not isinstance(exc, ValueError):
            traceback.print_exc()
        writer.send(Fatal(str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"))
        return None
    writer.send(Hello(info))
    return core


def front_emit(writer: FrameWriter) -> Emit:
    """What the core says to its front. Once the front is gone (its socket broken: it died) there is
    nobody to tell, and the core is ending (its reader sees the close; the kernel's PDEATHSIG follows):
    a message then is dropped, not raised into whoever sent it (a KV transfer's failure callback, the
    engine thread after a step), where it only printed a traceback in the worker's log."""
    gone = threading.Event()

    def emit(message: CoreMessage) -> None:
        if gone.is_set():
            return
        try:
            writer.send(message)
        except (BrokenPipeError, ConnectionResetError):
            gone.set()
    return emit


def _die_with_parent() -> None:
    """Linux: the kernel ends this process when its front dies, whatever the core is doing."""
    signal_on_parent_death(signal.SIGKILL)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m baton.serving.worker.engine_core",
                                description="a worker's engine core; started by the worker, not by hand")
    p.add_argument("--fds", required=True, help="COMMAND_FD,EVENT_FD: the sockets to the front")
    args = p.parse_args(argv)
    command_fd, event_fd = (int(x) for x in args.fds.split(","))
    _die_with_parent()
    # Ctrl-C reaches the whole process group: the front drains first, then closes our socket
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = asyncio.run(_serve(command_fd, event_fd))
    if any(t.name == "baton-engine" and t.is_alive() for t in threading.enumerate()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)      # (a step left running: interpreter shutdown would wait for its torch ops or crash in them)
    sys.exit(code)


if __name__ == "__main__":
    main()
