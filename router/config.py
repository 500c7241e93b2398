"""The router's one config object, from flags (BATON_* environment variables as defaults)."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from engine.worker_config import add_common_args
from router.policies import POLICIES

DEFAULT_PORT = 50051


@dataclass(slots=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    model: str = "smollm2-135m-instruct"
    metrics_port: int | None = None
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    colocated: list[str] = field(default_factory=list)
    policy: str = "least_loaded"
    grace_seconds: float = 30.0

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"--policy must be one of {POLICIES}, got {self.policy!r}")
        if not (self.prefill or self.decode or self.colocated):
            raise ValueError("no workers: give --prefill ADDR and --decode ADDR, or --colocated ADDR")
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("disaggregated serving needs both --prefill and --decode addresses")


def _addresses(value: str | None) -> list[str]:
    return [a.strip() for a in (value or "").split(",") if a.strip()]


def add_router_args(p: argparse.ArgumentParser) -> None:
    add_common_args(p, DEFAULT_PORT)
    p.add_argument("--prefill", default=os.environ.get("BATON_PREFILL", ""), help="ADDR[,ADDR...]")
    p.add_argument("--decode", default=os.environ.get("BATON_DECODE", ""), help="ADDR[,ADDR...]")
    p.add_argument("--colocated", default=os.environ.get("BATON_COLOCATED", ""), help="ADDR[,ADDR...]")
    p.add_argument("--policy", default=os.environ.get("BATON_POLICY", "least_loaded"), choices=POLICIES)
    p.add_argument("--grace", type=float, default=30.0)


def router_config_from_args(args: argparse.Namespace) -> RouterConfig:
    cfg = RouterConfig(host=args.host, port=args.port, model=args.model, metrics_port=args.metrics_port,
                       prefill=_addresses(args.prefill), decode=_addresses(args.decode),
                       colocated=_addresses(args.colocated), policy=args.policy, grace_seconds=args.grace)
    cfg.validate()
    return cfg
