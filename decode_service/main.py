"""Starting a decode (or colocated) worker process: parse (torch-free, so --help is instant),
then serve."""
from __future__ import annotations

import logging

from baton.serving.grpc_server import run_server
from baton.serving.worker_config import parse_worker_args


def main(argv: list[str] | None = None) -> None:
    cfg = parse_worker_args("decode", argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from baton.decode_service.server import DecodeWorker
    run_server(DecodeWorker(cfg).serve_forever(), cfg.role)
