"""The public front door, `baton.v1.Router`: validate, tokenize, route, relay, clean up.

A disaggregated request: pick a decode worker D and Admit (it reserves KV blocks), open
D's token stream, ask a prefill worker P to prefill and push the KV to D, relay D's tokens
to the client. Anything failing before the first token reaches the client is retried on
other workers; a worker lost after that is survived by migrating the stream to another
(migration.py). A stream whose worker switches role moves to a peer with its KV (moves.py).
Cancel, Abort and deadlines propagate to both workers, which free the request's blocks.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
import uuid
from dataclasses import dataclass, field

import grpc

from baton.engine.requests.structured_output import StructuredOutput
from baton.models.audio import AudioPlaceholders
from baton.models.multimodal import ImagePlaceholders
from baton.router import health, moves, tokens, tool_calls, validation
from baton.router.admission import Admission, KVWaitLine
from baton.router.chat_output import ChatOutput
from baton.router.config import RouterConfig
from baton.router.images import ImagePolicy, by_kind
from baton.router.migration import Ledger
from baton.router.moves import MoveFailed, StreamMoving
from baton.router.pacing import MessagePacer
from baton.router.policies import make_policy
from baton.router.prefix_index import PrefixIndex
from baton.router.registry import KVPairs, Registry, Worker, kv_backend
from baton.router.request_clock import RequestClock
from baton.router.token_bus import SUBSCRIBER, BusBroken, Inbox, MoveAsked, StreamStalled
from baton.serving import tracing
from baton.serving.grpc_server import KV_FULL, ServiceError
from baton.serving.security import TokenAuth
from baton.serving.wire import STATUS_BY_NUMBER, sampling_to_proto
from baton.serving.wire import timeout_ms as _ms
from baton.v1 import decode_pb2, prefill_pb2, router_pb2, router_pb2_grpc, worker_pb2

log = logging.getLogger("baton.router")
MAX_ATTEMPTS = 3
ABORT_TIMEOUT_S = 2.0
# no path now, but a worker passed a check this recently (a pool's one worker marked down by a
# failed request until its next check, a scale-down's survivor not checked yet): a request waits
# this long for one, not 0 s; a pool that never came up, or is gone for longer, fails at once
POOL_GAP_S = 3.0
STALL_SLACK_S = 1.0                    # a status is up to a check round old
# a worker lost under a running stream (crashed, killed, drained): the stream may migrate
MIGRATABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.ABORTED}
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED,
             grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.FAILED_PRECONDITION}


@dataclass(slots=True)
class Active:
    request_id: str
    task: asyncio.Task
    client: str = ""                    # whom it belongs to: with tokens on, only they may Abort it
    calls: list[tuple[Worker, str]] = field(default_factory=list)   # (worker, id used there)
    aborted: bool = False
    sending: bool = False               # suspended at its `yield` while gRPC sends the response
    finished: bool = False
    attempt: int = -1                   # attempts so far (retries and migrations), from 0
    images: list[router_pb2.Image] = field(default_factory=list)   # the chat's, sent with every (re-)prefill
    audios: list[router_pb2.Audio] = field(default_factory=list)   # ...and its audio clips, likewise
    kv_ticket: int | None = None        # its place in the line for decode KV, once it has waited there
    marks: dict[str, float] = field(default_factory=dict)   # stage boundaries (perf_counter) until the first token
    span: object = None                 # its trace span (serving/tracing.py; None: tracing off)
    relaying: str = ""                  # the worker id whose chunks it relays now (past the first: it may move)
    base: int = 0                       # tokens the client had when that worker began ("its" tokens follow)
    moving: bool = False                # asked to move with its KV (moves.py), until that is settled

    @property
    def worker_id(self) -> str:
        """Each attempt gets its own id on the workers, so a retry never meets its predecessor."""
        return f"{self.request_id}.{self.attempt}"


class AttemptFailed(Exception):
    """Nothing reached the client yet: another worker may take the request.

    `worker` failed for sure (it may be marked down); `suspects` are avoided on the retry
    without blame (a stalled handover: prefill, decode or the link between them)."""

    def __init__(self, code: grpc.StatusCode, message: str, worker: Worker | None,
                 suspects: tuple[Worker, ...] = (), reason: str | None = None):
        super().__init__(message)
        self.code, self.worker, self.suspects = code, worker, suspects
        self.reason = reason            # the worker's own words, for a refusal the client must act on


class StreamBroke(Exception):
    """The worker under a running stream is gone: the stream may migrate to a survivor."""

    def __init__(self, code: grpc.StatusCode, message: str, worker: Worker):
        super().__init__(message)
        self.code, self.worker = code, worker


class RouterService:
    def __init__(self, registry: Registry, tokenizer, model_info: router_pb2.ModelInfo,
                 cfg: RouterConfig | None = None, sampling_defaults: dict | None = None,
                 vision: ImagePlaceholders | AudioPlaceholders | None = None):
        cfg = cfg or RouterConfig()
        self.cfg = cfg
        # `vision`: the model's image or audio placeholders (models/multimodal.py); None: text only
        self.images = ImagePolicy(model_info.name, vision, cfg.max_images, cfg.max_image_bytes)
        self.sampling_defaults = sampling_defaults or {}     # the model's generation config
        self.registry = registry
        self.tokenizer = tokenizer
        self.model_info = model_info
        if cfg.policy == "kv_aware":           # the workers' KV events, followed after each round of checks
            registry.prefix_index = PrefixIndex()
        self.prefill_policy = make_policy(cfg.policy, "prefill", registry.prefix_index)
        self.decode_policy = make_policy(cfg.policy, "decode", registry.prefix_index)
        self.colocated_policy = make_policy(cfg.policy, "colocated", registry.prefix_index)
        self.active: dict[str, Active] = {}
        self.admission = Admission(cfg.max_inflight, cfg.max_queued, cfg.queue_timeout, cfg.max_per_client)
        self.kv_line = KVWaitLine(cfg.max_queued)
        self.auth = TokenAuth(cfg.auth_tokens) if cfg.auth_tokens else None
        self.server = None                  # the grpc_server.Server, whose `draining` we honour
        self.metrics = None
        registry.on_lost = self._count_loss
        self.kv_pairs = KVPairs(kv_backend)          # warmed after each round of health checks
        registry.on_checked = self._after_checks
        registry.on_switching = functools.partial(moves.ask, self)
        self._warm_pairs_now()
        self._background: set[asyncio.Task] = set()
        self.pacer = MessagePacer(cfg.stream_message_rate)

    def _after_checks(self, workers: list[Worker]) -> None:
        """Each round of health checks: warm the KV pairs it found, and read the router's own load."""
        self.kv_pairs.reconcile(workers)
        self.pacer.sample()

    def _warm_pairs_now(self) -> None:
        """The registry's first round of checks ran before this service existed: warm its healthy
        pairs now, not half a second later (built outside an event loop, in tests: at the next round)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self.kv_pairs.reconcile(self.registry.workers)

    def client_of(self, context) -> str:
        """Whom per-client limits count against: the bearer token's client, else the peer host."""
        if self.auth is not None:
            return self.auth.client_of(context.invocation_metadata()) or "anonymous"
        peer = context.peer() or "unknown"
        return peer.rsplit(":", 1)[0]

    @property
    def max_model_len(self) -> int:
        lens = [w.status.max_model_len for w in self.registry.workers if w.healthy and w.status.max_model_len]
        return min(lens) if lens else self.model_info.max_model_len

    # -- Generate -----------------------------------------------------------------------------
    async def generate(self, req: router_pb2.GenerateRequest, context):
        if self.server is not None and self.server.draining:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "router is draining (shutting down); retry on another")
        validation.check_request_id(req.request_id)
        images = self.images.collect(req)
        if images:                          # decoding takes a while: not on the event loop
            await asyncio.to_thread(self.images.measure, images)
        ids = validation.prompt_ids(req, self.tokenizer, self.model_info.vocab_size, images, self.images,
                                    self.cfg.trust_request_chat_template)
        validation.check_limits(req, len(ids), self.cfg.max_prompt_tokens, self.cfg.max_new_tokens)
        params = validation.sampling(req, len(ids), self.max_model_len, self.model_info.vocab_size,
                                     self.cfg.max_new_tokens, self.sampling_defaults)
        output = self._chat_output(req, params)
        rid = req.request_id or uuid.uuid4().hex
        if rid in self.active:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is already running")
        remaining = context.time_remaining()
        loop = asyncio.get_running_loop()
        # the client's deadline, else --request-timeout (0: none): never one nobody asked for
        limit = remaining if remaining is not None else (self.cfg.request_timeout or math.inf)
        deadline = loop.time() + limit
        pictures, clips = by_kind(images)
        active = Active(rid, asyncio.current_task(), self.client_of(context), images=pictures, audios=clips)
        self.active[rid] = active
        clock = RequestClock(self.metrics, len(ids)) if self.metrics else None
        if clock:
            active.marks = clock.marks
        active.span = tracing.start("baton.request", context.invocation_metadata(),
                                    attributes={"baton.request_id": rid, "baton.prompt_tokens": len(ids)})
        failure: BaseException | None = None
        try:
            async with self.admission.slot(active.client, deadline, params.priority):
                if clock:
                    clock.admitted()
                async for resp in self._route(active, ids, params, deadline):
                    if clock:
                        clock.sent(resp)
                    active.sending = True
                    yield resp if output is None else output.relay(resp)
                    active.sending = False
                    if active.aborted and not resp.finish_reason:     # aborted while it was sent
                        raise ServiceError(grpc.StatusCode.CANCELLED, f"request {rid} aborted")
        except (ServiceError, TimeoutError) as exc:
            failure = exc
            timed_out = isinstance(exc, TimeoutError) or exc.code == grpc.StatusCode.DEADLINE_EXCEEDED
            if clock:
                clock.status = "deadline_exceeded" if timed_out else exc.code.name.lower()
            if not timed_out or loop.time() < deadline:
                raise
            # whichever hop noticed first, the cause is the request's own deadline: say whose
            whose = ("its client's deadline" if remaining is not None else
                     f"the router's --request-timeout of {self.cfg.request_timeout:g}s (its client set no deadline)")
            raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, f"request {rid} reached {whose}") from None
        except (asyncio.CancelledError, GeneratorExit) as exc:
            failure = exc
            if clock:
                clock.status = "cancelled"
            # the Abort RPC: end the stream with a status, not a silent cancel
            if active.aborted and isinstance(exc, asyncio.CancelledError):
                raise ServiceError(grpc.StatusCode.CANCELLED, f"request {rid} aborted") from None
            raise
        finally:
            if clock:
                clock.done()
            tracing.end(active.span, failure)
            self.active.pop(rid, None)
            for w, _ in active.calls:
                w.inflight -= 1
            if not active.finished:
                await self._abort_on_workers(active.calls)

    def _chat_output(self, req: router_pb2.GenerateRequest, params) -> ChatOutput | None:
        """A chat's output parsers (thinking: --reasoning-parser; tool calls: the chat's tools), if any.
        A forced call ends with its closing tag (a stop string: what follows is no part of it)."""
        if req.WhichOneof("input") != "chat":
            return None
        tools = tool_calls.template_tools(req.chat) is not None
        forced = tool_calls.forced_call(req.chat)
        if forced is not None:                # structured output holds the call to its tool's schema
            if params.structured is not None:
                raise ValueError("tool_choice forces a tool call, whose arguments follow the tool's parameters "
                                 "schema: drop the structured output (response_format, guided_*) or the tool_choice")
            params.structured = StructuredOutput.json(forced.schema, strict=forced.strict)
            params.structured.validate()
            params.stop.append(tool_calls.CALL_CLOSE)
        if not tools and not self.cfg.reasoning_parser:
            return None
        return ChatOutput(self.cfg.reasoning_parser, tools, forced)

    async def _route(self, active: Active, ids: list[int], params, deadline: float):
        """Stream the request to the client; if its worker dies mid-stream, migrate it and go on; if
        its worker switches role, move it with its KV and go on."""
        ledger = Ledger(ids, params, self.tokenizer, self.cfg.max_migrations)
        tried: set[str] = set()
        moved = None                           # a move's continuation of the stream (moves.py)
        while True:
            prompt, sampling = ledger.request()
            try:
                if moved is None:
                    active.base = len(ledger.tokens)
                chunks, moved = moved or self._attempts(active, prompt, sampling_to_proto(sampling), deadline,
                                                        tried), None
                async for chunk in chunks:
                    resp = ledger.relay(active.request_id, chunk)
                    yield resp
                    if resp.finish_reason != router_pb2.FINISH_REASON_UNSPECIFIED:
                        # ended by the worker, or here (a stop string across a migration's seam)
                        active.finished = chunk.finish_reason != router_pb2.FINISH_REASON_UNSPECIFIED
                        return
            except StreamMoving as exc:
                moved = moves.moved_stream(self, active, ledger, exc, deadline, tried)
            except (StreamBroke, MoveFailed) as exc:
                why = ledger.why_not()
                if why is None and not self.registry.healthy(exc.worker.role, tried | {exc.worker.address}):
                    why = f"no other {exc.worker.role} worker is healthy"
                if why is not None:
                    self.count_migration("refused")
                    raise ServiceError(exc.code, f"request {active.request_id}: {exc} after {len(ledger.tokens)} "
                                                 f"token(s) and cannot migrate: {why}") from None
                tried.add(exc.worker.address)
                self.forget(active, active.worker_id)
                ledger.migrate()
                self.count_migration("migrated")
                log.warning("request %s: %s after %d token(s); migrating (%d of at most %d)", active.request_id,
                            exc, len(ledger.tokens), ledger.migrations, ledger.limit)
                last = ledger.out_of_budget(active.request_id)
                if last is not None:
                    yield last
                    active.finished = True
                    return

    def _count_loss(self, worker: Worker, how: str) -> None:
        if self.metrics:
            self.metrics.worker_losses.labels(worker.role, how).inc()

    def count_migration(self, outcome: str) -> None:
        if self.metrics:
            self.metrics.migrations.labels(outcome).inc()

    def forget(self, active: Active, worker_id: str) -> None:
        """Drop an attempt's calls; tell their workers to free the request (in the background:
        a dead worker must not hold up the migration)."""
        old = [c for c in active.calls if c[1] == worker_id]
        active.calls = [c for c in active.calls if c[1] != worker_id]
        for w, _ in old:
            w.inflight -= 1
        task = asyncio.ensure_future(self._abort_on_workers(old))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _attempts(self, active: Active, ids: list[int], sampling, deadline: float, tried: set[str]):
        """Worker chunks for one prompt; failures before the first chunk are retried elsewhere."""
        loop = asyncio.get_running_loop()
        last: AttemptFailed | None = None
        attempts = 0
        while attempts < MAX_ATTEMPTS:
            attempts += 1
            active.attempt += 1
            if loop.time() >= deadline:
                raise TimeoutError(f"request {active.request_id} passed its deadline before starting")
            if not self._servable() and self.registry.seen_within(POOL_GAP_S, self._missing_roles()):
                await self.registry.wait_until(self._servable, min(POOL_GAP_S, deadline - loop.time()))
            try:
                if self.registry.healthy("colocated") and not health.disaggregated(self.registry):
                    attempt = self._colocated(active, ids, sampling, deadline, tried)
                else:
                    attempt = self._disaggregated(active, ids, sampling, deadline, tried)
                async for chunk in attempt:
                    yield chunk
                return
            except AttemptFailed as exc:
                last = exc
                await self._abort_on_workers([c for c in active.calls if c[1] == active.worker_id])
                if _kv_full(exc) and await self._wait_for_kv(active, len(ids), deadline, tried):
                    attempts -= 1                # a wait for room, not a failed try
                    continue
                tried.update(w.address for w in exc.suspects)
                if exc.worker is not None:
                    tried.add(exc.worker.address)
                    if exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL):
                        exc.worker.mark_down(str(exc))
                log.info("request %s: attempt failed (%s), retrying elsewhere", active.request_id, exc)
                if exc.code not in RETRYABLE:
                    break
        code = last.code if last else grpc.StatusCode.UNAVAILABLE
        if code == grpc.StatusCode.INVALID_ARGUMENT and last.reason:     # the request's fault, not the workers'
            raise ServiceError(code, last.reason)
        raise ServiceError(code, f"request {active.request_id} failed on every worker tried: {last}")

    async def _wait_for_kv(self, active: Active, prompt_len: int, deadline: float, tried: set[str]) -> bool:
        """A decode worker had no room for the prompt's KV: wait in line (router/admission.py) until
        one reports room, then the next try goes there. False if no decode worker could ever hold it."""
        def short_of_room(decode: list[Worker]) -> set[str]:
            return {w.address for w in decode if w.status.kv_blocks_free < _blocks(prompt_len, w)}

        def fits() -> bool:
            decode = self.registry.healthy("decode")
            return len(short_of_room(decode)) < len(decode)

        def hopeless() -> str | None:
            decode = self.registry.healthy("decode")
            if any(_blocks(prompt_len, w) <= w.status.kv_blocks_total for w in decode):
                return None
            return (f"no healthy decode worker could hold the KV of its {prompt_len} prompt tokens"
                    + ("" if decode else " (none is healthy)"))
        if hopeless() is not None:
            return False
        if active.kv_ticket is None:
            active.kv_ticket = self.kv_line.ticket()
            self.kv_line.waits += 1
            log.info("request %s: no decode worker has KV room for its %d prompt tokens now; waiting (%d in line)",
                     active.request_id, prompt_len, len(self.kv_line.line) + 1)
        await self.kv_line.wait(active.kv_ticket, fits, deadline, hopeless, POOL_GAP_S)
        tried.update(short_of_room(self.registry.healthy("decode")))     # the next pick goes where there is room
        return True

    def _servable(self) -> bool:
        """Some path is healthy now: a colocated worker, or a prefill and a decode worker."""
        return bool(self.registry.healthy("colocated")) or health.disaggregated(self.registry)

    def _missing_roles(self) -> set[str]:
        """The roles whose health would give a request a path: colocated, and prefill or decode
        where that pool has no healthy worker."""
        return {"colocated"} | {r for r in ("prefill", "decode") if not self.registry.healthy(r)}

    def _pick(self, role: str, policy, ids, tried: set[str]) -> Worker:
        workers = self.registry.healthy(role, tried) or self.registry.healthy(role)
        if not workers:       # said to gRPC and HTTP clients alike: name what each can look at
            n = sum(w.role == role for w in self.registry.workers)
            where = "GET /health on the HTTP port or the GetServerInfo RPC" if self.cfg.http_port else "GetServerInfo"
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"no healthy {role} worker (0 of {n} pass their health "
                                                            f"checks); {where} lists the workers")
        return policy.pick(workers, ids)

    def _pick_pair(self, ids, tried: set[str]) -> tuple[Worker, Worker]:
        """A decode and a prefill worker, by policy among the pairs whose KV channel is warm where
        there are any (KVPairs): a cold pair's first transfer waits for its channel, handshake and
        communicator. Without a warm one, any healthy pair: warming never holds a request up."""
        prefill = self.registry.healthy("prefill", tried) or self.registry.healthy("prefill")
        d = self._pick_warm("decode", self.decode_policy, ids, tried,
                            lambda w: any(self.kv_pairs.is_warm(p, w) for p in prefill))
        p = self._pick_warm("prefill", self.prefill_policy, ids, tried, lambda w: self.kv_pairs.is_warm(w, d))
        return d, p

    def _pick_warm(self, role: str, policy, ids, tried: set[str], warm) -> Worker:
        """`_pick` among the candidates for which `warm(worker)` holds, if any."""
        workers = [w for w in self.registry.healthy(role, tried) or self.registry.healthy(role) if warm(w)]
        return policy.pick(workers, ids) if workers else self._pick(role, policy, ids, tried)

    def use(self, active: Active, w: Worker) -> None:
        active.calls.append((w, active.worker_id))
        w.inflight += 1

    async def _disaggregated(self, active: Active, ids, sampling, deadline, tried):
        loop = asyncio.get_running_loop()
        rid = active.worker_id
        d, p = self._pick_pair(ids, tried)
        self.use(active, d)
        # the KV must land, and the prefill end, before the first token is due: bounded whatever the deadline
        handover = min(self.cfg.first_token_timeout, deadline - loop.time())
        inbox = await self._listen(d, rid, handover)
        prefill = first = None
        try:
            try:
                admit = await d.decode_stub.Admit(decode_pb2.AdmitRequest(
                    request_id=rid, prompt_token_ids=ids, sampling=sampling, backend=kv_backend(p, d),
                    timeout_ms=_ms(handover), subscriber=SUBSCRIBER, stream_timeout_ms=_ms(deadline - loop.time()),
                    reuse_prefix=p.status.kv_skip_blocks),     # (a prefill that predates skip_blocks sends all)
                    timeout=handover, **tracing.carry(active.span))
            except grpc.aio.AioRpcError as exc:
                raise _failed(exc, d, "admit") from exc
            self.use(active, p)
            _mark(active, "prefill_sent")
            prefill = asyncio.ensure_future(p.prefill_stub.Prefill(prefill_pb2.PrefillRequest(
                request_id=rid, prompt_token_ids=ids, sampling=sampling, timeout_ms=_ms(handover),
                images=active.images, audios=active.audios, handoff=prefill_pb2.Handoff(
                    decode_address=admit.kv_address or d.address, transfer_id=admit.transfer_id,
                    backend=admit.backend, skip_blocks=admit.skip_blocks)), timeout=handover,
                **tracing.carry(active.span)))
            p.inflight_tokens += len(ids)
            prefill.add_done_callback(functools.partial(_unqueue, p, len(ids)))
            prefill.add_done_callback(lambda _: _mark(active, "prefill_done"))
            prefill.add_done_callback(_retrieve)         # it may fail after the first token came: no warning
            first = asyncio.ensure_future(inbox.next())
            first.add_done_callback(_retrieve)           # abandoned on a failed attempt: no warning
            await self._await_first(first, prefill, p, loop.time() + handover)
            if not first.done():
                first.cancel()
                if loop.time() >= deadline:
                    raise TimeoutError(f"request {active.request_id} got no first token before its deadline")
                raise AttemptFailed(grpc.StatusCode.UNAVAILABLE,
                                    f"no first token within {self.cfg.first_token_timeout:.0f}s from prefill "
                                    f"{p.address} via decode {d.address} (stalled KV handover?)", None, (p, d))
            chunk = _first_chunk(await _result(first), d, "decode stream")
            async for rest in self.relay(active, chunk, inbox, d, deadline):
                yield rest
        except StreamMoving:
            inbox = None                            # the move takes it over (moves.py)
            raise
        finally:
            for fut in (prefill, first):            # an attempt abandoned mid-wait leaves no task behind
                if fut is not None and not fut.done():
                    fut.cancel()
            if inbox is not None:
                d.bus.unregister(rid)

    async def _await_first(self, first: asyncio.Future, prefill: asyncio.Future, p: Worker, first_by: float) -> None:
        """Until the first token is back, the prefill failed, its worker was left (a hung prefill worker:
        fail over at once), or `first_by` (a stalled handover)."""
        loop = asyncio.get_running_loop()
        p_lost = asyncio.ensure_future(p.lost.wait())
        try:
            while not first.done() and loop.time() < first_by:
                pending = {first, p_lost} | ({prefill} if not prefill.done() else set())
                await asyncio.wait(pending, timeout=max(0.0, first_by - loop.time()),
                                   return_when=asyncio.FIRST_COMPLETED)
                if prefill.done() and prefill.exception() is not None and not first.done():
                    first.cancel()
                    raise _failed(prefill.exception(), p, "prefill")
                if p.lost.is_set() and not first.done():
                    first.cancel()
                    raise AttemptFailed(grpc.StatusCode.UNAVAILABLE, f"prefill worker {p.address} was left: "
                                        f"{p.last_error}", p)
        finally:
            p_lost.cancel()

    async def _colocated(self, active: Active, ids, sampling, deadline, tried):
        loop = asyncio.get_running_loop()
        w = self._pick("colocated", self.colocated_policy, ids, tried)
        self.use(active, w)
        rid = active.worker_id
        inbox = await self._listen(w, rid, min(self.cfg.first_token_timeout, deadline - loop.time()))
        try:
            _mark(active, "prefill_sent")
            try:
                await w.decode_stub.Start(decode_pb2.WorkerGenerateRequest(
                    request_id=rid, prompt_token_ids=ids, sampling=sampling, images=active.images,
                    audios=active.audios, timeout_ms=_ms(deadline - loop.time()), subscriber=SUBSCRIBER),
                    timeout=min(self.cfg.first_token_timeout, deadline - loop.time()), **tracing.carry(active.span))
            except grpc.aio.AioRpcError as exc:
                raise _failed(exc, w, "start") from exc
            chunk = _first_chunk(await _result(asyncio.ensure_future(inbox.next(deadline))), w, "generate")
            async for rest in self.relay(active, chunk, inbox, w, deadline):
                yield rest
        except StreamMoving:
            inbox = None                            # the move takes it over (moves.py)
            raise
        finally:
            if inbox is not None:
                w.bus.unregister(rid)

    async def _listen(self, w: Worker, rid: str, timeout: float) -> Inbox:
        """The inbox of request `rid` on `w`'s token bus (opened here if it is not yet)."""
        try:
            return await w.bus.register(rid, max(0.0, timeout))
        except (BusBroken, TimeoutError) as exc:
            code = getattr(exc, "code", grpc.StatusCode.UNAVAILABLE)
            raise AttemptFailed(code, f"token stream of {w.address}: {exc or 'no answer'}", w) from None

    async def relay(self, active: Active, chunk, inbox: Inbox, worker: Worker, deadline: float):
        """`chunk` (None: none yet) and the worker's chunks after it, of the attempt under way; a worker
        lost mid-stream raises StreamBroke, a move asked of the stream (moves.ask) StreamMoving."""
        wid = active.relaying = active.worker_id
        while True:
            if chunk is not None:
                yield chunk
                if chunk.finish_reason != router_pb2.FINISH_REASON_UNSPECIFIED:
                    return
                pace = self.pacer.interval(len(self.active))
                if pace:
                    await inbox.gather(pace)
            try:
                chunk = await self._next_chunk(inbox, worker, deadline)
            except BusBroken as exc:
                chunk = decode_pb2.TokenChunk(error_code=exc.code.value[0], error_message=str(exc))
            except MoveAsked:
                raise StreamMoving(worker, inbox, wid) from None
            if chunk.error_code:
                code = STATUS_BY_NUMBER[chunk.error_code]
                if code == grpc.StatusCode.UNAVAILABLE:
                    worker.mark_down(chunk.error_message or "stream broke")
                what = f"{worker.role} worker {worker.address} failed mid-stream: {code.name}: {chunk.error_message}"
                if code in MIGRATABLE:
                    raise StreamBroke(code, what, worker)
                raise ServiceError(code, what)

    async def _next_chunk(self, inbox: Inbox, worker: Worker, deadline: float):
        """The stream's next chunk. No token for the worker's stall limit moves the stream (the worker
        answers its health checks: only this stream is stuck), unless a step in progress there has
        lasted about as long, within its budget: then the whole worker is busy, not this stream stuck."""
        loop = asyncio.get_running_loop()
        waited_from = loop.time()
        while True:
            try:
                return await inbox.next(deadline, loop.time() + worker.stall_limit())
            except StreamStalled as exc:
                busy = worker.busy_for()
                if busy > 0 and busy >= loop.time() - waited_from - STALL_SLACK_S:
                    continue
                if self.metrics:
                    self.metrics.stream_stalls.labels(worker.role).inc()
                raise StreamBroke(exc.code, f"{worker.role} worker {worker.address} sent no token for "
                                            f"{loop.time() - waited_from:.0f}s", worker) from None

    async def _abort_on_workers(self, calls: list[tuple[Worker, str]]) -> None:
        """Best effort, bounded: the workers free the request's blocks (a no-op if finished)."""
        async def one(w: Worker, wid: str):
            try:
                await w.stub.Abort(worker_pb2.WorkerAbortRequest(request_id=wid), timeout=ABORT_TIMEOUT_S)
            except grpc.aio.AioRpcError:
                pass
        await asyncio.shield(asyncio.gather(*(one(w, wid) for w, wid in calls)))

    # -- the other RPCs -----------------------------------------------------------------------
    def abort(self, rid: str, client: str | None = None) -> bool:
        """Ends request `rid`. With bearer tokens on, only the client that started it may: to
        anyone else it is not found (which also hides that it exists)."""
        active = self.active.get(rid)
        if active is None or (self.auth is not None and client != active.client):
            return False
        active.aborted = True
        # While gRPC sends a response (the stream suspended at its `yield`) a cancel would land in
        # gRPC's own send, which then ends the call with no status at all (the client waits out its
        # deadline); the stream ends itself, CANCELLED, as soon as the send returns instead.
        if not active.sending:
            active.task.cancel()
        return True

    def server_info(self) -> router_pb2.ServerInfo:
        return router_pb2.ServerInfo(workers=[
            router_pb2.WorkerInfo(address=w.address, role=w.role, healthy=w.healthy, running=w.status.running,
                                  waiting=w.status.waiting, kv_blocks_total=w.status.kv_blocks_total,
                                  kv_blocks_free=w.status.kv_blocks_free)
            for w in self.registry.workers])


