"""Starting a prefill worker process."""
from __future__ import annotations

import argparse
import asyncio
import logging

from baton.prefill_service.server import PrefillWorker
from baton.serving.worker_config import add_worker_args, worker_config_from_args

DEFAULT_PORT = 50071


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="baton prefill", description="Baton prefill worker")
    add_worker_args(p, DEFAULT_PORT)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = worker_config_from_args(args, "prefill")
    except ValueError as exc:
        p.error(str(exc))
    asyncio.run(PrefillWorker(cfg).serve_forever())
