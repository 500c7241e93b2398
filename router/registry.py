"""The router's view of its workers: targets from flags/env, kept fresh by DNS and health checks.

A target is HOST:PORT. An IP address is one worker. A name is a set of workers, one per
address it resolves to, and it is resolved again every --resolve-interval seconds: a compose
service scaled up or down, or a Kubernetes headless Service, changes the set without a
restart. A new address joins once its health check passes; an address gone from DNS is
retired: it takes no new request, and its channel closes when its last stream has ended.

A worker that fails a health check, a status call or a real request is marked unhealthy at
once and leaves rotation; the checker keeps probing it and a recovered worker returns. One that
stops answering (a hang: the check times out), is gone (unreachable), or whose engine core has
been stalled for HANG_GRACE_S (silent, or that long past the budget of the step it is in: the
worker judges its own steps against their expected cost, serving/worker/core_client.py) is also *lost*:
what this router runs there is taken away at once (its token bus is closed, so its streams
migrate; attempts waiting on it fail over), and a hang is counted apart from a death. A worker
that is merely busy (one long prompt on a CPU) is neither: it stays in rotation, and routing
weighs the work queued there. A draining worker is out of rotation; its streams finish there, or,
on a worker that can move them (a decode worker), move to peers with their KV.

A worker whose role may change in place (`switchable`, a decode worker) is followed: the role it
reports is the one it gets work for. While it reports `switching_to`, or drains, it gets none, and
`on_switching` hears of it after every check (the router moves its streams off it with their KV,
router/moves.py: a drain ends as soon as they have moved, not when they finish).
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.kvtransfer import registry as kv_registry
from baton.router.token_bus import TokenBus
from baton.serving.grpc_server import CHANNEL_OPTIONS, open_channel
from baton.serving.security import TLSConfig
from baton.v1 import decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, worker_pb2

log = logging.getLogger("baton.router")
CHECK_INTERVAL_S = 0.5                # with the timeout: a hung worker is left within ~2 s
CHECK_TIMEOUT_S = 1.5
# An engine core reported stalled for HANG_GRACE_S is hung. A running stream with no token for
# max(STALL_FLOOR_S, STALL_STEPS x step p99) moves, unless a step in progress there explains the
# wait; the cap bounds what one slow (or stopped) step does to the p99 the limit scales with.
HANG_GRACE_S = 5.0
STALL_FLOOR_S, STALL_STEPS, STALL_CAP_S = 10.0, 20, 30.0
RESOLVE_INTERVAL_S = 5.0
WAIT_POLL_S = 0.05
KV_WARM_TIMEOUT_S = 60.0              # one pair's KV warm-up (a device pair's communicator may take seconds)
KV_WARM_RETRY_S = 10.0                # a pair whose warm-up failed is tried again after this


def split_target(target: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port); a clear error for anything else."""
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"worker address {target!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


async def resolve_target(target: str) -> list[str]:
    """The worker addresses behind a target: itself for an IP, else every address its name
    resolves to now (IPv4 when there is any: 'localhost' is one worker, not two)."""
    host, port = split_target(target)
    if is_ip(host):
        return [target]
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    v4 = sorted({i[4][0] for i in infos if i[0] == socket.AF_INET})
    v6 = sorted({i[4][0] for i in infos if i[0] == socket.AF_INET6})
    return [f"{ip}:{port}" for ip in v4] or [f"[{ip}]:{port}" for ip in v6]


