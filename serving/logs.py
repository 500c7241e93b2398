"""One log format per process: `--log-level` and `--log-format text|json` (BATON_LOG_LEVEL,
BATON_LOG_FORMAT), for `baton serve`, the router and every worker.

text, for people: every line Baton writes reads alike, a progress line (`[baton] decode ready
on ...`) as a log record (`[baton] router: warning: worker ... marked unhealthy`): the logger
without its `baton.` prefix, the level unless it is info, no time (the terminal, journald,
`docker logs -t` or `kubectl logs --timestamps` add one; json has one). Whole lines only: the
processes of `baton serve` share one terminal, and a line written in two pieces would be cut
by a sibling's.
json, for collectors (Loki, Fluent Bit, Cloud Logging): one object per line: time, level,
logger, message (and the exception, when there is one). Progress lines and anything else a
library prints to stderr become such objects too, so a collector never sees a stray line.
gRPC's C core writes to stderr by itself: errors only, unless GRPC_VERBOSITY asks for more.
"""
from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import MutableMapping

from baton import environment
from baton.progress import TAG, Flattened, redraws
from baton.serving.options import flag

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
LOG_LEVEL, LOG_FORMAT = "info", "text"      # the defaults
GRPC_VERBOSITY = "ERROR"            # what gRPC's C core writes unless the user's GRPC_VERBOSITY says
FATAL = re.compile(r"baton [a-z]+( [a-z]+)?: ")       # `baton decode: cannot listen on ...`


def record(level: str, logger: str, message: str, **extra) -> str:
    t = time.time()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"
    return json.dumps({"time": stamp, "level": level, "logger": logger, "message": message, **extra},
                      ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """A log record as a progress line: `[baton] router: warning: ...`."""

    def format(self, r: logging.LogRecord) -> str:
        where = r.name.removeprefix("baton").lstrip(".")
        level = "" if r.levelno == logging.INFO else f"{r.levelname.lower()}: "
        text = f"{TAG}{where + ': ' if where else ''}{level}{r.getMessage()}"
        return f"{text}\n{self.formatException(r.exc_info)}" if r.exc_info else text


class JSONFormatter(logging.Formatter):
    def format(self, r: logging.LogRecord) -> str:
        extra = {"exception": self.formatException(r.exc_info)} if r.exc_info else {}
        return record(r.levelname, r.name, r.getMessage(), **extra)


class Lines:
    """sys.stderr, written a whole line at a time (`print` writes its text and its newline
    apart). `to_line` makes what is written of each line (JSON mode: an object). A line redrawn
    in place (a progress bar) is drawn as it comes on a terminal, and elsewhere (a file, a pipe,
    JSON) flattened into a few plain lines (baton/progress.py)."""

    def __init__(self, out, to_line=None):
        self.out, self.pending, self.to_line = out, "", to_line
        self.terminal = to_line is None and redraws(out)     # JSON lines are for a collector, whatever reads them
        self.flat = Flattened()

    def isatty(self) -> bool:
        return self.terminal

    def write(self, text: str) -> int:
        if self.terminal:
            self._to_terminal(text)
        else:
            self._put(self.flat.feed(text))
        self.out.flush()
        return len(text)

    def _to_terminal(self, text: str) -> None:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        self._put(lines)
        if "\r" in self.pending:                  # a progress bar redraws its line in place
            self.out.write(self.pending)
            self.pending = ""

    def _put(self, lines: list[str]) -> None:
        if self.to_line is not None:
            lines = [self.to_line(line) for line in lines if line.strip()]
        if lines:
            self.out.write("".join(f"{line}\n" for line in lines))

    def flush(self) -> None:
        self.out.flush()

    def __getattr__(self, name):
        return getattr(self.out, name)


def json_line(line: str) -> str:
    """One stderr line as an object: logger 'baton' for the `[baton] ...` progress lines and the
    `baton <command>: ...` line a process ends with (an error), 'stderr' for the rest."""
    if line.startswith(TAG):
        return record("INFO", "baton", line.removeprefix(TAG))
    if FATAL.match(line):
        return record("ERROR", "baton", line)
    return record("WARNING", "stderr", line)


def quiet_grpc(env: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """GRPC_VERBOSITY=ERROR in `env` (unset: this process's environment) unless it is set (a user's
    own setting stays); returns `env`.
    Unset, gRPC's C core writes its INFO lines to stderr in a format of its own (`Got goaway`
    at every stop); it reads the variable once, when grpc is imported, so each entry point calls
    this before that, and children inherit it."""
    return environment.set_default("GRPC_VERBOSITY", GRPC_VERBOSITY, env)


def add_log_args(p) -> None:
    g = p.add_argument_group("logs")
    flag(g, "--log-level", default=LOG_LEVEL, choices=LEVELS,
         help=f"the least severe log records written (gRPC's own C-core lines: GRPC_VERBOSITY, unset: {GRPC_VERBOSITY})")
    flag(g, "--log-format", default=LOG_FORMAT, choices=FORMATS,
         help="text (for people) or json (one object per line, for log collectors)")


def setup_logging(level: str = LOG_LEVEL, fmt: str = LOG_FORMAT) -> None:
    real = sys.stderr.out if isinstance(sys.stderr, Lines) else sys.stderr     # set up twice: wrap it once
    sys.stderr = Lines(real, json_line if fmt == "json" else None)
    handler = logging.StreamHandler(real)              # a record is written whole, in one write
    handler.setFormatter(JSONFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
