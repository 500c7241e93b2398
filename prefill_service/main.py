"""Starting a prefill worker process: parse (torch-free, so --help is instant), then serve."""
from __future__ import annotations

import logging

from baton.serving.grpc_server import run_server
from baton.serving.worker_config import parse_worker_args


def main(argv: list[str] | None = None) -> None:
    cfg = parse_worker_args("prefill", argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from baton.prefill_service.server import PrefillWorker
    run_server(PrefillWorker(cfg).serve_forever(), cfg.role)
