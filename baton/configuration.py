"""The one table of every service option (docs/configuration.md), made from the parsers:

    python -m baton.configuration > docs/configuration.md
"""
from __future__ import annotations

import argparse

from baton import environment
from baton.client import build_parser as generate_parser
from baton.launcher import build_parser as serve_parser
from baton.router.config import build_parser as router_parser
from baton.serving.options import markdown
from baton.serving.worker.worker_config import build_parser as worker_parser


def all_parsers() -> dict[str, argparse.ArgumentParser]:
    return {"baton serve": serve_parser(), "baton router": router_parser(), "baton prefill": worker_parser("prefill"),
            "baton decode": worker_parser("decode"), "baton generate": generate_parser()}


def table() -> str:
    """The table with every default as shipped: the BATON_* variables of this shell are ignored."""
    with environment.shipped():
        return markdown(all_parsers())


if __name__ == "__main__":
    print(table(), end="")
