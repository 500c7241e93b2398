"""Where Baton keeps what it makes once per machine: converted models, compiled graphs."""
from __future__ import annotations

from pathlib import Path


def cache_root(cache_dir: str | None = None) -> Path:
    """`cache_dir` (--cache-dir / BATON_CACHE_DIR), else ~/.cache/baton."""
    return Path(cache_dir).expanduser() if cache_dir else Path.home() / ".cache" / "baton"
