"""`baton generate`: a streaming client for the public Router API."""
from __future__ import annotations

import argparse
import mimetypes
import sys
from pathlib import Path

import grpc

from baton.serving.grpc_server import open_sync_channel, retry_after_ms
from baton.serving.options import flag, parser
from baton.serving.security import add_tls_args, tls_from_args
from baton.v1 import router_pb2, router_pb2_grpc


def build_parser() -> argparse.ArgumentParser:
    p = parser("baton generate", "stream a completion from a router")
    p.add_argument("prompt", help="the prompt (sent as a user chat message unless --raw)")
    flag(p, "--addr", default="127.0.0.1:50051", help="the router's address")
    flag(p, "--auth-token", "--token", env="BATON_AUTH_TOKEN", help="bearer token, when the router requires one")
    flag(p, "--timeout", type=float, default=300.0, help="seconds the whole request may take")
    r = p.add_argument_group("the request")
    r.add_argument("--max-tokens", type=int, help="tokens to generate at most (unset: the server's default)")
    r.add_argument("--temperature", type=float, help="0 is greedy (unset: the server's default)")
    r.add_argument("--top-p", type=float, help="nucleus sampling, in (0, 1]")
    r.add_argument("--top-k", type=int, help="sample among the k likeliest tokens (0: off)")
    r.add_argument("--seed", type=int, help="same seed, same request: same tokens")
    r.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    r.add_argument("--chat", action="store_true", help="send the prompt as a user chat message (the default)")
    r.add_argument("--raw", action="store_true", help="send the prompt as raw text (no chat template)")
    r.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image file sent before the prompt in the chat message (repeatable; "
                        "vision-language models such as Qwen3-VL)")
    add_tls_args(p)
    return p


def request_from_args(args: argparse.Namespace) -> router_pb2.GenerateRequest:
    """The request the flags describe; ValueError for what the server would refuse anyway."""
    if not args.prompt.strip():
        raise ValueError("the prompt is empty: give some text to complete")
    sampling = router_pb2.SamplingParams(stop=args.stop)
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        value = getattr(args, name)
        if value is not None:
            setattr(sampling, name, value)
    req = router_pb2.GenerateRequest(sampling=sampling)
    if args.raw and not args.chat:
        if args.image:
            raise ValueError("--image goes in a chat message: drop --raw")
        req.text = args.prompt
    elif args.image:         # the images, then the question, as Qwen-VL's own examples put them
        message = req.chat.messages.add(role="user")
        for path in args.image:
            message.parts.add(image=_read_image(path))
        message.parts.add(text=args.prompt)
    else:       # an instruct model answers best through its chat template
        req.chat.messages.add(role="user", content=args.prompt)
    return req


def _read_image(path: str) -> router_pb2.Image:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"--image {path}: {exc.strerror or exc}") from None
    return router_pb2.Image(data=data, mime_type=mimetypes.guess_type(path)[0] or "")


def main(argv: list[str] | None = None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        req = request_from_args(args)
        tls = tls_from_args(args)
    except ValueError as exc:
        p.error(str(exc))
    metadata = [("authorization", f"Bearer {args.auth_token}")] if args.auth_token else None
    with open_sync_channel(args.addr, tls) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        try:
            for resp in stub.Generate(req, timeout=args.timeout, metadata=metadata):
                sys.stdout.write(resp.text)
                sys.stdout.flush()
                if resp.finish_reason:
                    u = resp.usage
                    print(f"\n[{router_pb2.FinishReason.Name(resp.finish_reason)}; prompt {u.prompt_tokens}, "
                          f"completion {u.completion_tokens}, cached {u.cached_prompt_tokens} tokens]",
                          file=sys.stderr)
        except grpc.RpcError as exc:
            print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                print(f"is a router running at {args.addr}? start one with `baton serve` "
                      "(TLS routers need --tls-ca)", file=sys.stderr)
            elif exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                print("the router wants a bearer token: pass --auth-token or set BATON_AUTH_TOKEN", file=sys.stderr)
            elif exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                hint = retry_after_ms(exc.trailing_metadata())
                if hint:
                    print(f"the router is at capacity: retry in {hint / 1000:.1f}s", file=sys.stderr)
            sys.exit(1)