def _kv_full(exc: AttemptFailed) -> bool:
    """A decode worker refused the request for want of free KV blocks (it may have them later)."""
    return exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED and KV_FULL in str(exc) and exc.worker is not None \
        and exc.worker.role == "decode"


def _blocks(prompt_len: int, w: Worker) -> int:
    """KV blocks a decode worker reserves for a prompt (its tokens and the first generated one)."""
    size = w.status.block_size or 16
    return -(-(prompt_len + 1) // size)


def _unqueue(w: Worker, tokens: int, _fut: asyncio.Future) -> None:
    w.inflight_tokens -= tokens


async def _result(first: asyncio.Future):
    """The first chunk, or the BusBroken / TimeoutError that came instead (as a value)."""
    try:
        return await first
    except (BusBroken, TimeoutError) as exc:
        return exc


def _first_chunk(item, worker: Worker, what: str):
    """The first chunk of an attempt; a failure before it is the attempt's (retried elsewhere)."""
    if isinstance(item, TimeoutError):
        raise item
    if isinstance(item, BusBroken):
        raise AttemptFailed(item.code, f"{what} on {worker.address}: {item.code.name}: {item}", worker)
    if item.error_code:
        code = STATUS_BY_NUMBER[item.error_code]
        raise AttemptFailed(code, f"{what} on {worker.address}: {code.name}: {item.error_message}", worker,
                            reason=item.error_message)
    return item


def _mark(active: Active, boundary: str) -> None:
    """A stage boundary of the attempt under way, until the request's first token (a migration's
    re-prefill afterwards belongs to no stage: it is decode time)."""
    if "first" not in active.marks:
        if boundary == "prefill_sent":
            active.marks.pop("prefill_done", None)       # a failed attempt's
        active.marks[boundary] = time.perf_counter()


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


def _failed(exc: BaseException, worker: Worker, what: str) -> AttemptFailed:
    if isinstance(exc, grpc.aio.AioRpcError):
        return AttemptFailed(exc.code(), f"{what} on {worker.address}: {exc.code().name}: {exc.details()}", worker,
                             reason=exc.details())
    return AttemptFailed(grpc.StatusCode.UNAVAILABLE, f"{what} on {worker.address}: {exc!r}", worker)


def _seconds(seconds: float) -> float | None:
    """A gRPC call's timeout: None (none) when the request has no deadline."""
    return None if math.isinf(seconds) else seconds


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Thin: every RPC of the public contract, each a call into RouterService."""

    def __init__(self, svc: RouterService):
        self.svc = svc

    async def Generate(self, request, context):
        async for resp in self.svc.generate(request, context):
            yield resp

    async def Abort(self, request, context):
        return router_pb2.AbortResponse(found=self.svc.abort(request.request_id, self.svc.client_of(context)))

    async def GetModelInfo(self, request, context):
        info = router_pb2.ModelInfo()
        info.CopyFrom(self.svc.model_info)
        info.max_model_len = self.svc.max_model_len
        return info

    async def GetServerInfo(self, request, context):
        return self.svc.server_info()

    async def Tokenize(self, request, context):
        svc = self.svc
        return tokens.tokenize(request, svc.tokenizer, svc.max_model_len, svc.cfg.trust_request_chat_template)

    async def Detokenize(self, request, context):
        return tokens.detokenize(request, self.svc.tokenizer, self.svc.model_info.vocab_size)
