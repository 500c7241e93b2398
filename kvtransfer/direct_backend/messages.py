"""The direct backend's control protocol: message aliases, limits, and the small helpers both
ends use to say and read why a transfer ended."""
from __future__ import annotations

import grpc

from baton.v1 import kvtransfer_pb2

Code = grpc.StatusCode
Ack = kvtransfer_pb2.DirectAck
Msg = kvtransfer_pb2.DirectMessage
BACKEND = "direct"
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")
HELLO_TIMEOUT_S = 10.0         # the receiver waits this long for a control stream's first message
MAX_PAIRS = 64                 # communicators one decode worker keeps (oldest idle ones closed first)
PAIR_IDLE_S = 600.0            # a pair unused this long is closed (its sender reconnects when it returns)


def refused(tid: str, code: grpc.StatusCode, reason: str) -> Ack:
    return Ack(kind=Ack.KIND_REFUSED, transfer_id=tid, reason=reason, code=code.value[0])


def strings(extra: dict | None) -> dict[str, str]:
    return {k: str(v) for k, v in (extra or {}).items()}


def status_code(number: int) -> grpc.StatusCode:
    return next((c for c in grpc.StatusCode if c.value[0] == number), Code.UNKNOWN)


