"""Starting the router process: model info and tokenizer, worker registry, gRPC server.

The router reads a model's config and tokenizer, never its weights, so it runs without torch,
which transformers imports whenever it is installed: 230 MB of the router's resident memory
(docs/memory.md). Converting a GGUF does take torch: a child process converts it (once per
machine, usually done already by `baton serve`) and the router then reads the result.
"""
from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from baton import environment
from baton.engine.requests.sampling_params import sampling_defaults
from baton.engine.requests.tokenizer import eos_token_ids, load_tokenizer
from baton.models.multimodal import media_placeholders
from baton.models.source import resolve_model
from baton.router import health, worker_metrics
from baton.router.admin import AdminServicer
from baton.router.config import RouterConfig, parse_router_args
from baton.router.openai.api import OpenAIServer
from baton.router.registry import Registry
from baton.router.server import RouterService, RouterServicer
from baton.serving import tracing
from baton.serving.grpc_server import Server, run_server
from baton.serving.logs import setup_logging
from baton.serving.metrics import Metrics
from baton.serving.security import TokenAuth
from baton.v1 import admin_pb2_grpc, router_pb2, router_pb2_grpc


async def serve(cfg: RouterConfig) -> None:
    without_torch()         # here, not in main(): a test that only parses flags in its own process keeps torch
    # ports first: a clash is reported in a second, not after the tokenizer has loaded
    auth = TokenAuth(cfg.auth_tokens) if cfg.auth_tokens else None
    # a hard bound under admission control: gRPC itself refuses RPCs beyond it
    server = Server(cfg.host, cfg.port, ["baton.v1.Router", "baton.v1.Admin"], tls=cfg.tls, interceptors=[auth] if auth else [],
                    max_concurrent_rpcs=cfg.max_inflight + cfg.max_queued + 256, reuse_port=cfg.reuse_port)
    metrics = Metrics("router")
    port_view = worker_metrics.PortView(metrics.registry) if cfg.worker_metrics else None
    metrics.serve(cfg.metrics_port, cfg.host, port_view.registry() if port_view else None)
    http = None
    if cfg.http_port:
        http = OpenAIServer(None, cfg, "", metrics.registry)
        await http.start()
    source, tokenizer = load_model(cfg)
    if cfg.chat_template:                     # every chat renders with it: gRPC, HTTP, /tokenize
        tokenizer.chat_template = Path(cfg.chat_template).read_text()
    hf = source.hf_config
    info = router_pb2.ModelInfo(name=source.name, architecture=source.architecture,
                                max_model_len=getattr(hf, "max_position_embeddings", 0), vocab_size=hf.vocab_size,
                                eos_token_ids=eos_token_ids(source, tokenizer))
    metrics.serving_model(source.name)
    registry = Registry(cfg.prefill, cfg.decode, cfg.colocated, source.name, tls=cfg.tls,
                        resolve_interval=cfg.resolve_interval)
    await registry.start()
    metrics.watch_kv_usage(lambda: kv_usage(registry))
    metrics.watch_degraded(lambda: health.judge(registry).status == "degraded")
    svc = RouterService(registry, tokenizer, info, cfg,
                        sampling_defaults(source.generation_config(cfg.generation_config)),
                        vision=media_placeholders(hf))
    svc.auth, svc.metrics, svc.server = auth, metrics, server
    metrics.watch_pacing(lambda: svc.pacer.busy, lambda: svc.pacer.rate)
    router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(svc), server.server)
    admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(svc), server.server)
    await server.start()
    if http is not None:
        http.attach(svc, source.name)
    if port_view is not None:
        port_view.attach(lambda: worker_metrics.targets(registry), asyncio.get_running_loop())
    if cfg.ready_file:                        # routers sharing a port: the file says this one serves
        Path(cfg.ready_file).write_text(server.address + "\n")
    healthy = sum(w.healthy for w in registry.workers)
    security = ("TLS" + (", mutual" if cfg.tls.require_client_cert else "")) if cfg.tls.cert else "plaintext"
    if svc.auth:
        security += f", bearer tokens for {len(set(cfg.auth_tokens.values()))} client(s)"
    api = f", OpenAI API on {http.address}" if http is not None else ""
    print(f"[baton] router ready on {server.address}{api} ({healthy}/{len(registry.workers)} workers healthy, "
          f"policy {cfg.policy}, {security})", file=sys.stderr, flush=True)
    await server.wait_for_signal(cfg.grace_seconds, busy=lambda: len(svc.active))
    if http is not None:
        await http.stop()
    await registry.stop()


def kv_usage(registry: Registry) -> float:
    """Share of KV blocks in use over the healthy workers that hold running requests' KV."""
    workers = [w for w in registry.workers if w.healthy and w.role != "prefill"]
    total = sum(w.status.kv_blocks_total for w in workers)
    return 1 - sum(w.status.kv_blocks_free for w in workers) / total if total else 0.0


def load_model(cfg: RouterConfig):
    """The model's source and tokenizer."""
    try:
        source = resolve_model(cfg.model, cfg.cache_dir, cfg.tokenizer, cfg.revision)
        return source, load_tokenizer(source)
    except ImportError:                       # torch, to convert a GGUF: let a process with torch do it
        _convert_in_child(cfg)
        source = resolve_model(cfg.model, cfg.cache_dir, cfg.tokenizer, cfg.revision)
        return source, load_tokenizer(source)


CONVERT = """import sys
from baton.models.source import resolve_model
from baton.serving.logs import setup_logging
setup_logging(sys.argv[5], sys.argv[6])     # its progress bars, like every line, in the router's format
try:
    resolve_model(sys.argv[1], sys.argv[2] or None, sys.argv[3] or None, sys.argv[4] or None).tokenizer_dir()
except ValueError as exc:
    sys.exit(f"baton router: {exc}")
"""


def _convert_in_child(cfg: RouterConfig) -> None:
    done = subprocess.run([sys.executable, "-c", CONVERT, cfg.model, cfg.cache_dir or "", cfg.tokenizer or "",
                           cfg.revision or "", cfg.log_level, cfg.log_format],
                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    if done.returncode:
        sys.exit(2)                           # the child said why


def without_torch() -> None:
    """`import torch` fails from here on, so transformers takes it as not installed."""
    if "torch" not in sys.modules:            # (a process that has it already keeps it)
        sys.modules["torch"] = None
    environment.set_default("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")     # its "PyTorch was not found" line


def main(argv: list[str] | None = None) -> None:
    cfg = parse_router_args(argv)
    setup_logging(cfg.log_level, cfg.log_format)
    tracing.setup("baton-router", cfg.otlp_traces_endpoint)
    run_server(serve(cfg), "router")
