"""Starting a decode (or colocated) worker process."""
from __future__ import annotations

import argparse
import asyncio
import logging

from baton.decode_service.server import DecodeWorker
from baton.serving.worker_config import add_worker_args, worker_config_from_args

DEFAULT_PORT = 50061


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="baton decode", description="Baton decode worker")
    add_worker_args(p, DEFAULT_PORT)
    p.add_argument("--colocated", action="store_true", help="also run prefill here (role colocated)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = worker_config_from_args(args, "colocated" if args.colocated else "decode")
    except ValueError as exc:
        p.error(str(exc))
    asyncio.run(DecodeWorker(cfg).serve_forever())
