"""`baton generate`: a streaming client for the public Router API; `baton role`: an operator's
role switch through a router's Admin service."""
from __future__ import annotations

import argparse
import mimetypes
import os
import shlex
import shutil
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.models.audio import AUDIO_FORMATS
from baton.serving.grpc_server import open_sync_channel, pem_problem, retry_after_ms
from baton.serving.options import defaults, flag, parser
from baton.serving.security import add_tls_args, load_tokens, tls_from_args
from baton.serving.server_config import DEFAULT_PORTS, ROLES, ServerConfig
from baton.v1 import admin_pb2, admin_pb2_grpc, router_pb2, router_pb2_grpc

DEFAULT_ADDR = f"{defaults(ServerConfig).host}:{DEFAULT_PORTS['router']}"     # where a router listens by default


def build_parser() -> argparse.ArgumentParser:
    p = parser("baton generate", "stream a completion from a router", usage='baton generate "PROMPT" [flags]')
    p.add_argument("prompt", help="the prompt (sent as a user chat message unless --raw)")
    flag(p, "--addr", default=DEFAULT_ADDR, help="the router's address")
    flag(p, "--auth-token", "--token", help="bearer token, when the router requires one")
    flag(p, "--auth-token-file", help="the router's --auth-token-file (or one like it): its first token is sent")
    flag(p, "--timeout", type=float, default=300.0, help="seconds the whole request may take")
    r = p.add_argument_group("the request")
    r.add_argument("--max-tokens", type=int, help="tokens to generate at most (unset: the server's default)")
    r.add_argument("--temperature", type=float, help="0 is greedy (unset: the server's default)")
    r.add_argument("--top-p", type=float, help="nucleus sampling, in (0, 1]")
    r.add_argument("--top-k", type=int, help="sample among the k likeliest tokens (0: off)")
    r.add_argument("--seed", type=int, help="same seed, same request: same tokens")
    r.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    how = r.add_mutually_exclusive_group()
    how.add_argument("--chat", action="store_true", help="send the prompt as a user chat message (the default)")
    how.add_argument("--raw", action="store_true", help="send the prompt as raw text (no chat template)")
    r.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image file sent before the prompt in the chat message (repeatable; "
                        "vision-language models such as Qwen3-VL)")
    r.add_argument("--audio", action="append", default=[], metavar="PATH",
                   help="an audio file (WAV, MP3, FLAC, Ogg) sent before the prompt in the chat message "
                        "(repeatable; audio-language models such as Qwen2-Audio)")
    add_tls_args(p, server=False)
    return p


def request_from_args(args: argparse.Namespace) -> router_pb2.GenerateRequest:
    """The request the flags describe; ValueError for what the server would refuse anyway."""
    if not args.prompt.strip():
        raise ValueError("the prompt is empty: give some text to complete")
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {args.timeout:g}")
    check_addr(args.addr)
    sampling = router_pb2.SamplingParams(stop=args.stop)
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        value = getattr(args, name)
        if value is not None:
            lo, hi = INT_RANGES.get(name, (None, None))
            if lo is not None and not lo <= value <= hi:        # else protobuf's "Value out of range: -1"
                raise ValueError(f"--{name.replace('_', '-')} {value}: must be in [{lo}, {hi}]")
            setattr(sampling, name, value)
    req = router_pb2.GenerateRequest(sampling=sampling)
    if args.raw:
        if args.image or args.audio:
            raise ValueError(f"--{'image' if args.image else 'audio'} goes in a chat message: drop --raw")
        req.text = args.prompt
    elif args.image or args.audio:   # the media, then the question, as Qwen-VL's and Qwen2-Audio's examples put them
        message = req.chat.messages.add(role="user")
        for path in args.image:
            message.parts.add(image=_read_image(path))
        for path in args.audio:
            message.parts.add(audio=_read_audio(path))
        message.parts.add(text=args.prompt)
    else:       # an instruct model answers best through its chat template
        req.chat.messages.add(role="user", content=args.prompt)
    return req


# the integer flags' field ranges (router.proto): max_tokens >= 1 (0 is refused by the server as well)
INT_RANGES = {"max_tokens": (1, 2**32 - 1), "top_k": (0, 2**31 - 1), "seed": (0, 2**64 - 1)}
ROLE_TIMEOUT_MAX_S = (2**32 - 1) // 1000             # timeout_ms is a uint32


def check_addr(addr: str) -> None:
    """A HOST:PORT address whose port gRPC would take: it wraps 99999 round to 34463 without a word."""
    host, sep, port = addr.rpartition(":")
    if sep and host and port.isdigit() and not 1 <= int(port) <= 65535:
        raise ValueError(f"--addr {addr}: the port must be in [1, 65535]")


def client_tls(args: argparse.Namespace):
    """The TLS flags' config, its files checked (ValueError): gRPC core only logs a bad one."""
    tls = tls_from_args(args)
    wrong = pem_problem(tls)
    if wrong:
        raise ValueError(wrong)
    return tls


def _read_image(path: str) -> router_pb2.Image:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"--image {path}: {exc.strerror or exc}") from None
    return router_pb2.Image(data=data, mime_type=mimetypes.guess_type(path)[0] or "")


def _read_audio(path: str) -> router_pb2.Audio:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"--audio {path}: {exc.strerror or exc}") from None
    suffix = Path(path).suffix.lower().lstrip(".")
    return router_pb2.Audio(data=data, format=suffix if suffix in AUDIO_FORMATS else "")   # else: the bytes decide


