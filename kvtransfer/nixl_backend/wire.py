"""The nixl backend's control stream: one `baton.v1.KVNixl/Transfer` stream per transfer, small
JSON messages (no proto: the bytes move through NIXL, the stream only says where and when).

    prefill -> decode                          decode -> prefill
    {"open": tid, "nbytes": n, "agent": name,  {"ready": {"md", "addr", "dev", "mem"[, "pages",
     "pages": true (it can write in place)}      "stride"]}}: md is the agent metadata to load; with
                                               pages, addr is the KV cache of `stride` blocks and
                                               pages the transfer's block ids (write in place);
                                               without, addr is a buffer staged for the transfer
    (bytes: NIXL writes, each piece's then {"writing": its bytes}; then a NIXL notification
     {"tid", "first_token", "extra", "blocks"}, then {"written": true})
                                               {"done": true}: landed, the decode engine has it
    (writing / written are hints: the decode side polls UCX closely for a while, not at its idle
     polling's pace: a write's completion may need its progress, the notification its look)
    {"abandon": reason, "quiet": bool}         {"refused": reason, "code": n}, then the status
    (quiet: none of its writes is in flight, so what they went into may be reused at once)

A stream may instead carry a warm-up, before the sender's first transfer to this peer:
    {"warm": agent name}                       {"md": the agent metadata of the registered KV
                                                cache, base64; "" where transfers are staged}

Ending the stream early (a cancel, the sender's death) fails the transfer on the decode side.
"""
from __future__ import annotations

import base64
import json
import sys
import time

import grpc

from baton import environment

SERVICE = "baton.v1.KVNixl"
TRANSFER_METHOD = f"/{SERVICE}/Transfer"
Code = grpc.StatusCode


TRACE = bool(environment.KV_TRACE.get())     # each transfer's milestones on stderr, both sides


def trace(what: str, tid: str) -> None:
    """With BATON_KV_TRACE=1: `TRACE <monotonic ms> <side> <milestone> <transfer>`, the prefill (S)
    and decode (R) sides on one clock, to see where a transfer's fixed cost goes."""
    if TRACE:
        print(f"TRACE {time.monotonic() * 1e3:.3f} {what} {tid}", file=sys.stderr, flush=True)


def encode(msg: dict) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode()


def decode(raw: bytes) -> dict:
    """A control message; anything but a JSON object becomes {"garbled": ...}, which both ends refuse."""
    try:
        msg = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return {"garbled": str(exc)}
    return msg if isinstance(msg, dict) else {"garbled": f"a {type(msg).__name__}, not an object"}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def code_of(number: int) -> grpc.StatusCode:
    return next((c for c in grpc.StatusCode if c.value[0] == number), Code.UNKNOWN)
