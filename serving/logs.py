"""One log format per process: `--log-level` and `--log-format text|json` (BATON_LOG_LEVEL,
BATON_LOG_FORMAT), for the router and every worker.

text: `time LEVEL logger: message`, and the `[baton] ...` progress lines as they are.
json: one object per line for collectors (Loki, Fluent Bit, Cloud Logging): time, level,
logger, message (and the exception, when there is one). Progress lines and anything else a
library prints to stderr become such objects too, so a collector never sees a stray line.
"""
from __future__ import annotations

import json
import logging
import sys
import time

from baton.serving.options import flag

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def record(level: str, logger: str, message: str, **extra) -> str:
    t = time.time()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"
    return json.dumps({"time": stamp, "level": level, "logger": logger, "message": message, **extra},
                      ensure_ascii=False)


class JSONFormatter(logging.Formatter):
    def format(self, r: logging.LogRecord) -> str:
        extra = {"exception": self.formatException(r.exc_info)} if r.exc_info else {}
        return record(r.levelname, r.name, r.getMessage(), **extra)


class JSONLines:
    """sys.stderr in JSON mode: every line printed becomes one object (logger 'baton' for the
    `[baton] ...` progress lines, 'stderr' for the rest)."""

    def __init__(self, out):
        self.out, self.pending = out, ""

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if line.strip():
                baton = line.startswith("[baton] ")
                self.out.write(record("INFO" if baton else "WARNING", "baton" if baton else "stderr",
                                      line.removeprefix("[baton] ")) + "\n")
        self.out.flush()
        return len(text)

    def flush(self) -> None:
        self.out.flush()

    def __getattr__(self, name):
        return getattr(self.out, name)


def add_log_args(p) -> None:
    g = p.add_argument_group("logs")
    flag(g, "--log-level", default="info", choices=LEVELS, help="the least severe log records written")
    flag(g, "--log-format", default="text", choices=FORMATS,
         help="text (for people) or json (one object per line, for log collectors)")


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JSONFormatter())
        sys.stderr = JSONLines(sys.stderr)        # the handler keeps the real stream
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
