"""Every service knob is a flag with a BATON_* twin, read in one place (serving/options.py),
and docs/configuration.md is the table the parsers make."""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import pytest

from baton.configuration import all_parsers, table
from baton.serving.worker_config import parse_worker_args

REPO = Path(__file__).resolve().parent.parent


def test_the_docs_table_is_what_the_parsers_say():
    assert (REPO / "docs" / "configuration.md").read_text() == table(), \
        "regenerate it: python -m baton.configuration > docs/configuration.md"


def test_every_option_of_every_service_has_an_environment_twin():
    for command, p in all_parsers().items():
        for action in p._actions:
            if action.option_strings and action.dest not in ("help", argparse.SUPPRESS) and command != "baton generate":
                assert getattr(action, "env", "").startswith("BATON_"), (command, action.option_strings)


def test_a_flag_beats_its_variable_which_beats_the_default(monkeypatch):
    assert parse_worker_args("decode", []).max_waiting == 1024
    monkeypatch.setenv("BATON_MAX_WAITING", "7")
    monkeypatch.setenv("BATON_PREFIX_CACHING", "false")
    cfg = parse_worker_args("decode", [])
    assert cfg.max_waiting == 7 and cfg.engine.enable_prefix_caching is False
    assert parse_worker_args("decode", ["--max-waiting", "9", "--prefix-caching"]).max_waiting == 9


def test_a_variable_that_does_not_parse_names_itself(monkeypatch):
    monkeypatch.setenv("BATON_MAX_WAITING", "lots")
    with pytest.raises(SystemExit, match="BATON_MAX_WAITING='lots' does not parse as int"):
        parse_worker_args("decode", [])


def test_vllm_habits_are_understood():
    cfg = parse_worker_args("decode", ["--colocated", "--tensor-parallel-size", "2"])
    assert cfg.role == "colocated" and cfg.engine.tp_size == 2


@pytest.mark.parametrize("command", ["serve", "router", "prefill", "decode", "generate", "bench"])
def test_help_answers_at_once_without_importing_torch(command):
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "baton", command, "--help"], capture_output=True,
                         text=True, timeout=60)
    took = time.monotonic() - t0
    assert out.returncode == 0 and "usage: baton" in out.stdout
    if command != "bench":                       # the harness's help lists its benchmarks' own flags
        imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if "|" in line}
        assert "torch" not in imported, "--help imported torch"
        assert took < 5, f"baton {command} --help took {took:.1f}s"
