"""What every Baton server (the router and each worker) is configured with, and its flags:
where it listens, which model, its grace period, metrics, logs and TLS. WorkerConfig and
RouterConfig extend ServerConfig, so each of these defaults is written once, here.
Torch-free, so `baton <command> --help` answers at once.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

from baton.engine.config import DEFAULT_MODEL
from baton.models.presets import PRESETS
from baton.serving.logs import LOG_FORMAT, LOG_LEVEL, add_log_args
from baton.serving.options import add_config_arg, defaults, flag
from baton.serving.security import TLSConfig, add_tls_args, tls_from_args

ROLES = ("prefill", "decode", "colocated")      # a worker's
DEFAULT_PORTS = {"router": 50051, "prefill": 50071, "decode": 50061, "colocated": 50061}


@dataclass(slots=True, kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"
    metrics_port: int | None = None     # Prometheus metrics over HTTP (None: none)
    grace_seconds: float = 30.0         # in-flight requests' time to finish after SIGTERM
    tls: TLSConfig = field(default_factory=TLSConfig)
    log_level: str = LOG_LEVEL
    log_format: str = LOG_FORMAT
    otlp_traces_endpoint: str | None = None   # OpenTelemetry traces exported there (serving/tracing.py; None: off)
    admin_token: str | None = None      # operators' calls (a role switch) need it as a bearer token (None: refused)


# presets are random weights: say so where they are listed, or qwen3-8b reads as the real model
MODEL_HELP = (f"{DEFAULT_MODEL} (embedded, real weights), a Hugging Face Hub name (ORG/NAME: downloaded into the HF "
              "cache; HF_TOKEN, HF_ENDPOINT, HF_HUB_OFFLINE apply), an HF checkpoint directory (config.json + "
              "*.safetensors), a .gguf file, or a preset of random weights in a real model's shape (for benchmarks): "
              + ", ".join(name for name in PRESETS if not name.startswith("tiny-"))
              + "; for tests: " + ", ".join(name for name in PRESETS if name.startswith("tiny-")))


def add_common_args(p: argparse.ArgumentParser, default_port: int) -> None:
    """What every Baton server takes: where to listen, which model, its grace period, metrics, logs, TLS."""
    s = defaults(ServerConfig)
    p.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model, as --model (`baton serve Qwen/Qwen3-0.6B`)")
    add_config_arg(p)
    flag(p, "--host", default=s.host, help="address to listen on (0.0.0.0: every interface)")
    flag(p, "--port", type=int, default=default_port, help="gRPC port")
    flag(p, "--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    flag(p, "--revision", help="Hub models: the branch, tag or commit to serve (unset: main)")
    flag(p, "--tokenizer", help="tokenizer directory to use instead of the model's own (presets: the embedded one's)")
    flag(p, "--cache-dir", help="where converted models and compiled graphs are kept (unset: ~/.cache/baton)")
    flag(p, "--metrics-port", type=int, default=s.metrics_port, help="serve Prometheus metrics over HTTP on this port")
    flag(p, "--grace", type=float, default=s.grace_seconds, help="seconds in-flight requests get to finish after SIGTERM")
    flag(p, "--otlp-traces-endpoint", default=s.otlp_traces_endpoint,
         help="export OpenTelemetry traces of each request (router, prefill, KV transfer, decode; W3C trace context "
              "carried between them) to this OTLP/HTTP URL, e.g. http://127.0.0.1:4318/v1/traces (unset: off; "
              "needs pip install 'baton[trace]')")
    flag(p, "--admin-token", default=s.admin_token,
         help="operators' calls (switching a worker's role: `baton role`) must carry 'authorization: Bearer <this>'; "
              "give the router and its workers the same one (unset: such calls are refused)")
    add_log_args(p)
    add_tls_args(p)


def server_settings(args: argparse.Namespace) -> dict:
    """The ServerConfig fields, from the flags add_common_args adds (ValueError: a TLS setting that
    cannot work)."""
    if not (math.isfinite(args.grace) and args.grace >= 0):
        raise ValueError(f"--grace {args.grace:g}: must be a number of seconds >= 0")
    return dict(host=args.host, metrics_port=args.metrics_port, grace_seconds=args.grace, tls=tls_from_args(args),
                log_level=args.log_level, log_format=args.log_format, otlp_traces_endpoint=args.otlp_traces_endpoint,
                admin_token=args.admin_token or None)
