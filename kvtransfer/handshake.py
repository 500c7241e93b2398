"""The handshake every backend starts with, both halves: the prefill side asks
`baton.v1.KVTransfer/Handshake` (layout, and with a KV secret the mutual HMAC of peer_auth.py),
the decode side answers it. Whatever backend then moves the bytes, its services check the
session the handshake handed out (`Handshaken.metadata`).
"""
from __future__ import annotations

from dataclasses import dataclass

import grpc

from baton.kvtransfer.backend import KVTransferError
from baton.kvtransfer.layout import KVLayout, KVLayoutMismatch, check_compatible
from baton.kvtransfer.peer_auth import SESSION_KEY, KVPeerAuth, PeerAuthError
from baton.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc

Code = grpc.StatusCode


@dataclass(frozen=True, slots=True)
class Handshaken:
    """What the prefill side learnt: the peer's layout, and the limits and session it granted."""

    peer: KVLayout
    metadata: tuple[tuple[str, str], ...] = ()   # call metadata proving the session (empty: no secret)
    max_chunk_bytes: int = 0
    max_window_bytes: int = 0


async def handshake(channel: grpc.aio.Channel, address: str, layout: KVLayout, auth: KVPeerAuth | None,
                    timeout: float = 10.0, backend: str | None = None) -> Handshaken:
    """Prefill side. Raises KVTransferError: FAILED_PRECONDITION naming every differing field (or
    a peer without `backend`), UNAUTHENTICATED on a secret mismatch, the RPC's code otherwise."""
    request = kvtransfer_pb2.HandshakeRequest(layout=layout.to_proto())
    if auth is not None:
        request.nonce, request.unix_ms, request.proof = auth.hello(request.layout.SerializeToString(deterministic=True))
    try:
        reply = await kvtransfer_pb2_grpc.KVTransferStub(channel).Handshake(request, timeout=timeout)
        if auth is not None:
            auth.check_reply(request.nonce, reply.session, reply.proof)
        peer = KVLayout.from_proto(reply.layout)
        check_compatible(layout, peer, local_role="prefill", remote_role="decode")
    except grpc.aio.AioRpcError as exc:
        raise KVTransferError(f"KV handshake with {address} failed: {exc.details()}", exc.code()) from exc
    except PeerAuthError as exc:
        raise KVTransferError(f"KV handshake with {address}: {exc}", Code.UNAUTHENTICATED) from exc
    except ValueError as exc:                   # an unusable or mismatching layout in the reply
        raise KVTransferError(f"KV handshake with {address}: {exc}", Code.FAILED_PRECONDITION) from exc
    if backend is not None and backend not in peer.backends:
        raise KVTransferError(f"the decode worker at {address} does not take {backend} KV (it speaks "
                              f"{peer.backends}); start both workers with --kv-backend {backend}",
                              Code.FAILED_PRECONDITION)
    metadata = ((SESSION_KEY, reply.session.hex()),) if reply.session else ()
    return Handshaken(peer, metadata, reply.max_chunk_bytes, reply.max_window_bytes)


async def answer(local: KVLayout, auth: KVPeerAuth | None, request: kvtransfer_pb2.HandshakeRequest, context,
                 max_chunk_bytes: int = 0, max_window_bytes: int = 0) -> kvtransfer_pb2.HandshakeResponse:
    """Decode side: check the prefill worker's layout (and secret); abort the RPC with a status
    that says what to change, or answer with our layout and a session."""
    try:
        remote = KVLayout.from_proto(request.layout)
    except ValueError as exc:
        await context.abort(Code.INVALID_ARGUMENT, f"the prefill worker sent an unusable KV layout: {exc}")
    session = proof = b""
    if auth is not None:              # the secret first: a stranger learns nothing, not even our layout
        try:
            session, proof = auth.accept(request.nonce, request.unix_ms, request.proof,
                                         request.layout.SerializeToString(deterministic=True))
        except PeerAuthError as exc:
            await context.abort(Code.UNAUTHENTICATED, str(exc))
    try:
        check_compatible(local, remote)
    except KVLayoutMismatch as exc:
        await context.abort(Code.FAILED_PRECONDITION, str(exc))
    return kvtransfer_pb2.HandshakeResponse(layout=local.to_proto(), max_chunk_bytes=max_chunk_bytes,
                                            max_window_bytes=max_window_bytes, session=session, proof=proof)
