"""The router's one config object, from flags (each with its BATON_* twin, serving/options.py;
a flag's default is its field's, serving/options.defaults)."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from baton.engine.config import EngineConfig
from baton.router import chat_templates
from baton.router.chat_output import REASONING_PARSERS
from baton.router.images import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGES, check_limits
from baton.router.policies import POLICIES
from baton.router.registry import split_target
from baton.serving.options import defaults, flag, parser, port_clash
from baton.serving.security import load_tokens
from baton.serving.server_config import DEFAULT_PORTS, ServerConfig, add_common_args, server_settings

ENGINE = defaults(EngineConfig)         # what the router shares with the workers' engines


@dataclass(slots=True)
class RouterConfig(ServerConfig):
    port: int = DEFAULT_PORTS["router"]
    model: str = ENGINE.model
    revision: str | None = None         # a Hub model's branch, tag or commit
    tokenizer: str | None = None
    cache_dir: str | None = None
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    colocated: list[str] = field(default_factory=list)
    policy: str = "least_loaded"
    resolve_interval: float = 5.0       # seconds between DNS lookups of worker names (0: once, at start)
    auth_tokens: dict[str, str] = field(default_factory=dict)   # token -> client name; empty = no auth
    # limits (0 = the model's own limit / unlimited)
    max_prompt_tokens: int = 0
    max_new_tokens: int = 0
    max_images: int = DEFAULT_MAX_IMAGES            # per request, for models that take images
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # per encoded image
    max_inflight: int = 512             # requests routed to workers at once
    max_queued: int = 2048              # requests waiting for a slot; beyond: RESOURCE_EXHAUSTED
    queue_timeout: float = 30.0         # longest wait for a slot
    max_per_client: int = 0             # requests one client may hold (queued or running)
    first_token_timeout: float = 120.0  # no first token by then: the attempt is retried elsewhere
    http_port: int = 8000               # the OpenAI-compatible API (0: off)
    served_model_name: list[str] = field(default_factory=list)   # names the HTTP API answers to
    max_migrations: int = 3             # times one stream may move to a survivor when its worker dies
    request_timeout: float = 0.0        # a deadline for requests whose client set none (0: none)
    stream_message_rate: float = 10_000.0   # messages/s written to all client streams at most (0: no pacing)
    generation_config: str = ENGINE.generation_config   # where unset sampling fields come from (sampling_params.py)
    chat_template: str | None = None    # a Jinja file rendering chats instead of the model's own template
    trust_request_chat_template: bool = False   # a request may bring its own chat template
    reasoning_parser: str | None = None # "qwen3" or "deepseek_r1": <think>...</think> -> reasoning (chats)
    worker_metrics: bool = False        # /metrics on the HTTP port and --metrics-port serve the workers' too (baton serve)
    reuse_port: bool = False            # share --port / --http-port with other routers on this host (SO_REUSEPORT)
    ready_file: str | None = None       # written once serving: how a supervisor tells routers on one port apart

    def validate(self) -> None:
        for name in ("max_prompt_tokens", "max_new_tokens", "max_per_client"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (0 = no limit)")
        check_limits(self.max_images, self.max_image_bytes)
        if self.max_inflight < 1 or self.max_queued < 0:
            raise ValueError("--max-inflight must be >= 1 and --max-queued >= 0")
        if not 0 <= self.http_port < 65536:
            raise ValueError(f"--http-port must be a port number (0: no HTTP API), got {self.http_port}")
        clash = port_clash([(self.port, "--port (gRPC)"), (self.http_port, "--http-port (the OpenAI API)"),
                            (self.metrics_port or 0, "--metrics-port")])
        if clash:
            raise ValueError(clash)
        if self.max_migrations < 0:
            raise ValueError("--max-migrations must be >= 0 (0 = a stream ends with its worker)")
        if self.request_timeout < 0 or self.stream_message_rate < 0:
            raise ValueError("--request-timeout must be >= 0 seconds (0 = no limit) and --stream-message-rate >= 0")
        if self.queue_timeout <= 0 or self.first_token_timeout <= 0:
            raise ValueError("--queue-timeout and --first-token-timeout must be > 0 seconds")
        if self.ready_file and not os.path.isdir(os.path.dirname(os.path.abspath(self.ready_file))):
            raise ValueError(f"--ready-file {self.ready_file}: its directory does not exist")
        if self.resolve_interval < 0:
            raise ValueError("--resolve-interval must be >= 0 seconds (0 = resolve worker names once)")
        for address in self.prefill + self.decode + self.colocated:
            split_target(address)
        if self.chat_template is not None:            # a file, or a shipped template's name (hermes_tools)
            self.chat_template = chat_templates.resolve(self.chat_template)
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"--reasoning-parser must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"--policy must be one of {POLICIES}, got {self.policy!r}")
        if not (self.prefill or self.decode or self.colocated):
            raise ValueError("no workers: give --prefill ADDR and --decode ADDR, or --colocated ADDR")
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("disaggregated serving needs both --prefill and --decode addresses")


def _addresses(value: str | None) -> list[str]:
    return [a.strip() for a in (value or "").split(",") if a.strip()]


def _names(values: list[str] | str | None) -> list[str]:
    """`--served-model-name a b`, `a,b` or both."""
    items = values if isinstance(values, list) else [values or ""]
    return [name for item in items for name in _addresses(item)]


def build_parser() -> argparse.ArgumentParser:
    p = parser("baton router", "Baton's public gRPC router", usage="baton router [MODEL] [flags]")
    p.not_taken = {"--device": "the router runs no model; give --device to the prefill and decode workers"}
    add_common_args(p, DEFAULT_PORTS["router"])
    flag(p, "--prefill", default="", help="prefill workers, HOST:PORT[,HOST:PORT...]; a host name stands for every "
                                          "address it resolves to (a compose service, a headless Service)")
    flag(p, "--decode", default="", help="decode workers, HOST:PORT[,HOST:PORT...] (names as for --prefill)")
    flag(p, "--colocated", default="", help="colocated workers, HOST:PORT[,HOST:PORT...] (names as for --prefill)")
    flag(p, "--resolve-interval", type=float, default=defaults(RouterConfig).resolve_interval,
         help="seconds between DNS lookups of worker host names: workers that appear join once healthy, "
              "workers that disappear finish their streams and leave (0: look up once, at start)")
    flag(p, "--worker-metrics", type=bool, default=defaults(RouterConfig).worker_metrics,
         help="serve every worker's Prometheus metrics beside the router's own on the HTTP port's /metrics "
              "and on --metrics-port, labelled by worker and role: one scrape target for a deployment (baton serve turns it on; "
              "leave it off where Prometheus scrapes each worker itself, or their series would count twice)")
    flag(p, "--reuse-port", type=bool, default=defaults(RouterConfig).reuse_port,
         help="share --port and --http-port with other routers started with it on this host: the kernel deals "
              "connections out among them (SO_REUSEPORT), for a request rate one router process cannot carry; "
              "off: a taken port is an error")
    flag(p, "--ready-file", help="a file this router writes (its address) once it serves: how a supervisor "
                                 "starting routers that share a port (--reuse-port) tells each one ready")
    add_router_args(p)
    return p


def add_router_args(p: argparse.ArgumentParser) -> None:
    """What `baton serve` passes on to its router as well: how a worker is picked, sampling defaults,
    the HTTP API, chats, auth and limits."""
    flag(p, "--policy", default=defaults(RouterConfig).policy, choices=POLICIES,
         help="how the router picks a worker for a request: round_robin, least_loaded (the work queued there), "
              "prefix_aware (a hash of the prompt's first tokens), kv_aware (the workers' prefix caches, from their "
              "KV events, weighed against their queues)")
    add_generation_config(p)
    add_http_api(p)
    add_chat(p)
    add_auth_and_limits(p)


def add_chat(p: argparse.ArgumentParser) -> None:
    """How chats are rendered and their output read (also `baton serve`'s, passed on to its router)."""
    r = defaults(RouterConfig)
    c = p.add_argument_group("chats")
    flag(c, "--chat-template", help="a Jinja chat template file to render chats with, instead of the model's own, "
                                    "or a shipped one by name (hermes_tools: renders tools, Hermes / Qwen3 style)")
    flag(c, "--trust-request-chat-template", type=bool, default=r.trust_request_chat_template,
         help="let a request bring its own chat template (chat_template); off: such a request is refused")
    flag(c, "--reasoning-parser", choices=REASONING_PARSERS,
         help="return a chat answer's <think>...</think> as reasoning_content (qwen3: when the answer opens "
              "with <think>; deepseek_r1: the answer starts thinking, up to </think>)")


def add_http_api(p: argparse.ArgumentParser) -> None:
    """The OpenAI-compatible API's flags (also `baton serve`'s, passed on to its router)."""
    r = defaults(RouterConfig)
    h = p.add_argument_group("OpenAI-compatible HTTP API")
    flag(h, "--http-port", type=int, default=r.http_port,
         help="port of the OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models, /health); "
              "0: off")
    flag(h, "--served-model-name", nargs="+", default=r.served_model_name,
         help="model name(s) the HTTP API answers to, apart by spaces or commas (unset: the model's own name)")


def add_generation_config(p: argparse.ArgumentParser) -> None:
    flag(p, "--generation-config", default=defaults(RouterConfig).generation_config,
         help="sampling defaults for fields a request leaves unset: auto (the model's generation_config.json: "
              "temperature, top_p, top_k, max_new_tokens), none (1.0 / 1.0 / off / 256), or a directory holding "
              "a generation_config.json")


def add_auth_and_limits(p: argparse.ArgumentParser) -> None:
    """The public port's bearer tokens and limits (also `baton serve`'s, passed on to its router)."""
    r = defaults(RouterConfig)
    a = p.add_argument_group("auth and limits")
    flag(a, "--auth-token", "--api-key", help="require 'authorization: Bearer <token>' on every Router RPC")
    flag(a, "--auth-token-file", help="one 'client:token' per line; limits are counted per client")
    flag(a, "--max-prompt-tokens", type=int, default=r.max_prompt_tokens, help="longest prompt accepted (0: the model's context)")
    flag(a, "--max-new-tokens", type=int, default=r.max_new_tokens, help="largest max_tokens accepted (0: the model's context)")
    flag(a, "--max-images", type=int, default=r.max_images,
         help="images (or audio clips) one chat request may carry (models that take them; 0: none)")
    flag(a, "--max-image-bytes", type=int, default=r.max_image_bytes,
         help="largest encoded image (or audio clip) accepted, in bytes; --max-images times this must fit in 56 MiB")
    flag(a, "--max-inflight", type=int, default=r.max_inflight, help="requests routed to workers at once")
    flag(a, "--max-queued", type=int, default=r.max_queued,
         help="requests waiting for a slot; more are refused with RESOURCE_EXHAUSTED")
    flag(a, "--queue-timeout", type=float, default=r.queue_timeout, help="longest wait for a slot, in seconds")
    flag(a, "--max-per-client", type=int, default=r.max_per_client,
         help="requests one client (token, else address) may hold; 0: no limit")
    flag(a, "--first-token-timeout", type=float, default=r.first_token_timeout,
         help="seconds an attempt may take to produce its first token before it is retried elsewhere")
    flag(a, "--max-migrations", type=int, default=r.max_migrations,
         help="times one running stream may move to another worker when its worker dies (0: never; the "
              "stream then ends UNAVAILABLE)")
    flag(a, "--request-timeout", type=float, default=r.request_timeout,
         help="seconds a request may take in all when its client set no deadline (0: no limit; a stream that "
              "makes progress is never cut)")
    flag(a, "--stream-message-rate", type=float, default=r.stream_message_rate,
         help="messages per second the router writes to all client streams together, at most, and fewer while "
              "its event loop has little time to spare (router/pacing.py): with more streams than that allows "
              "one message per token, each stream's tokens gather into fuller messages, at most 100 ms apart "
              "(0: one message per worker chunk)")


def router_config_from_args(args: argparse.Namespace) -> RouterConfig:
    try:
        tokens = load_tokens(args.auth_token, args.auth_token_file)
    except OSError as exc:
        raise ValueError(f"--auth-token-file {args.auth_token_file}: {exc.strerror or exc}") from None
    cfg = RouterConfig(**server_settings(args), port=args.port, model=args.model, revision=args.revision,
                       tokenizer=args.tokenizer, cache_dir=args.cache_dir,
                       prefill=_addresses(args.prefill), decode=_addresses(args.decode),
                       colocated=_addresses(args.colocated), policy=args.policy, resolve_interval=args.resolve_interval,
                       auth_tokens=tokens,
                       max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
                       max_images=args.max_images, max_image_bytes=args.max_image_bytes,
                       max_inflight=args.max_inflight, max_queued=args.max_queued, queue_timeout=args.queue_timeout,
                       max_per_client=args.max_per_client, first_token_timeout=args.first_token_timeout,
                       max_migrations=args.max_migrations, http_port=args.http_port,
                       served_model_name=_names(args.served_model_name), request_timeout=args.request_timeout,
                       stream_message_rate=args.stream_message_rate,
                       generation_config=args.generation_config, chat_template=args.chat_template,
                       trust_request_chat_template=args.trust_request_chat_template,
                       reasoning_parser=args.reasoning_parser, worker_metrics=args.worker_metrics,
                       reuse_port=args.reuse_port, ready_file=args.ready_file)
    cfg.validate()
    return cfg


def parse_router_args(argv: list[str] | None = None) -> RouterConfig:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        return router_config_from_args(args)
    except ValueError as exc:
        p.error(str(exc))
