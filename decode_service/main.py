"""Starting a decode (or colocated) worker process: parse (torch-free, so --help is instant),
then serve."""
from __future__ import annotations

from baton.serving import tracing
from baton.serving.grpc_server import run_server
from baton.serving.logs import setup_logging
from baton.serving.worker.worker_config import parse_worker_args


def main(argv: list[str] | None = None) -> None:
    cfg = parse_worker_args("decode", argv)
    setup_logging(cfg.log_level, cfg.log_format)
    tracing.setup(f"baton-{cfg.role}", cfg.otlp_traces_endpoint)
    from baton.decode_service.server import DecodeWorker
    run_server(DecodeWorker(cfg).serve_forever(), cfg.role)
