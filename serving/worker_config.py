"""One config object for a worker process (prefill, decode or colocated): server + engine.

Built from CLI flags, with BATON_* environment variables as defaults (what docker-compose
sets), validated once.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from baton.engine.config import DEFAULT_MODEL, EngineConfig
from baton.kvtransfer.peer_auth import load_secret
from baton.serving.security import TLSConfig, add_tls_args, tls_from_args

ROLES = ("prefill", "decode", "colocated")


@dataclass(slots=True)
class WorkerConfig:
    role: str
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int | None = None
    grace_seconds: float = 30.0
    kv_backend: str = "grpc"
    max_waiting: int = 1024             # queued requests beyond this are refused: RESOURCE_EXHAUSTED
    kv_advertise: str | None = None     # KV address prefill workers are told to push to (default: ours)
    tls: TLSConfig = field(default_factory=TLSConfig)
    kv_secret: bytes | None = None      # KV peers must prove it in the handshake (kvtransfer/peer_auth.py)
    engine: EngineConfig = field(default_factory=EngineConfig)

    def validate(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")
        if self.engine.tp_size > 1 and self.role != "colocated":
            raise ValueError(f"--tp-size {self.engine.tp_size} on a {self.role} worker: KV transfer moves one "
                             "rank's cache, so disaggregated roles run with tp_size 1 for now (use --role colocated, "
                             "or one worker per device)")
        self.tls.validate()
        self.engine.validate()


def _env(name: str, default):
    value = os.environ.get(f"BATON_{name.upper()}")
    if value is None:
        return default
    return type(default)(value) if default is not None and not isinstance(default, bool) else value


def add_common_args(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument("--host", default=_env("host", "127.0.0.1"))
    p.add_argument("--port", type=int, default=_env("port", default_port))
    p.add_argument("--model", default=_env("model", DEFAULT_MODEL),
                   help="preset name, HF directory or .gguf file (default: the embedded SmolLM2)")
    p.add_argument("--device", default=_env("device", "cpu"), help="cpu, cuda:N or npu:N")
    p.add_argument("--metrics-port", type=int, default=_env("metrics_port", None),
                   help="serve Prometheus metrics over HTTP on this port")
    add_tls_args(p)


def add_worker_args(p: argparse.ArgumentParser, default_port: int) -> None:
    add_common_args(p, default_port)
    e = EngineConfig()
    p.add_argument("--dtype", default=_env("dtype", None), choices=[None, "float32", "bfloat16", "float16"])
    p.add_argument("--block-size", type=int, default=_env("block_size", e.block_size))
    p.add_argument("--max-num-seqs", type=int, default=_env("max_num_seqs", e.max_num_seqs))
    p.add_argument("--max-num-batched-tokens", type=int, default=_env("max_num_batched_tokens", e.max_num_batched_tokens))
    p.add_argument("--max-model-len", type=int, default=_env("max_model_len", None))
    p.add_argument("--num-kv-blocks", type=int, default=_env("num_kv_blocks", None),
                   help="exact KV cache size in blocks (default: from the memory budget)")
    p.add_argument("--gpu-memory-utilization", type=float, default=e.gpu_memory_utilization)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--enforce-eager", action="store_true", help="no decode graph capture")
    p.add_argument("--tp-size", type=int, default=_env("tp_size", 1),
                   help="tensor-parallel ranks, one device each (colocated role only, for now)")
    p.add_argument("--tp-devices", default=_env("tp_devices", None),
                   help="devices of the ranks, e.g. cuda:0,cuda:1 (default: counted up from --device)")
    p.add_argument("--tp-port", type=int, default=_env("tp_port", 0),
                   help="rendezvous port of the ranks on 127.0.0.1 (default: a free one)")
    p.add_argument("--kv-backend", default=_env("kv_backend", "grpc"), choices=("grpc", "direct"),
                   help="KV transport: grpc (portable, through host memory) or direct (device to device over "
                        "NCCL between GPUs, HCCL between NPUs, gloo on the CPU; prefill and decode both say "
                        "direct, and a direct decode worker still takes grpc pushes)")
    p.add_argument("--grace", type=float, default=_env("grace", 30.0),
                   help="seconds in-flight requests get to finish after SIGTERM")
    p.add_argument("--max-waiting", type=int, default=_env("max_waiting", 1024),
                   help="requests queued beyond this are refused with RESOURCE_EXHAUSTED")
    p.add_argument("--kv-advertise", default=_env("kv_advertise", None),
                   help="decode: the HOST:PORT prefill workers push KV to, when not this server's own "
                        "address (NAT, a separate KV network, a proxy)")
    p.add_argument("--kv-secret-file", default=_env("kv_secret_file", None),
                   help="file whose first line is the shared KV secret (>= 16 bytes): prefill and decode "
                        "workers then accept each other only after a mutual HMAC handshake. "
                        "BATON_KV_SECRET passes the secret itself")
    p.add_argument("--seed", type=int, default=0)


def worker_config_from_args(args: argparse.Namespace, role: str) -> WorkerConfig:
    engine = EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=not args.no_prefix_caching, enforce_eager=args.enforce_eager, seed=args.seed,
        tp_size=args.tp_size, tp_devices=args.tp_devices, tp_port=args.tp_port,
    )
    cfg = WorkerConfig(role=role, host=args.host, port=args.port, metrics_port=args.metrics_port,
                       grace_seconds=args.grace, kv_backend=args.kv_backend, max_waiting=args.max_waiting,
                       kv_advertise=args.kv_advertise, tls=tls_from_args(args),
                       kv_secret=load_secret(os.environ.get("BATON_KV_SECRET"), args.kv_secret_file), engine=engine)
    cfg.validate()
    return cfg