@dataclass(slots=True)
class Worker:
    address: str
    role: str                                     # prefill | decode | colocated (what it serves now)
    target: str = ""                              # the configured HOST:PORT it was found through
    channel: grpc.aio.Channel | None = None
    stub: object = None                           # the stub of its role now (status, metrics, its token bus)
    # Its Prefill and Decode services' stubs, whatever its role (a switchable worker serves both):
    # a request's calls of one role go through these, not `stub`, for the worker may switch role
    # between the router's pick and the call; it then answers FAILED_PRECONDITION, retried elsewhere.
    prefill_stub: object = None
    decode_stub: object = None
    health: object = None
    healthy: bool = False
    status: worker_pb2.WorkerStatus = field(default_factory=worker_pb2.WorkerStatus)
    inflight: int = 0                             # requests this router has sent and not finished
    inflight_tokens: int = 0                      # ...and their prompt tokens (the work queued there)
    last_error: str = ""
    last_seen: float = 0.0
    retired: bool = False                         # gone from DNS: no new requests, closed once idle
    bus: TokenBus | None = None                   # decode / colocated: this router's token stream from it
    lost: asyncio.Event = field(default_factory=asyncio.Event)   # set while lost (hung, dead): attempts give up

    def connect(self, tls: TLSConfig | None = None) -> None:
        host = split_target(self.target)[0] if self.target else ""
        options = None
        if tls is not None and tls.enabled and not tls.server_name and host and not is_ip(host):
            # dialled by IP, verified as the name it was configured by (the name the cert carries)
            options = [*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", host)]
        self.channel = open_channel(self.address, tls, options)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.prefill_stub = prefill_pb2_grpc.PrefillStub(self.channel)
        self.decode_stub = decode_pb2_grpc.DecodeStub(self.channel)
        self._serve_role()

    def _serve_role(self) -> None:
        """The stub (and, for the roles that stream, the token bus) of its role now."""
        self.stub = self.prefill_stub if self.role == "prefill" else self.decode_stub
        if self.role != "prefill" and self.bus is None:
            self.bus = TokenBus(self.stub, self.address)

    def adopt_role(self, role: str) -> None:
        """It switched role in place (it reports `switchable`): route it work of its new role."""
        log.info("worker %s now serves the %s role (was %s)", self.address, role, self.role)
        self.role = role
        self._serve_role()

    def load(self) -> int:
        return max(self.inflight, self.status.running + self.status.waiting)

    def kv_free_fraction(self) -> float:
        total = self.status.kv_blocks_total
        return self.status.kv_blocks_free / total if total else 0.0

    def mark_down(self, reason: str) -> None:
        if self.healthy:
            log.warning("worker %s (%s) marked unhealthy: %s", self.address, self.role, reason)
        self.healthy = False
        self.last_error = reason

    def abandon(self, reason: str) -> None:
        """It stopped answering or died: take away what runs there (its streams migrate)."""
        self.mark_down(reason)
        self.lost.set()
        if self.bus is not None:
            self.bus.close(f"{self.role} worker {self.address} {reason}")

    def hang_limit(self) -> float:
        """Seconds its engine may be reported stalled before it counts as hung."""
        return HANG_GRACE_S

    def busy_for(self) -> float:
        """Seconds its engine has been in its current step, as of the last status (0: idle, or
        not within that step's budget: a stalled step explains nothing)."""
        s = self.status
        if not self.healthy or s.stalled_seconds > 0:
            return 0.0
        return s.busy_seconds + (time.monotonic() - self.last_seen if self.last_seen else 0.0)

    def expected_wait(self) -> float:
        """Seconds the work this router queued here should take (prompt tokens x the worker's
        recent time per token); the token count where the worker has not measured one yet."""
        per_token = self.status.seconds_per_token
        return self.inflight_tokens * per_token if per_token > 0 else float(self.inflight_tokens)

    def stall_limit(self) -> float:
        """Seconds a running stream here may go without a token before it moves elsewhere (a stuck
        stream the health checks cannot see; a preempted one waiting for memory may move too)."""
        return min(STALL_CAP_S, max(STALL_FLOOR_S, STALL_STEPS * self.status.step_p99_ms / 1e3))


class Registry:
    def __init__(self, prefill: list[str], decode: list[str], colocated: list[str], model: str,
                 tls: TLSConfig | None = None, resolve_interval: float = RESOLVE_INTERVAL_S):
        self.model = model
        self.tls = tls
        self.resolve_interval = resolve_interval
        self.targets = [(a, "prefill") for a in prefill] + [(a, "decode") for a in decode] + [
            (a, "colocated") for a in colocated]
        if not self.targets:
            raise ValueError("no workers configured: give --prefill and --decode, or --colocated")
        if bool(prefill) != bool(decode):
            raise ValueError("disaggregated serving needs both --prefill and --decode workers")
        self.workers: list[Worker] = []
        self.on_lost: Callable[[Worker, str], None] | None = None     # (worker, "hung" | "dead"): metrics
        self.on_checked: Callable[[list[Worker]], None] | None = None  # after each round of checks: KVPairs
        self.on_switching: Callable[[Worker], None] | None = None    # a worker reports switching_to: move streams
        self.prefix_index = None          # --policy kv_aware: router/prefix_index.py, refreshed after each check
        self._unresolved: dict[str, str] = {}         # target -> the error last logged for it
        self._task: asyncio.Task | None = None

    def healthy(self, role: str, exclude: set[str] = frozenset()) -> list[Worker]:
        return [w for w in self.workers if w.role == role and w.healthy and not w.retired
                and not w.status.draining and not w.status.switching_to and w.address not in exclude]

    def seen_within(self, seconds: float, roles: set[str]) -> bool:
        """A worker of one of `roles` passed a health check in the last `seconds` (a pool in a gap,
        not one that never came up or went for good)."""
        now = time.monotonic()
        return any(w.last_seen and now - w.last_seen <= seconds for w in self.workers
                   if w.role in roles and not w.retired)

    async def wait_until(self, ready: Callable[[], bool], seconds: float) -> bool:
        """Up to `seconds` for the health checks to make `ready()` true; whether they did."""
        until = time.monotonic() + max(0.0, seconds)
        while not ready():
            if time.monotonic() >= until:
                return False
            await asyncio.sleep(min(WAIT_POLL_S, until - time.monotonic()))
        return True

    async def start(self) -> None:
        await self.resolve()
        await self.check_all()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        for w in self.workers:
            await w.channel.close()

    async def _loop(self) -> None:
        last_resolve = time.monotonic()
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            try:
                if self.resolve_interval > 0 and time.monotonic() - last_resolve >= self.resolve_interval:
                    last_resolve = time.monotonic()
                    await self.resolve()
                await self.check_all()
                await self._close_idle_retired()
            except Exception:                   # never let one bad round end the checks for good
                log.exception("worker registry: this round of resolving and health checks failed")

    async def resolve(self) -> None:
        """Bring the worker list in line with what every target resolves to now. A name that
        fails to resolve keeps the workers it had (a DNS hiccup drains nothing); they stay in
        rotation only while their health checks pass."""
        found = await asyncio.gather(*(resolve_target(t) for t, _ in self.targets), return_exceptions=True)
        for (target, role), addresses in zip(self.targets, found, strict=True):
            if isinstance(addresses, BaseException):
                why = f"{type(addresses).__name__}: {addresses}"
                if self._unresolved.get(target) != why:
                    log.warning("%s workers at %s: cannot resolve (%s); keeping the %d known", role, target,
                                why, sum(w.target == target and not w.retired for w in self.workers))
                self._unresolved[target] = why
                continue
            self._unresolved.pop(target, None)
            mine = {w.address: w for w in self.workers if w.target == target}     # (whatever role it serves now)
            taken = {w.address for w in self.workers if w.target != target}
            for address in addresses:
                w = mine.get(address)
                if w is None and address not in taken:
                    w = Worker(address, role, target)
                    w.connect(self.tls)
                    self.workers.append(w)
                    if target != address:
                        log.info("%s worker %s found through %s", role, address, target)
                elif w is not None and w.retired:
                    w.retired = False
                    log.info("%s worker %s is back in %s", role, address, target)
            for address, w in mine.items():
                if address not in addresses and not w.retired:
                    w.retired = True
                    log.info("%s worker %s left %s: retired, %d stream(s) to finish", role, address, target,
                             w.inflight)

    async def _close_idle_retired(self) -> None:
        for w in [w for w in self.workers if w.retired and w.inflight == 0]:
            self.workers.remove(w)
            await w.channel.close()
            log.info("%s worker %s closed", w.role, w.address)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.workers if not w.retired))
        if self.on_checked is not None:
            self.on_checked(self.workers)
    async def check(self, w: Worker) -> None:
        try:
            reply = await w.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=CHECK_TIMEOUT_S)
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                w.mark_down("health: not serving (draining?)")
                if w.status.switchable and self.on_switching is not None:
                    self.on_switching(w)            # a draining worker: its streams move on with their KV
                return
            status = await w.stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=CHECK_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            how = {grpc.StatusCode.DEADLINE_EXCEEDED: "hung", grpc.StatusCode.UNAVAILABLE: "dead"}.get(exc.code())
            reason = f"{exc.code().name}: {exc.details()}"
            if how:
                self._lose(w, how, reason)
            else:
                w.mark_down(reason)
            return
        if status.stalled_seconds > w.hang_limit():
            self._lose(w, "hung", f"its engine core made no progress for {status.stalled_seconds:.1f}s")
            return
        if status.role != w.role:
            if not status.switchable:
                w.mark_down(f"configured as {w.role} but reports role {status.role!r}")
                return
            w.adopt_role(status.role)
        if self.model and status.model != self.model:
            w.mark_down(f"serves model {status.model!r}, router serves {self.model!r}")
            return
        if not w.healthy:
            log.info("worker %s (%s) healthy", w.address, w.role)
            w.lost.clear()
        w.status, w.healthy, w.last_seen = status, True, time.monotonic()
        if self.prefix_index is not None:
            await self.prefix_index.refresh(w)
        if status.switching_to and self.on_switching is not None:
            self.on_switching(w)

    def _lose(self, w: Worker, how: str, reason: str) -> None:
        if not w.lost.is_set() and self.on_lost is not None:
            self.on_lost(w, how)
        if self.prefix_index is not None:
            self.prefix_index.drop(w.address)
        w.abandon(f"{how}: {reason}")


