"""`python -m baton.serving.healthcheck ADDR`: exit 0 when the server at ADDR reports SERVING.

Used by docker-compose healthchecks; works for the router and every worker, over TLS when
the BATON_TLS_* variables configure it (as they do for the server in the same container).
"""
from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.serving.grpc_server import open_sync_channel
from baton.serving.security import tls_from_env


def check(address: str, timeout: float = 3.0) -> bool:
    with open_sync_channel(address, tls_from_env()) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m baton.serving.healthcheck HOST:PORT")
    sys.exit(0 if check(sys.argv[1]) else 1)
