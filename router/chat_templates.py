"""The chat templates Baton ships (router/chat-templates/, package data of the wheel) and how
`--chat-template` finds one: a file path, or a shipped template's short name (`hermes_tools`).
"""
from __future__ import annotations

from pathlib import Path

SHIPPED_DIR = Path(__file__).resolve().parent / "chat-templates"     # not a package name: data, not code


def shipped() -> list[str]:
    """The short names of the templates in the package."""
    return sorted(p.stem for p in SHIPPED_DIR.glob("*.jinja"))


def resolve(name_or_path: str) -> str:
    """The file `--chat-template` names: a path that exists, else a shipped template by short name
    (with or without `.jinja`); a ValueError saying what exists otherwise."""
    if Path(name_or_path).is_file():
        return name_or_path
    own = SHIPPED_DIR / (name_or_path.removesuffix(".jinja") + ".jinja")
    if "/" not in name_or_path and own.is_file():
        return str(own)
    raise ValueError(f"--chat-template {name_or_path}: no such file, nor a template Baton ships "
                     f"({', '.join(shipped()) or 'none'}); give a Jinja chat template file or one of those names")
