"""Where Baton keeps what it makes once per machine: converted models, compiled graphs."""
from __future__ import annotations

from pathlib import Path

from baton import environment


def cache_root(cache_dir: str | None = None) -> Path:
    """`cache_dir` (--cache-dir), else $BATON_CACHE_DIR (which the services' --cache-dir reads too,
    so `LLM()` and `baton serve` share one cache), else ~/.cache/baton."""
    chosen = cache_dir or environment.get(environment.twin("--cache-dir"))
    return Path(chosen).expanduser() if chosen else Path.home() / ".cache" / "baton"
