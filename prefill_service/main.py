"""Starting a prefill worker process: parse (torch-free, so --help is instant), then serve."""
from __future__ import annotations

from baton.serving import tracing
from baton.serving.grpc_server import run_server
from baton.serving.logs import setup_logging
from baton.serving.worker.worker_config import parse_worker_args


def main(argv: list[str] | None = None) -> None:
    cfg = parse_worker_args("prefill", argv)
    setup_logging(cfg.log_level, cfg.log_format)
    tracing.setup("baton-prefill", cfg.otlp_traces_endpoint)
    from baton.prefill_service.server import PrefillWorker
    run_server(PrefillWorker(cfg).serve_forever(), cfg.role)
