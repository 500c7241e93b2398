"""Quiet, truthful logs: an expected race (an abort meeting a KV hand-off) is one line with no
traceback, and gRPC's C core says nothing below ERROR in any Baton process unless the user's
GRPC_VERBOSITY asks for more (it reads the variable once, when grpc is imported)."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

# run in a child: records GRPC_VERBOSITY as grpc is imported, then runs an entry point with --help
WATCH_GRPC_IMPORT = """
import os, runpy, sys

class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "grpc":
            print("GRPC_VERBOSITY=" + os.environ.get("GRPC_VERBOSITY", "<unset>"), flush=True)
            sys.meta_path.remove(self)

sys.meta_path.insert(0, Watch())
module, *sys.argv[1:] = sys.argv[1:]
if module == "baton":                   # the `baton` command itself
    from baton.cli import main
    main(sys.argv[1:])
else:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def verbosity_at_grpc_import(args: list[str], user: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    if user is not None:
        env["GRPC_VERBOSITY"] = user
    run = subprocess.run([sys.executable, "-c", WATCH_GRPC_IMPORT, *args], env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    (line,) = [x for x in run.stdout.splitlines() if x.startswith("GRPC_VERBOSITY=")]
    return line.removeprefix("GRPC_VERBOSITY=")


@pytest.mark.parametrize("args", [["baton.prefill_service", "--help"], ["baton", "router", "--help"]],
                         ids=["python-m-worker", "baton-command"])
def test_grpc_core_says_only_errors_from_the_moment_grpc_is_imported(args):
    assert verbosity_at_grpc_import(args, None) == "ERROR"


def test_a_users_grpc_verbosity_is_kept():
    assert verbosity_at_grpc_import(["baton.decode_service", "--help"], "DEBUG") == "DEBUG"


@pytest.mark.parametrize("user", [None, "INFO"], ids=["unset", "user-set"])
def test_the_processes_baton_serve_starts_inherit_the_setting(tmp_path, user):
    from baton.supervisor import Process, Supervisor
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    if user is not None:
        env["GRPC_VERBOSITY"] = user
    seen = tmp_path / "seen"
    child = Process("probe", [sys.executable, "-c", "import os, sys; open(sys.argv[1], 'w').write("
                              "os.environ.get('GRPC_VERBOSITY', '<unset>'))", str(seen)], "127.0.0.1:1")
    Supervisor(env).start(child)
    assert child.proc.wait(timeout=30) == 0
    assert seen.read_text() == (user or "ERROR")


# -- an abort meeting a KV hand-off ------------------------------------------------------------
def test_an_abort_meeting_a_kv_hand_off_logs_one_line_and_no_traceback(caplog):
    """The prefill worker gave a request up (abort, deadline, failed push: its piece queue is gone)
    while the engine ran its prompt: the pieces the engine still makes are dropped with one info
    line, and the abort the service sends as it ends frees every block."""
    from baton.engine import LLMEngine, SamplingParams
    from baton.engine.config import EngineConfig
    from baton.engine.kv_handoff import KVState
    from baton.prefill_service.core import PrefillHandoff
    engine = LLMEngine(EngineConfig(model="tiny-llama", num_kv_blocks=32, max_num_batched_tokens=16),
                       handoff=PrefillHandoff())
    engine.add_request(list(range(100, 150)), SamplingParams(temperature=0, max_tokens=1), request_id="r",
                       hand_off_kv=True)
    ticket = engine.kv_ticket("r")
    with caplog.at_level(logging.DEBUG):
        engine.step()                       # a step makes block 0 final: its piece finds nobody
        engine.step()                       # ... and block 1's
        engine.abort("r")                   # what the service sends as the request ends
    assert ticket.state is KVState.FREED
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not [r for r in caplog.records if r.exc_info], "a traceback for an expected race"
    (line,) = [r for r in caplog.records if "request r " in r.getMessage()]
    assert line.levelno == logging.INFO and "KV is dropped" in line.getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
