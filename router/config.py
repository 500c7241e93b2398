"""The router's one config object, from flags (BATON_* environment variables as defaults)."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from baton.router.policies import POLICIES
from baton.serving.security import TLSConfig, load_tokens, tls_from_args
from baton.serving.worker_config import add_common_args

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
    tls: TLSConfig = field(default_factory=TLSConfig)
    auth_tokens: dict[str, str] = field(default_factory=dict)   # token -> client name; empty = no auth
    # limits (0 = the model's own limit / unlimited)
    max_prompt_tokens: int = 0
    max_new_tokens: int = 0
    max_inflight: int = 512             # requests routed to workers at once
    max_queued: int = 2048              # requests waiting for a slot; beyond: RESOURCE_EXHAUSTED
    queue_timeout: float = 30.0         # longest wait for a slot
    max_per_client: int = 0             # requests one client may hold (queued or running)
    first_token_timeout: float = 120.0  # no first token by then: the attempt is retried elsewhere

    def validate(self) -> None:
        for name in ("max_prompt_tokens", "max_new_tokens", "max_per_client"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (0 = no limit)")
        if self.max_inflight < 1 or self.max_queued < 0:
            raise ValueError("--max-inflight must be >= 1 and --max-queued >= 0")
        if self.queue_timeout <= 0 or self.first_token_timeout <= 0:
            raise ValueError("--queue-timeout and --first-token-timeout must be > 0 seconds")
        if self.policy not in POLICIES:
            raise ValueError(f"--policy must be one of {POLICIES}, got {self.policy!r}")
        if not (self.prefill or self.decode or self.colocated):
            raise ValueError("no workers: give --prefill ADDR and --decode ADDR, or --colocated ADDR")
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("disaggregated serving needs both --prefill and --decode addresses")


def _addresses(value: str | None) -> list[str]:
    return [a.strip() for a in (value or "").split(",") if a.strip()]


def add_router_args(p: argparse.ArgumentParser) -> None:
    env = os.environ.get
    add_common_args(p, DEFAULT_PORT)
    p.add_argument("--prefill", default=os.environ.get("BATON_PREFILL", ""), help="ADDR[,ADDR...]")
    p.add_argument("--decode", default=os.environ.get("BATON_DECODE", ""), help="ADDR[,ADDR...]")
    p.add_argument("--colocated", default=os.environ.get("BATON_COLOCATED", ""), help="ADDR[,ADDR...]")
    p.add_argument("--policy", default=os.environ.get("BATON_POLICY", "least_loaded"), choices=POLICIES)
    p.add_argument("--grace", type=float, default=float(env("BATON_GRACE", 30.0)),
                   help="seconds in-flight requests get to finish after SIGTERM")
    a = p.add_argument_group("auth and limits")
    a.add_argument("--auth-token", default=env("BATON_AUTH_TOKEN"),
                   help="require 'authorization: Bearer <token>' on every Router RPC")
    a.add_argument("--auth-token-file", default=env("BATON_AUTH_TOKEN_FILE"),
                   help="one 'client:token' per line; limits are counted per client")
    a.add_argument("--max-prompt-tokens", type=int, default=int(env("BATON_MAX_PROMPT_TOKENS", 0)),
                   help="longest prompt accepted (0: the model's context)")
    a.add_argument("--max-new-tokens", type=int, default=int(env("BATON_MAX_NEW_TOKENS", 0)),
                   help="largest max_tokens accepted (0: the model's context)")
    a.add_argument("--max-inflight", type=int, default=int(env("BATON_MAX_INFLIGHT", 512)),
                   help="requests routed to workers at once")
    a.add_argument("--max-queued", type=int, default=int(env("BATON_MAX_QUEUED", 2048)),
                   help="requests waiting for a slot; more are refused with RESOURCE_EXHAUSTED")
    a.add_argument("--queue-timeout", type=float, default=float(env("BATON_QUEUE_TIMEOUT", 30.0)),
                   help="longest wait for a slot, in seconds")
    a.add_argument("--max-per-client", type=int, default=int(env("BATON_MAX_PER_CLIENT", 0)),
                   help="requests one client (token, else address) may hold; 0: no limit")
    a.add_argument("--first-token-timeout", type=float, default=float(env("BATON_FIRST_TOKEN_TIMEOUT", 120.0)),
                   help="seconds an attempt may take to produce its first token before it is retried elsewhere")


def router_config_from_args(args: argparse.Namespace) -> RouterConfig:
    cfg = RouterConfig(host=args.host, port=args.port, model=args.model, metrics_port=args.metrics_port,
                       prefill=_addresses(args.prefill), decode=_addresses(args.decode),
                       colocated=_addresses(args.colocated), policy=args.policy, grace_seconds=args.grace,
                       tls=tls_from_args(args), auth_tokens=load_tokens(args.auth_token, args.auth_token_file),
                       max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
                       max_inflight=args.max_inflight, max_queued=args.max_queued, queue_timeout=args.queue_timeout,
                       max_per_client=args.max_per_client, first_token_timeout=args.first_token_timeout)
    cfg.validate()
    return cfg
