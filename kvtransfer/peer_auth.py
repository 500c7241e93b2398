"""KV peers prove a shared secret before a byte of KV moves.

With `--kv-secret-file` (or BATON_KV_SECRET) on both ends, the handshake is a mutual HMAC
challenge: the prefill worker sends a fresh nonce, the time and HMAC(secret, nonce, time,
layout); the decode worker checks it (clock skew within SKEW_S, nonce never seen before), then
answers with a session token and HMAC(secret, nonce, session) proving it holds the secret too.
Every Push stream carries the session token in its metadata; a Push without a valid one is
refused with UNAUTHENTICATED before any of its messages is read, so a stranger can neither
write into nor fail a transfer it guessed the id of. Session tokens are HMACs under a key that
lives only in the decode process: a restarted decode worker asks its peers to handshake again.

The secret authenticates peers; it does not encrypt. Run the KV channel over TLS (the workers'
--tls-* flags) where the network is not trusted.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import time
from pathlib import Path

SESSION_KEY = "baton-kv-session"      # Push metadata key carrying the session token (hex)
SKEW_S = 120.0                        # largest accepted clock difference between the two hosts
NONCE_BYTES = 16
MIN_SECRET_BYTES = 16
_SEEN_CAP = 100_000                   # nonces remembered for replay checks (pruned by age first)


class PeerAuthError(Exception):
    """A peer did not prove the shared secret (or proved a different one)."""


def load_secret(secret: str | None, secret_file: str | None) -> bytes | None:
    """The secret from --kv-secret-file (first line) or a literal; None when neither is set."""
    if secret_file:
        try:
            text = Path(secret_file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"--kv-secret-file {secret_file}: {exc.strerror or exc}") from None
        if not text:
            raise ValueError(f"{secret_file}: the KV secret file is empty")
        secret = text.splitlines()[0].strip()
    if secret is None or secret == "":
        return None
    if len(secret.encode()) < MIN_SECRET_BYTES:
        raise ValueError(f"the KV shared secret must be at least {MIN_SECRET_BYTES} bytes "
                         f"(generate one with: openssl rand -hex 32)")
    return secret.encode()


def _mac(secret: bytes, *parts: bytes) -> bytes:
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    return h.digest()


class KVPeerAuth:
    """Both halves of the handshake for one process; the decode side also checks sessions."""

    def __init__(self, secret: bytes):
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the KV shared secret must be at least {MIN_SECRET_BYTES} bytes")
        self.secret = secret
        self._session_key = os.urandom(32)        # this process's sessions only
        self._seen: dict[bytes, float] = {}        # nonce -> when it stops mattering

    # -- prefill side --------------------------------------------------------------------
    def hello(self, layout_bytes: bytes) -> tuple[bytes, int, bytes]:
        """(nonce, unix_ms, proof) for a HandshakeRequest."""
        nonce = os.urandom(NONCE_BYTES)
        unix_ms = int(time.time() * 1000)
        return nonce, unix_ms, _mac(self.secret, b"hello", nonce, str(unix_ms).encode(), layout_bytes)

    def check_reply(self, nonce: bytes, session: bytes, proof: bytes) -> None:
        if not session or not proof:
            raise PeerAuthError("the decode worker did not answer the KV secret challenge: it runs without "
                                "--kv-secret-file, or is not a Baton decode worker")
        if not hmac.compare_digest(proof, _mac(self.secret, b"reply", nonce, session)):
            raise PeerAuthError("the decode worker answered the KV secret challenge wrongly: the two ends "
                                "hold different --kv-secret-file contents")

    # -- decode side ---------------------------------------------------------------------
    def accept(self, nonce: bytes, unix_ms: int, proof: bytes, layout_bytes: bytes) -> tuple[bytes, bytes]:
        """Checks a hello; returns (session, proof) for the HandshakeResponse."""
        if not proof:
            raise PeerAuthError("this decode worker requires the KV shared secret: start the prefill worker "
                                "with the same --kv-secret-file (or BATON_KV_SECRET)")
        if len(nonce) != NONCE_BYTES:
            raise PeerAuthError(f"the KV handshake nonce must be {NONCE_BYTES} bytes, got {len(nonce)}")
        if not hmac.compare_digest(proof, _mac(self.secret, b"hello", nonce, str(unix_ms).encode(), layout_bytes)):
            raise PeerAuthError("the KV handshake proof is wrong: the prefill worker holds a different "
                                "--kv-secret-file")
        now = time.time()
        if abs(now - unix_ms / 1000) > SKEW_S:
            raise PeerAuthError(f"the KV handshake is {abs(now - unix_ms / 1000):.0f}s away from this host's "
                                f"clock (at most {SKEW_S:.0f}s accepted): synchronize the clocks")
        self._remember(nonce, now)
        session = os.urandom(16)
        session += _mac(self._session_key, session)[:16]
        return session, _mac(self.secret, b"reply", nonce, session)

    def session_valid(self, session: bytes) -> bool:
        if len(session) != 32:
            return False
        return hmac.compare_digest(session[16:], _mac(self._session_key, session[:16])[:16])

    def _remember(self, nonce: bytes, now: float) -> None:
        if nonce in self._seen:
            raise PeerAuthError("the KV handshake replays an earlier one (its nonce was seen before)")
        if len(self._seen) >= _SEEN_CAP:
            self._seen = {n: t for n, t in self._seen.items() if t > now}
            while len(self._seen) >= _SEEN_CAP:           # still full: forget the oldest
                self._seen.pop(next(iter(self._seen)))
        self._seen[nonce] = now + 2 * SKEW_S


def session_of(metadata) -> bytes:
    for key, value in metadata or ():
        if key == SESSION_KEY:
            try:
                return bytes.fromhex(value if isinstance(value, str) else value.decode())
            except ValueError:
                return b""
    return b""
