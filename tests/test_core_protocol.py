"""The front <-> engine-core wire (serving/worker/core_protocol.py): every message survives the framing
as itself, a core refuses a front of another protocol version with one line naming both, and
a command is an enum member the role's core has (anything else answers a clear error)."""
from __future__ import annotations

import asyncio
import socket
from dataclasses import astuple, fields

import grpc
import pytest

from baton.engine import step_clock
from baton.engine.scheduling.block_manager import KVCacheFull
from baton.serving.grpc_server import ServiceError
from baton.serving.worker.core_protocol import (
    PROTOCOL_VERSION,
    Beat,
    Call,
    Command,
    CoreError,
    CoreStats,
    Fatal,
    FrameWriter,
    Hello,
    Init,
    Pulse,
    Reply,
    TokenUpdate,
    Updates,
    _update_rows,
    check_init,
    decode_error,
    encode_error,
    open_reader,
    read_frame,
)
from baton.serving.worker.engine_core import EngineCore, _serve
from baton.serving.worker.worker_config import WorkerConfig

STATS = CoreStats(2, 1, 100, 40, spec_accepted_lengths=(1, 0, 2))
MESSAGES = [
    Init(PROTOCOL_VERSION, "baton.decode_service.core:DecodeCore", WorkerConfig(role="decode")),
    Call(7, Command.ADMIT, ("r1", [1, 2, 3], None, "grpc", 2.5)),
    Call(0, Command.ABORT, ("r1",)),
    Hello({"model": "m", "block_size": 16, "stats": STATS}),
    Fatal("could not load the model"),
    Reply(7, None, {"transfer_id": "t", "num_blocks": 1}),
    Reply(8, CoreError("status", "RESOURCE_EXHAUSTED", "full", 1.0)),
    Updates([TokenUpdate("a", [5]),
             TokenUpdate("b", [6, 7], "stop", 3, None, 0.25, [None, None], [None]),
             TokenUpdate("c", [], error=CoreError("status", "ABORTED", "KV handover failed: gone"))],
            STATS, [("step_seconds", ("step",), 0.01)]),
    Beat(STATS, []),
    Pulse(step_clock.Pulse("step", 1.5, 5.0, 256, 0.001)),
]


def _round_trip(messages: list) -> list:
    async def scenario():
        ours, theirs = socket.socketpair()
        writer, reader = FrameWriter(ours), await open_reader(theirs)
        for msg in messages:
            writer.send(msg)
        received = [await read_frame(reader) for _ in messages]
        writer.close()
        reader.writer.close()
        return received
    return asyncio.run(scenario())


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_crosses_the_framing_as_itself(msg):
    (received,) = _round_trip([msg])
    assert type(received) is type(msg) and received == msg


def test_an_update_frame_rebuilds_its_token_updates_with_every_field():
    (frame,) = _round_trip([MESSAGES[7]])
    assert all(type(u) is TokenUpdate for u in frame.updates)
    b = frame.updates[1]
    assert (b.request_id, b.new_token_ids, b.finish_reason, b.cached_tokens, b.handover_s) == ("b", [6, 7], "stop", 3, 0.25)
    assert frame.updates[0].logprobs is None and frame.updates[0].error is None


def test_errors_cross_as_the_exception_the_front_raises():
    busy = decode_error(encode_error(ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", retry_after=2.0)))
    assert isinstance(busy, ServiceError) and busy.code == grpc.StatusCode.RESOURCE_EXHAUSTED and busy.retry_after == 2.0
    assert isinstance(decode_error(encode_error(ValueError("bad"))), ValueError)
    assert isinstance(decode_error(encode_error(KVCacheFull("full"))), KVCacheFull)
    assert isinstance(decode_error(encode_error(TimeoutError("late"))), TimeoutError)


def test_a_front_of_another_protocol_version_is_refused_naming_both():
    with pytest.raises(ValueError, match=f"the front speaks version {PROTOCOL_VERSION + 1}, this core version "
                                         f"{PROTOCOL_VERSION}"):
        check_init(Init(PROTOCOL_VERSION + 1, "x:Y", WorkerConfig(role="decode")))
    with pytest.raises(ValueError, match="unversioned front"):
        check_init(("init", "x:Y", WorkerConfig(role="decode")))       # the untyped wire's first message
    assert check_init(MESSAGES[0]) is MESSAGES[0]


def test_the_core_process_answers_a_mismatched_init_with_a_fatal_and_exits():
    async def scenario():
        front_cmd, core_cmd = socket.socketpair()
        front_evt, core_evt = socket.socketpair()
        FrameWriter(front_cmd).send(Init(PROTOCOL_VERSION + 1, "x:Y", WorkerConfig(role="decode")))
        code = await _serve(core_cmd.detach(), core_evt.detach())
        reader = await open_reader(front_evt)
        fatal = await read_frame(reader)
        front_cmd.close()
        reader.writer.close()
        return code, fatal
    code, fatal = asyncio.run(scenario())
    assert code == 2 and isinstance(fatal, Fatal)
    assert f"version {PROTOCOL_VERSION + 1}" in fatal.message and f"version {PROTOCOL_VERSION}" in fatal.message


class AbortOnlyCore(EngineCore):
    async def cmd_abort(self, rid: str) -> bool:
        return rid == "known"


def _handle(command, *args):
    core = AbortOnlyCore(WorkerConfig(role="prefill"), emit=lambda msg: None)
    return asyncio.run(core.handle(command, args))


def test_a_command_runs_through_the_table_built_from_the_enum():
    # (every core answers KV_EVENTS: EngineCore's own)
    assert AbortOnlyCore.COMMANDS == {Command.ABORT: AbortOnlyCore.cmd_abort, Command.KV_EVENTS: EngineCore.cmd_kv_events}
    assert _handle(Command.ABORT, "known") is True


def test_a_command_the_role_lacks_is_refused_by_name():
    with pytest.raises(ValueError, match="the prefill engine core has no command 'admit'"):
        _handle(Command.ADMIT, "r1", [1], None, "grpc", 1.0)


def test_a_command_given_as_a_string_is_refused_naming_the_enum():
    with pytest.raises(ValueError, match=r"'abort' is no engine-core command \(core_protocol.Command: PREFILL"):
        _handle("abort", "known")


def test_a_cmd_coroutine_no_command_names_fails_at_class_definition():
    with pytest.raises(TypeError, match="Stray: cmd_reload named by no core_protocol.Command member"):
        class Stray(AbortOnlyCore):
            async def cmd_reload(self) -> None:
                return None


def test_an_update_row_carries_every_field_in_order():
    """Updates pickle their TokenUpdates as rows spelt out field by field: a new field must join them."""
    update = TokenUpdate(*(f"v{i}" for i in range(len(fields(TokenUpdate)))))
    assert _update_rows([update]) == [astuple(update)]


def test_what_the_core_says_once_its_front_is_gone_is_dropped_not_raised():
    """The front died (SIGKILL): its sockets close before the kernel's PDEATHSIG ends the core, and
    in between a KV transfer's failure callback or the step loop that reports to the front got a
    BrokenPipeError, printed as a traceback in the worker's log. Now the message goes nowhere."""
    from baton.serving.worker.engine_core import front_emit
    ours, theirs = socket.socketpair()
    theirs.close()
    emit = front_emit(FrameWriter(ours))
    for _ in range(3):                      # the first send may still fit the buffer; the next ones break
        emit(Updates([TokenUpdate("a", [], error=CoreError("status", "ABORTED", "KV handover failed"))], STATS, []))
        emit(Pulse(step_clock.Pulse("step", 1.5, 5.0, 256, 0.001)))
    ours.close()
