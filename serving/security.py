"""Transport security and client auth, shared by every Baton process (torch-free).

- TLS on every gRPC channel from one `TLSConfig` per process: its certificate and key
  serve its own port and, with `--tls-ca`, identify it as a client to its peers (mutual
  TLS). `--tls-require-client-cert` makes its server refuse peers without a certificate
  signed by that CA: what internal ports (prefill, decode, KV channel) should run with.
- Bearer tokens on the router's public port (`TokenAuth`): `authorization: Bearer <token>`
  metadata, compared in constant time; each token names a client, which the router's
  per-client limits count against. Health and reflection stay open for health checks.

A process started with no TLS flags speaks plaintext, as before, so loopback development
and CI need no certificates.
"""
from __future__ import annotations

import argparse
import hmac
from dataclasses import dataclass
from pathlib import Path

import grpc

from baton.serving.options import defaults, flag

AUTH_HEADER = "authorization"
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")   # never behind the token
OWN_AUTH_SERVICES = ("/baton.v1.Admin/",)      # behind the --admin-token instead (grpc_server.check_admin)


@dataclass(slots=True)
class TLSConfig:
    cert: str | None = None                 # PEM certificate chain of this process
    key: str | None = None                  # PEM private key for `cert`
    ca: str | None = None                   # PEM CA bundle that peers' certificates must chain to
    require_client_cert: bool = False       # this server accepts only peers with a cert from `ca`
    server_name: str | None = None          # name to expect in peers' certificates (default: host)

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.ca)

    def validate(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("--tls-cert and --tls-key go together: give both or neither")
        if self.require_client_cert and not (self.ca and self.cert):
            raise ValueError("--tls-require-client-cert needs --tls-cert/--tls-key for this server "
                             "and --tls-ca to check client certificates against")
        for name, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca)):
            if path and not Path(path).is_file():
                raise ValueError(f"{name} {path}: no such file")

    def server_credentials(self) -> grpc.ServerCredentials:
        if not (self.cert and self.key):
            raise ValueError("serving TLS needs --tls-cert and --tls-key")
        return grpc.ssl_server_credentials(
            [(_read(self.key), _read(self.cert))], root_certificates=_read(self.ca) if self.ca else None,
            require_client_auth=self.require_client_cert)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Trust `ca` (the system roots without it); present our own cert when we have one."""
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca) if self.ca else None,
            private_key=_read(self.key) if self.key else None,
            certificate_chain=_read(self.cert) if self.cert else None)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


def add_tls_args(p: argparse.ArgumentParser, server: bool = True) -> None:
    """The TLS flags of a server (which also dials its peers), or with `server=False` of a client
    that only dials: the same names and variables, without the flags only a server can use."""
    if not server:
        g = p.add_argument_group("TLS (to a router serving TLS)")
        flag(g, "--tls-ca", help="PEM CA bundle the router's certificate must chain to (enables TLS)")
        flag(g, "--tls-cert", help="PEM client certificate, for a router that requires one (mutual TLS)")
        flag(g, "--tls-key", help="PEM private key of --tls-cert")
        flag(g, "--tls-server-name", help="name the router's certificate must carry, when it is not --addr's host")
        return
    g = p.add_argument_group("TLS (every gRPC channel this process serves or opens)")
    flag(g, "--tls-cert", "--ssl-certfile", help="PEM certificate of this process")
    flag(g, "--tls-key", "--ssl-keyfile", help="PEM private key of --tls-cert")
    flag(g, "--tls-ca", "--ssl-ca-certs", help="PEM CA bundle peers must chain to (enables TLS on outgoing channels)")
    flag(g, "--tls-require-client-cert", type=bool, default=defaults(TLSConfig).require_client_cert,
         help="mutual TLS: refuse peers without a certificate from --tls-ca")
    flag(g, "--tls-server-name", help="name peers' certificates must carry, when it is not the address's host")


def tls_from_env() -> TLSConfig:
    """The TLS config of a process given no flags: what the BATON_TLS_* variables say (what
    compose sets per container; the health check in the same container uses it)."""
    p = argparse.ArgumentParser(add_help=False)
    add_tls_args(p)
    return tls_from_args(p.parse_args([]))


def tls_from_args(args: argparse.Namespace) -> TLSConfig:
    tls = TLSConfig(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca,
                    require_client_cert=getattr(args, "tls_require_client_cert",   # (a client has none)
                                                defaults(TLSConfig).require_client_cert),
                    server_name=args.tls_server_name)
    tls.validate()
    return tls


# -- bearer tokens --------------------------------------------------------------------------------
def load_tokens(token: str | None, token_file: str | None) -> dict[str, str]:
    """token -> client name. A file holds one `client:token` (or bare `token`) per line; `#`
    starts a comment. A bare token's client is its line number ("client-3")."""
    tokens: dict[str, str] = {}
    if token:
        tokens[token] = "default"
    if token_file:
        for n, raw in enumerate(Path(token_file).read_text().splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            client, sep, secret = line.rpartition(":")
            client = client.strip() if sep else f"client-{n}"
            secret = secret.strip()
            if len(secret) < 16:
                raise ValueError(f"{token_file}:{n}: tokens must be at least 16 characters")
            tokens[secret] = client
    if token is not None and len(token) < 16:
        raise ValueError("--auth-token must be at least 16 characters")
    return tokens


def bearer(metadata) -> str | None:
    for key, value in metadata or ():
        if key == AUTH_HEADER and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer "):].strip()
    return None


class TokenAuth(grpc.aio.ServerInterceptor):
    """Refuses every RPC (but health and reflection) without a known bearer token."""

    def __init__(self, tokens: dict[str, str]):
        self.tokens = tokens

    def client_of(self, metadata) -> str | None:
        """The client a request's token names, or None if it has no known token."""
        presented = bearer(metadata)
        if presented is None:
            return None
        found = None
        for token, client in self.tokens.items():       # constant time in the token's content
            if hmac.compare_digest(token.encode(), presented.encode()):
                found = client
        return found

    async def intercept_service(self, continuation, details):
        if details.method.startswith(OPEN_SERVICES + OWN_AUTH_SERVICES) or \
                self.client_of(details.invocation_metadata):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        reason = ("missing bearer token: send metadata 'authorization: Bearer <token>'"
                  if bearer(details.invocation_metadata) is None else "unknown bearer token")

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

        async def refuse_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
            yield  # pragma: no cover  (makes this an async generator, as the handler kind needs)

        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                refuse_stream, handler.request_deserializer, handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(refuse, handler.request_deserializer,
                                                   handler.response_serializer)
