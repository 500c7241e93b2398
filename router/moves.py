"""Moving a running stream to another worker with its KV, no prefix recomputed: what happens to
the streams of a worker that switches role (decode_service/server.py, SwitchRole).

A worker reporting `switching_to` (router/registry.py, after every health check) has each of
this router's streams on it asked to move (`ask`): a marker in the stream's inbox, which the
stream's own task meets between two chunks (server.py's `relay` raises StreamMoving) and answers
here, in `moved_stream`, an async generator of the chunks that continue the stream:

1. a peer of the worker's role to take it, else the stream stays where it is (asked again at
   the next check; a switch whose streams cannot leave rolls back on the worker's side);
2. Pause on the worker: the stream leaves its batch with its KV packed; the reply lists every
   token it made there (the last one has no KV yet);
3. the client gets each of those tokens (what is on the bus within DRAIN_S, the rest from the
   reply), and from here on the router makes the text (migration.Ledger);
4. Admit on the peer with the continuation (every token but the last is its prompt, whose KV
   comes; the last is its first token), and Export on the worker pushes the KV there;
5. the peer joins it and decodes; its first chunk re-sends that last token, dropped here.

A failure in 4-5 raises MoveFailed: the stream then migrates the old way, by recompute (server.py's
`_route`); one before 2 leaves the stream where it was. Both workers free the request's blocks
exactly once whatever happens: the worker's when Pause takes the stream out (the packed copy
goes with Export or its Abort), the peer's as for any admitted request.
"""
from __future__ import annotations

import asyncio
import logging

import grpc

from baton.router.registry import Worker, kv_backend
from baton.router.token_bus import SUBSCRIBER, BusBroken, Inbox, MoveAsked
from baton.serving.wire import sampling_to_proto, timeout_ms
from baton.v1 import decode_pb2, router_pb2

log = logging.getLogger("baton.router")
PAUSE_TIMEOUT_S = 10.0
DRAIN_S = 1.0          # the paused worker's last chunks: waited for this long on the bus, then taken from Pause


class StreamMoving(Exception):
    """A move was asked of the stream relayed from `worker` (its attempt `worker_id`, its `inbox`)."""

    def __init__(self, worker: Worker, inbox: Inbox, worker_id: str):
        super().__init__(f"request {worker_id} on {worker.address} is asked to move")
        self.worker, self.inbox, self.worker_id = worker, inbox, worker_id


class MoveFailed(Exception):
    """The stream left its worker but could not go on with its KV: it migrates by recompute."""

    def __init__(self, worker: Worker, why: str):
        super().__init__(f"{worker.role} worker {worker.address} switches role; moving the stream with its KV "
                         f"failed ({why})")
        self.code, self.worker = grpc.StatusCode.UNAVAILABLE, worker


def ask(svc, w: Worker) -> int:
    """Ask each of this router's streams relayed from `w` to move (once, until that is settled);
    returns how many were asked."""
    asked = 0
    for active in list(svc.active.values()):
        wid = active.relaying
        if active.moving or active.finished or w.bus is None or wid != active.worker_id or \
                not any(c is w and cid == wid for c, cid in active.calls):
            continue
        inbox = w.bus.inbox(wid)
        if inbox is not None:
            active.moving = True
            inbox.put(MoveAsked())
            asked += 1
    return asked