class KVPairs:
    """Which (prefill, decode) pairs have a warm KV channel: the prefill worker's sender to the
    decode worker opened, handshaken and set up (`Prefill.ConnectKV`: for device backends the
    pair's communicator too) before a request needs it. A cold pair's first transfer pays for all
    of that (up to 1.5 s measured on H100s, issue 49). After each round of health checks every
    healthy pair not yet warm is warmed in the background, bounded by a timeout; a worker that
    left the healthy set (restart, hang, drain) is warmed again once it is back, as is a decode
    worker whose KV address changed. Routing prefers warm pairs (server.py: _pick_pair) and never
    waits for one: a cold pair still serves when nothing else is healthy."""

    def __init__(self, backend_of: Callable[[Worker, Worker], str], timeout: float = KV_WARM_TIMEOUT_S,
                 retry_after: float = KV_WARM_RETRY_S):
        self.backend_of = backend_of              # the backend a pair hands KV off over (server.kv_backend)
        self.timeout, self.retry_after = timeout, retry_after
        self.warm: dict[tuple[str, str], tuple[str, str]] = {}    # (prefill, decode) -> (KV address, backend)
        self.warming: dict[tuple[str, str], asyncio.Task] = {}
        self.retry_at: dict[tuple[str, str], float] = {}          # pairs whose warm-up failed: when to try again
        self.seen: set[str] = set()                               # the workers healthy at the last look

    def is_warm(self, p: Worker, d: Worker) -> bool:
        return self.warm.get((p.address, d.address)) == self._channel(p, d)

    def _channel(self, p: Worker, d: Worker) -> tuple[str, str]:
        return d.status.kv_address or d.address, self.backend_of(p, d)

    def reconcile(self, workers: list[Worker]) -> None:
        """After a round of health checks: forget the pairs of workers that left or joined the
        healthy set since the last look, and start warming every healthy pair that is not warm."""
        healthy = [w for w in workers if w.healthy and not w.retired and not w.status.draining]
        now = {w.address for w in healthy}
        self._forget(now ^ self.seen)
        self.seen = now
        t = time.monotonic()
        for p in [w for w in healthy if w.role == "prefill"]:
            for d in [w for w in healthy if w.role == "decode"]:
                key = (p.address, d.address)
                if key not in self.warming and not self.is_warm(p, d) and self.retry_at.get(key, 0.0) <= t:
                    self.warming[key] = asyncio.ensure_future(self._warm(p, d))

    def _forget(self, addresses: set[str]) -> None:
        for key in [k for k in {*self.warm, *self.warming, *self.retry_at} if addresses & set(k)]:
            self.warm.pop(key, None)
            self.retry_at.pop(key, None)
            task = self.warming.pop(key, None)
            if task is not None:
                task.cancel()

    async def _warm(self, p: Worker, d: Worker) -> None:
        """One pair's ConnectKV; a failure is one line (the first time), and tried again later."""
        key, (kv_address, backend) = (p.address, d.address), self._channel(p, d)
        t0 = time.perf_counter()
        try:
            await p.prefill_stub.ConnectKV(prefill_pb2.ConnectKVRequest(
                decode_address=kv_address, backend=backend, timeout_ms=int(self.timeout * 1000)),
                timeout=self.timeout + 2.0)           # (the worker's own timeout, with its reason, first)
        except Exception as exc:
            why = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else repr(exc)
            (log.debug if key in self.retry_at else log.warning)(
                "KV pair %s -> %s (%s) not warmed: %s; it still serves, warmed again in %.0fs", p.address,
                d.address, backend or "default", why, self.retry_after)
            self.retry_at[key] = time.monotonic() + self.retry_after
            return
        finally:
            if self.warming.get(key) is asyncio.current_task():
                del self.warming[key]
        self.warm[key] = (kv_address, backend)
        self.retry_at.pop(key, None)
        log.info("KV pair %s -> %s (%s) warm in %.0f ms", p.address, d.address, backend or "default",
                 (time.perf_counter() - t0) * 1e3)


def kv_backend(sender: Worker, receiver: Worker) -> str:
    """The best KV transport both workers speak ("": let the receiving worker choose); the rules
    (preference, which backends two workers on one accelerator may use) are the registry's."""
    return kv_registry.pick(sender.status.kv_backends, receiver.status.kv_backends, _same_accelerator(sender, receiver))


def _same_accelerator(a: Worker, b: Worker) -> bool:
    device = a.status.device
    return (bool(device) and device != "cpu" and device == b.status.device
            and a.address.rsplit(":", 1)[0] == b.address.rsplit(":", 1)[0])
