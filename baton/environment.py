"""The process environment, read here and nowhere else: every flag's BATON_* twin (`twin`; the
flags are declared in serving/options.py, which reads their twins through `get`), the variables
without a flag (WITHOUT_FLAG, listed in docs/configuration.md), the few variables of other
programs Baton looks at, and the environment its child processes start with.

Import-free, so every layer may use it (models/cache.py reads --cache-dir's twin for the offline
API, a KV backend its trace switch). benchmarks/environment.py names the benchmarks' own
variables and reads them through here. tests/test_defaults_once.py fails on `os.environ` or
`getenv` anywhere else in the product, bar a statement `os.environ.setdefault("LIB_VAR", value)`
that sets a library's own knob for this process (it reads no setting).
"""
from __future__ import annotations

import os
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass

PREFIX = "BATON_"


def twin(flag: str) -> str:
    """The variable that sets `flag`'s default: `--max-waiting` -> BATON_MAX_WAITING."""
    return PREFIX + flag.lstrip("-").upper().replace("-", "_")


def get(name: str) -> str | None:
    return os.environ.get(name)


@dataclass(frozen=True, slots=True)
class Variable:
    """A variable no flag stands for."""

    name: str
    help: str

    def get(self) -> str | None:
        return get(self.name)


KV_SECRET = Variable("BATON_KV_SECRET", "the shared KV secret itself; a flag would show it in the process list, "
                                        "so use it or `--kv-secret-file`")
KV_TRACE = Variable("BATON_KV_TRACE", "1: each NIXL KV transfer's milestones on stderr, on both sides "
                                      "(where its fixed cost goes)")
SUPERVISOR_PID = Variable("BATON_SUPERVISOR_PID", "set by `baton serve` for the servers it starts (not by hand): "
                                                  "each ends, draining as on SIGTERM, when that process dies, even "
                                                  "by kill -9")
WITHOUT_FLAG = (KV_SECRET, KV_TRACE, SUPERVISOR_PID)


def for_children(**overrides: str) -> dict[str, str]:
    """This process's environment, with `overrides`, for a child process to start with."""
    return dict(os.environ, **overrides)


def set_default(name: str, value: str, env: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """`name`=`value` in `env` (unset: this process's environment) unless it is set; returns `env`."""
    env = os.environ if env is None else env
    env.setdefault(name, value)
    return env


def unset(name: str) -> None:
    os.environ.pop(name, None)


@contextmanager
def shipped() -> Iterator[None]:
    """No BATON_* variable while inside: every default as shipped (the docs table is made so)."""
    saved = {k: v for k, v in os.environ.items() if k.startswith(PREFIX)}
    for k in saved:
        del os.environ[k]
    try:
        yield
    finally:
        os.environ.update(saved)