def main(argv: list[str] | None = None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        req = request_from_args(args)
        tls = client_tls(args)
        token = _token(args)
    except ValueError as exc:
        p.error(str(exc))
    metadata = [("authorization", f"Bearer {token}")] if token else None
    written: list[str] = []
    with open_sync_channel(args.addr, tls) as ch:
        try:
            _stream(router_pb2_grpc.RouterStub(ch), req, args.timeout, metadata, written)
        except grpc.RpcError as exc:
            end_line = "\n" if written else ""          # the answer's partial line, if any
            print(f"{end_line}error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            hint = _hint(exc, args.addr, ch)
            if hint:
                print(hint, file=sys.stderr)
            sys.exit(1)


def role_main(argv: list[str] | None = None) -> None:
    """`baton role WORKER ROLE`: switch a worker's role in place, its streams moving with their KV."""
    p = parser("baton role", "switch a worker's role in place (prefill, decode, colocated) through its router: "
               "it takes no new work of its old role, its streams move to peers with their KV, then it serves "
               "the new one; it rolls back if its streams cannot all move within --timeout",
               usage="baton role WORKER ROLE [flags]")
    p.add_argument("worker", help="the worker's address, as `GetServerInfo` (or baton top) lists it")
    p.add_argument("role", choices=ROLES, help="its new role")
    flag(p, "--addr", default=DEFAULT_ADDR, help="the router's address")
    flag(p, "--admin-token", help="the router's --admin-token")
    flag(p, "--timeout", type=float, default=60.0, help="seconds its streams get to move before it rolls back")
    add_tls_args(p, server=False)
    args = p.parse_args(argv)
    try:
        if not 0 < args.timeout <= ROLE_TIMEOUT_MAX_S:
            raise ValueError(f"--timeout must be in (0, {ROLE_TIMEOUT_MAX_S}] seconds, got {args.timeout:g}")
        check_addr(args.addr)
        tls = client_tls(args)
    except ValueError as exc:
        p.error(str(exc))
    metadata = [("authorization", f"Bearer {args.admin_token}")] if args.admin_token else None
    req = admin_pb2.AdminSwitchRoleRequest(worker=args.worker, role=args.role, timeout_ms=int(args.timeout * 1000))
    with open_sync_channel(args.addr, tls) as ch:
        try:
            r = admin_pb2_grpc.AdminStub(ch).SwitchRole(req, timeout=args.timeout + 15, metadata=metadata)
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            sys.exit(1)
    print(f"worker {r.worker}: {r.from_role} -> {r.to_role} in {r.seconds:.2f}s "
          f"({r.streams_moved} stream(s) moved with their KV)")


def _token(args: argparse.Namespace) -> str | None:
    if not args.auth_token_file:
        return args.auth_token
    try:
        tokens = load_tokens(None, args.auth_token_file)
    except OSError as exc:
        raise ValueError(f"--auth-token-file {args.auth_token_file}: {exc.strerror or exc}") from None
    if not tokens:
        raise ValueError(f"--auth-token-file {args.auth_token_file}: no token in it")
    return next(iter(tokens))


def _stream(stub, req, timeout: float, metadata, written: list[str]) -> None:
    call = stub.Generate(req, timeout=timeout, metadata=metadata)
    try:
        _print(call, written)
    except KeyboardInterrupt:       # Ctrl-C: the router frees the request (the stream cancelled), no traceback
        call.cancel()
        end_line = "\n" if written else ""         # the answer's partial line, if any
        print(f"{end_line}[interrupted: the request was cancelled]", file=sys.stderr)
        sys.exit(130)


def _print(call, written: list[str]) -> None:
    for resp in call:
        if resp.text:
            written.append(resp.text)
            sys.stdout.write(resp.text)
        sys.stdout.flush()
        if resp.finish_reason:
            u = resp.usage
            print(f"\n[{router_pb2.FinishReason.Name(resp.finish_reason)}; prompt {u.prompt_tokens}, "
                  f"completion {u.completion_tokens}, cached {u.cached_prompt_tokens} tokens]", file=sys.stderr)


def _hint(exc: grpc.RpcError, addr: str, channel) -> str | None:
    """What to do about an error, when its message alone does not say."""
    code = exc.code()
    if code == grpc.StatusCode.UNAVAILABLE and not _answers(channel):
        # only then: a router that answers said UNAVAILABLE itself (no healthy worker), and its message says why
        return (f"is a router running at {addr}? start one with `{baton_command()} serve` "
                "(a TLS router needs --tls-ca)")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return "the router wants a bearer token: pass --auth-token, --auth-token-file or set BATON_AUTH_TOKEN"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        wait = retry_after_ms(exc.trailing_metadata())
        return f"the router is at capacity: retry in {wait / 1000:.1f}s" if wait else None
    return None


def _answers(channel) -> bool:
    """Does a router answer on this channel? (Health needs no token.)"""
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        return True
    except grpc.RpcError:
        return False


def baton_command() -> str:
    """`baton` as a user must type it to reach this installation: `baton` when that is the one on
    PATH, else the full path of this environment's script (`make serve` runs .venv/bin/baton with
    no venv activated), else `python -m baton`."""
    script = Path(sys.executable).parent / "baton"
    if not script.is_file():
        return f"{shlex.quote(sys.executable)} -m baton"
    found = shutil.which("baton")
    if found and os.path.samefile(found, script):
        return "baton"
    return shlex.quote(str(script.absolute()))
