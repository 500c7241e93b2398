"""The router's operators' service, `baton.v1.Admin` (protos/baton/v1/admin.proto; the CLI: `baton
role`): switching a worker's role in place. Each call carries the --admin-token as a bearer token;
without one configured, every call is refused. The router passes the call on to the worker
(Decode.SwitchRole, with the same token) and, while the worker switches, checks it every
POLL_S so that its streams start moving at once (router/moves.py) rather than at the next round
of health checks; once it answers, the router routes it work of its new role. Other routers
follow by their own checks: the worker reports its new role. A switch that would leave the router
no healthy worker to prefill or none to decode is refused before the worker is asked.
"""
from __future__ import annotations

import asyncio
import time

import grpc

from baton.router.registry import Worker
from baton.serving.grpc_server import ServiceError, check_admin
from baton.serving.server_config import ROLES
from baton.v1 import admin_pb2, admin_pb2_grpc, decode_pb2

SWITCH_TIMEOUT_S = 60.0
POLL_S = 0.1
ANSWER_SLACK_S = 10.0           # the worker rolls back at its timeout, and says so within this


def find_worker(workers: list[Worker], address: str) -> Worker:
    found = [w for w in workers if w.address == address or (w.target == address and not w.retired)]
    if len(found) != 1:
        known = ", ".join(f"{w.address} ({w.role})" for w in workers) or "none"
        what = "is no worker of this router" if not found else "names several workers: give one address"
        raise ServiceError(grpc.StatusCode.NOT_FOUND, f"{address!r} {what}; its workers: {known}")
    return found[0]


def empties_a_role(workers: list[Worker], w: Worker, role: str) -> str | None:
    """Why switching `w` to `role` would leave this router no healthy worker to prefill, or none to decode
    (a colocated worker does both), so that no request could be served; None where it would not."""
    others = [o for o in workers if o is not w and o.healthy and not o.retired]
    for verb, roles in (("decodes", ("decode", "colocated")), ("prefills", ("prefill", "colocated"))):
        if w.role in roles and role not in roles and not any(o.role in roles for o in others):
            return (f"worker {w.address} ({w.role}) is this router's only healthy worker that {verb}: as "
                    f"{role} it would leave no request servable. Start or switch another worker to "
                    f"{' or '.join(roles)} first")
    return None


async def switch_role(svc, req: admin_pb2.AdminSwitchRoleRequest, metadata) -> admin_pb2.AdminSwitchRoleResponse:
    check_admin(svc.cfg.admin_token, metadata)
    if req.role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {req.role!r}")
    w = find_worker(svc.registry.workers, req.worker)
    if not w.status.switchable:
        raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, (
            f"worker {w.address} ({w.role}) cannot change role in place: decode workers can (`baton decode`, "
            f"any role); a prefill worker started by `baton prefill` cannot"))
    emptied = empties_a_role(svc.registry.workers, w, req.role)
    if emptied:
        raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, emptied)
    timeout = req.timeout_ms / 1000 if req.timeout_ms else SWITCH_TIMEOUT_S
    t0 = time.monotonic()
    call = asyncio.ensure_future(w.decode_stub.SwitchRole(
        decode_pb2.SwitchRoleRequest(role=req.role, timeout_ms=int(timeout * 1000)),
        metadata=(("authorization", f"Bearer {svc.cfg.admin_token}"),), timeout=timeout + ANSWER_SLACK_S))
    try:
        while not call.done():
            await asyncio.wait({call}, timeout=POLL_S)
            await svc.registry.check(w)          # switching_to: its streams are asked to move (moves.ask)
        reply = call.result()
    except grpc.aio.AioRpcError as exc:
        outcome = "rolled_back" if exc.code() == grpc.StatusCode.ABORTED else "refused"
        _record(svc, outcome, time.monotonic() - t0)
        raise ServiceError(exc.code(), f"switching {w.address} to {req.role}: {exc.details()}") from None
    finally:
        call.cancel()
    await svc.registry.check(w)                  # its new role, routed now
    _record(svc, "switched", time.monotonic() - t0)
    return admin_pb2.AdminSwitchRoleResponse(worker=w.address, from_role=reply.from_role, to_role=reply.to_role,
                                             seconds=reply.seconds, streams_moved=reply.streams_moved)


def _record(svc, outcome: str, seconds: float) -> None:
    if svc.metrics:
        svc.metrics.role_switches.labels(outcome).observe(seconds)


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, svc):
        self.svc = svc

    async def SwitchRole(self, request, context):
        return await switch_role(self.svc, request, context.invocation_metadata())