async def moved_stream(svc, active, ledger, moving: StreamMoving, deadline: float, tried: set[str]):
    """The chunks that continue `active`'s stream once its worker was asked to let it go (steps 1-5)."""
    w, inbox, old = moving.worker, moving.inbox, moving.worker_id
    reply = None
    try:
        if svc.registry.healthy(w.role, tried | {w.address}):
            reply = await w.decode_stub.Pause(decode_pb2.PauseRequest(request_id=old), timeout=PAUSE_TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:
        log.info("request %s: pausing it on %s failed (%s); it stays there", active.request_id, w.address,
                 exc.code().name)
    if reply is None or not reply.paused:         # it stays: relay on (asked again at the next check)
        active.moving = False
        if reply is not None and reply.reason:
            log.debug("request %s cannot move from %s now: %s", active.request_id, w.address, reply.reason)
        async for chunk in _stay(svc, active, inbox, w, old, deadline):
            yield chunk
        return
    try:
        async for chunk in _hand_over(svc, active, ledger, w, inbox, old, list(reply.output_token_ids), deadline):
            yield chunk
    except BaseException:
        svc.forget(active, old)                  # its Abort there drops the packed copy
        raise
    async for chunk in _continue(svc, active, ledger, w, old, deadline, tried):
        yield chunk


async def _stay(svc, active, inbox: Inbox, w: Worker, wid: str, deadline: float):
    try:
        async for chunk in svc.relay(active, None, inbox, w, deadline):
            yield chunk
    except StreamMoving:
        inbox = None
        raise
    finally:
        if inbox is not None:
            w.bus.unregister(wid)


async def _hand_over(svc, active, ledger, w: Worker, inbox: Inbox, old: str, made: list[int], deadline: float):
    """Step 3: every token the paused worker made reaches the client (and the ledger)."""
    loop = asyncio.get_running_loop()
    have, drain_by = len(ledger.tokens) - active.base, loop.time() + DRAIN_S
    try:
        while have < len(made):
            try:
                chunk = await inbox.next(min(deadline, drain_by))
            except (TimeoutError, BusBroken, MoveAsked):
                break
            if chunk.error_code or chunk.finish_reason:
                break
            have += len(chunk.token_ids)
            yield chunk
    finally:
        w.bus.unregister(old)
    if ledger.tokens[active.base:] != made[:have]:
        raise MoveFailed(w, f"the client got tokens {ledger.tokens[active.base:][:8]}... where the worker made "
                            f"{made[:8]}...")
    ledger.take_over_text()
    if have < len(made):
        yield decode_pb2.TokenChunk(token_ids=made[have:])


async def _continue(svc, active, ledger, w: Worker, old: str, deadline: float, tried: set[str]):
    """Steps 4-5: the peer takes the KV and goes on; the stream relays from it. `old`: the stream's
    id on `w`, done there once its KV is pushed (or will not be)."""
    loop = asyncio.get_running_loop()
    peers = svc.registry.healthy(w.role, tried | {w.address})
    if not peers:
        svc.forget(active, old)
        raise MoveFailed(w, f"no other {w.role} worker is healthy now")
    prompt, params = ledger.continuation()
    policy = svc.decode_policy if w.role == "decode" else svc.colocated_policy
    d = policy.pick(peers, prompt)
    active.attempt += 1
    wid = active.worker_id
    svc.use(active, d)
    timeout = max(0.0, min(svc.cfg.first_token_timeout, deadline - loop.time()))
    inbox = None
    try:
        inbox = await d.bus.register(wid, timeout)
        admit = await d.decode_stub.Admit(decode_pb2.AdmitRequest(
            request_id=wid, prompt_token_ids=prompt, sampling=sampling_to_proto(params), backend=kv_backend(w, d),
            timeout_ms=timeout_ms(timeout), subscriber=SUBSCRIBER,
            stream_timeout_ms=timeout_ms(deadline - loop.time())), timeout=timeout)
        sent = await w.decode_stub.Export(decode_pb2.ExportRequest(
            request_id=old, kv_address=admit.kv_address or d.address, transfer_id=admit.transfer_id,
            backend=admit.backend, timeout_ms=timeout_ms(timeout)), timeout=timeout)
        svc.forget(active, old)
        first = await inbox.next(deadline, loop.time() + timeout)
        if first.error_code:
            raise MoveFailed(w, f"{d.address} could not take its KV: {first.error_message}")
        if not first.token_ids or first.token_ids[0] != ledger.tokens[-1]:
            raise MoveFailed(w, f"{d.address} went on from token {list(first.token_ids[:1])}, not "
                                f"{ledger.tokens[-1]}")
    except BaseException as exc:
        svc.forget(active, old)                  # (once: a no-op when it is done)
        if inbox is not None:
            d.bus.unregister(wid)
        if isinstance(exc, (grpc.aio.AioRpcError, BusBroken, TimeoutError)):
            why = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else f"{exc!r}"
            raise MoveFailed(w, f"to {d.address}: {why}") from None
        raise
    active.base, ledger.moves = len(ledger.tokens) - 1, ledger.moves + 1
    svc.count_migration("moved")
    log.info("request %s moved from %s to %s with its KV (%d tokens, %d bytes in %.0f ms)", active.request_id,
             w.address, d.address, len(ledger.tokens), sent.transfer_bytes, sent.transfer_seconds * 1e3)
    del first.token_ids[0]                        # the client has it: the last token made on `w`
    if len(first.logprobs):
        del first.logprobs[0]
    active.moving = False
    first = first if first.token_ids or first.finish_reason != router_pb2.FINISH_REASON_UNSPECIFIED else None
    try:
        async for chunk in svc.relay(active, first, inbox, d, deadline):
            yield chunk
    except StreamMoving:
        inbox = None
        raise
    finally:
        if inbox is not None:
            d.bus.unregister(wid)
