"""The router's rules for workers that stop making progress, against fake workers in this process
(the real thing, SIGSTOPped workers, is in test_chaos.py): a running stream that gets no token
for its stall limit moves to another worker while its worker stays in rotation; a worker the
health checks lose takes its streams with it at once, and a prefill waiting on it gives up
at once instead of at the first-token timeout."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from fake_worker import FakeBus, FakeContext

from baton.router import registry as registry_module
from baton.router import server as server_module
from baton.router.config import RouterConfig
from baton.router.registry import Registry, Worker
from baton.router.server import RouterService
from baton.router.token_bus import TokenBus
from baton.serving.grpc_server import KV_FULL, ServiceError
from baton.serving.metrics import Metrics
from baton.v1 import decode_pb2, prefill_pb2, router_pb2, worker_pb2

PROMPT = [5, 6, 7]


class FakeWorker:
    """A decode or prefill worker's RPCs. `plan(request_id)`: the token ids its stream sends (then
    silence, unless the last is the end); a prefill that `hangs` never answers."""

    def __init__(self, tokens_before_silence: int | None = None, hangs: bool = False):
        self.silent_after, self.hangs = tokens_before_silence, hangs
        self.bus: FakeBus | None = None
        self.admits: list = []

    def Subscribe(self, req, timeout=None):
        self.bus = FakeBus()
        return self.bus

    async def Admit(self, req, timeout=None):
        self.admits.append(req)
        n = req.sampling.max_tokens
        count = n if self.silent_after is None else self.silent_after
        for i in range(count):
            chunk = decode_pb2.TokenChunk(token_ids=[100 + len(req.prompt_token_ids) + i])
            if i == n - 1:
                chunk.finish_reason = router_pb2.FINISH_REASON_LENGTH
                chunk.usage.CopyFrom(router_pb2.Usage(prompt_tokens=len(PROMPT), completion_tokens=n))
            self.bus.send(req.request_id, chunk)
        return decode_pb2.AdmitResponse(transfer_id="t", kv_address="kv:1", backend="grpc")

    async def Start(self, req, timeout=None):                   # the colocated role
        await self.Admit(req)
        return decode_pb2.StartResponse()

    async def Prefill(self, req, timeout=None):
        if self.hangs:
            await asyncio.sleep(3600)
        return prefill_pb2.PrefillResponse(first_token=1)

    async def Abort(self, req, timeout=None):
        return worker_pb2.WorkerAbortResponse()


def worker(address: str, role: str, fake: FakeWorker) -> Worker:
    w = Worker(address, role, healthy=True)
    w.stub = w.prefill_stub = w.decode_stub = fake
    w.bus = TokenBus(fake, address) if role in ("decode", "colocated") else None
    return w


def service(workers: list[Worker], **cfg) -> RouterService:
    reg = Registry([w.address for w in workers if w.role == "prefill"],
                   [w.address for w in workers if w.role == "decode"],
                   [w.address for w in workers if w.role == "colocated"], "m")
    reg.workers = workers
    info = router_pb2.ModelInfo(name="m", max_model_len=4096, vocab_size=50_000)
    svc = RouterService(reg, None, info, RouterConfig(prefill=["p:1"], decode=["d:1"], **cfg))
    svc.metrics = Metrics("router")
    return svc


def request(n: int) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(tokens=router_pb2.TokenIds(ids=PROMPT), sampling=router_pb2.SamplingParams(
        temperature=0, max_tokens=n, ignore_eos=True))


async def collect(svc: RouterService, req) -> list[int]:
    return [t async for r in svc.generate(req, FakeContext()) for t in r.token_ids]


def test_a_stream_with_no_token_for_its_stall_limit_moves_and_its_worker_stays(monkeypatch):
    monkeypatch.setattr(registry_module, "STALL_FLOOR_S", 0.3)
    stuck, good = FakeWorker(tokens_before_silence=2), FakeWorker()
    svc = service([worker("p:1", "prefill", FakeWorker()), worker("d1:1", "decode", stuck),
                   worker("d2:1", "decode", good)], policy="round_robin")

    async def main():
        t0 = time.monotonic()
        tokens = await collect(svc, request(5))
        return tokens, time.monotonic() - t0
    tokens, seconds = asyncio.run(main())
    assert tokens == [103, 104, 105, 106, 107] and seconds < 3      # 2 from the stuck one, 3 from the other
    assert list(good.admits[0].prompt_token_ids) == PROMPT + [103, 104]       # it continued from there
    assert svc.registry.workers[1].healthy                            # one stream stalled: not its worker
    assert svc.metrics.stream_stalls.labels("decode")._value.get() == 1


def test_a_lost_decode_worker_takes_its_streams_away_at_once():
    hung, good = FakeWorker(tokens_before_silence=2), FakeWorker()
    d1 = worker("d1:1", "decode", hung)
    svc = service([worker("p:1", "prefill", FakeWorker()), d1, worker("d2:1", "decode", good)],
                  policy="round_robin")

    async def main():
        t0 = time.monotonic()
        task = asyncio.ensure_future(collect(svc, request(5)))
        await asyncio.sleep(0.2)
        svc.registry._lose(d1, "hung", "DEADLINE_EXCEEDED: health check")     # what check() does on a timeout
        return await task, time.monotonic() - t0
    tokens, seconds = asyncio.run(main())
    assert tokens == [103, 104, 105, 106, 107] and seconds < 2
    assert not d1.healthy and d1.lost.is_set()
    assert svc.metrics.worker_losses.labels("decode", "hung")._value.get() == 1


def test_a_prefill_waiting_on_a_lost_worker_is_retried_at_once():
    p1, p2 = worker("p1:1", "prefill", FakeWorker(hangs=True)), worker("p2:1", "prefill", FakeWorker())
    svc = service([p1, p2, worker("d1:1", "decode", FakeWorker(tokens_before_silence=0)),
                   worker("d2:1", "decode", FakeWorker())], policy="round_robin", first_token_timeout=60)

    async def main():
        t0 = time.monotonic()
        task = asyncio.ensure_future(collect(svc, request(3)))
        await asyncio.sleep(0.2)
        svc.registry._lose(p1, "hung", "DEADLINE_EXCEEDED: health check")
        return await task, time.monotonic() - t0
    tokens, seconds = asyncio.run(main())
    assert tokens == [103, 104, 105] and seconds < 2                  # not the 60 s first-token timeout


def test_a_pool_whose_one_worker_is_briefly_down_serves_the_request_once_it_is_back():
    """One failed request marks the only decode worker down until its next health check: a request
    arriving in that gap waits for the check (not 0 s, answering UNAVAILABLE), and is served."""
    d = worker("d:1", "decode", FakeWorker())
    svc = service([worker("p:1", "prefill", FakeWorker()), d])
    d.last_seen = time.monotonic()                          # its last health check passed
    d.mark_down("UNAVAILABLE: one request's attempt failed")

    async def main():
        t0 = time.monotonic()
        task = asyncio.ensure_future(collect(svc, request(3)))
        await asyncio.sleep(0.5)
        d.healthy = True                                    # what its next health check does
        return await task, time.monotonic() - t0
    tokens, seconds = asyncio.run(main())
    assert tokens == [103, 104, 105] and 0.5 <= seconds < 2


def test_a_pool_that_stays_down_is_unavailable_after_the_gap_and_one_never_up_at_once(monkeypatch):
    monkeypatch.setattr(server_module, "POOL_GAP_S", 1.0)
    d = worker("d:1", "decode", FakeWorker())
    svc = service([worker("p:1", "prefill", FakeWorker()), d])

    async def main():
        t0 = time.monotonic()
        try:
            await collect(svc, request(3))
        except Exception as exc:                     # noqa: BLE001 - the error is what is checked
            return exc, time.monotonic() - t0
    d.mark_down("UNAVAILABLE: connection refused")                  # never passed a check: no wait
    exc, seconds = asyncio.run(main())
    assert getattr(exc, "code", None) == grpc.StatusCode.UNAVAILABLE and "no healthy decode" in str(exc), exc
    assert seconds < 0.5
    svc.registry.workers[0].last_seen = time.monotonic()            # the prefill worker's check: no reason to wait
    exc, seconds = asyncio.run(main())
    assert seconds < 0.5
    d.last_seen = time.monotonic()                                  # passed one just now, then lost
    exc, seconds = asyncio.run(main())
    assert getattr(exc, "code", None) == grpc.StatusCode.UNAVAILABLE and "no healthy decode" in str(exc), exc
    assert 1.0 <= seconds < 2.0


def test_an_abort_while_a_response_is_being_sent_ends_the_stream_cancelled():
    """gRPC runs a stream's handler as one task and sends each response from that task while the
    stream waits at its `yield`. An Abort landing then must not cancel the task (the cancel would hit
    gRPC's send, which ends the call with no status: the client waits out its deadline); the stream
    ends CANCELLED once the send returns, and its worker is told to free the request."""
    d1 = FakeWorker(tokens_before_silence=2)
    aborts: list[str] = []

    async def abort(req, timeout=None):
        aborts.append(req.request_id)
        return worker_pb2.WorkerAbortResponse()
    d1.Abort = abort
    svc = service([worker("p:1", "prefill", FakeWorker()), worker("d1:1", "decode", d1)])
    req = request(50)
    req.request_id = "abort-while-sending"

    async def main():
        sending, sent = asyncio.Event(), asyncio.Event()

        async def handler():                   # what grpc.aio's stream handler does with each response
            stream = svc.generate(req, FakeContext())
            first = await stream.__anext__()
            sending.set()
            await sent.wait()                  # "sending": the stream is suspended at its yield
            try:
                await stream.__anext__()
            except Exception as exc:           # noqa: BLE001 - the outcome under test
                return first, exc
            return first, None

        task = asyncio.ensure_future(handler())
        await asyncio.wait_for(sending.wait(), 5)
        assert svc.abort("abort-while-sending")
        await asyncio.sleep(0.05)              # a cancel, had there been one, would land in the send now
        sent.set()
        return await asyncio.wait_for(task, 5)
    first, exc = asyncio.run(main())
    assert list(first.token_ids)[:1] == [103]
    assert getattr(exc, "code", None) == grpc.StatusCode.CANCELLED, exc
    assert aborts and "abort-while-sending" not in svc.active


def test_an_abort_while_the_stream_waits_for_tokens_ends_it_cancelled():
    d1 = FakeWorker(tokens_before_silence=1)
    svc = service([worker("p:1", "prefill", FakeWorker()), worker("d1:1", "decode", d1)])
    req = request(50)
    req.request_id = "abort-while-waiting"

    async def main():
        task = asyncio.ensure_future(collect(svc, req))
        for _ in range(100):
            await asyncio.sleep(0.01)
            if "abort-while-waiting" in svc.active and svc.active["abort-while-waiting"].calls:
                break
        await asyncio.sleep(0.05)
        assert svc.abort("abort-while-waiting")
        try:
            await asyncio.wait_for(task, 5)
        except Exception as exc:               # noqa: BLE001 - the outcome under test
            return exc
    exc = asyncio.run(main())
    assert getattr(exc, "code", None) == grpc.StatusCode.CANCELLED, exc


def test_a_pd_pool_down_beside_colocated_workers_is_served_there_and_reported_degraded():
    """Prefill lost while a decode and a colocated worker are up: requests go to the colocated
    worker (no prefill to hand KV over), and /health's verdict says degraded and why; once the
    prefill worker is back, requests are disaggregated again and the verdict is ok."""
    from baton.router import health
    pre, dec, col = FakeWorker(), FakeWorker(), FakeWorker()
    p = worker("p:1", "prefill", pre)
    svc = service([p, worker("d:1", "decode", dec), worker("c:1", "colocated", col)])
    assert health.judge(svc.registry) == health.Health("ok")
    p.healthy = False
    verdict = health.judge(svc.registry)
    assert verdict.status == "degraded" and "prefill (0 of 1 healthy)" in verdict.reason, verdict
    assert asyncio.run(collect(svc, request(3))) == [103, 104, 105]
    assert len(col.admits) == 1 and not dec.admits                  # served colocated, not disaggregated
    p.healthy = True
    assert health.judge(svc.registry).status == "ok"
    assert asyncio.run(collect(svc, request(3))) == [103, 104, 105]
    assert len(dec.admits) == 1 and len(col.admits) == 1


def test_the_verdict_is_unavailable_without_a_path_and_ok_for_a_plain_deployment():
    from baton.router import health
    only_pd = service([worker("p:1", "prefill", FakeWorker()), worker("d:1", "decode", FakeWorker())])
    assert health.judge(only_pd.registry).status == "ok"
    assert health.judge(only_pd.registry, draining=True) == health.Health("unavailable", "draining")
    only_pd.registry.workers[1].healthy = False
    verdict = health.judge(only_pd.registry)
    assert verdict.status == "unavailable" and "decode (0 of 1 healthy)" in verdict.reason
    colocated = service([worker("c:1", "colocated", FakeWorker())])
    assert health.judge(colocated.registry).status == "ok"            # built colocated: nothing to miss


def test_a_requests_stages_add_up_to_its_e2e_on_either_path():
    """baton_stage_seconds: queue, admit, prefill, handover, decode for a disaggregated request;
    no handover for a colocated one; either way their sums are the E2E's."""
    from baton.router.request_clock import stages

    def observed(svc, name):
        return {s.labels["stage"]: s.value for f in svc.metrics.registry.collect() if f.name == name
                for s in f.samples if s.name == f"{name}_sum"}

    pd = service([worker("p:1", "prefill", FakeWorker()), worker("d:1", "decode", FakeWorker())])
    colocated = service([worker("c:1", "colocated", FakeWorker())])
    for svc, want in ((pd, ["queue", "admit", "prefill", "handover", "decode"]),
                      (colocated, ["queue", "admit", "prefill", "decode"])):
        asyncio.run(collect(svc, request(3)))
        by_stage = observed(svc, "baton_stage_seconds")
        e2e = sum(s.value for f in svc.metrics.registry.collect() if f.name == "baton_e2e_seconds"
                  for s in f.samples if s.name == "baton_e2e_seconds_sum")
        assert sorted(by_stage) == sorted(want) and all(v >= 0 for v in by_stage.values())
        assert sum(by_stage.values()) == pytest.approx(e2e, rel=1e-9, abs=1e-9)
    # boundaries out of order (the first token before the prefill's answer) stay in order
    got = stages(0.0, {"admitted": 1.0, "prefill_sent": 2.0, "prefill_done": 5.0, "first": 4.0}, 6.0)
    assert got == [("queue", 1.0), ("admit", 1.0), ("prefill", 2.0), ("handover", 0.0), ("decode", 2.0)]


def test_a_worker_switching_role_between_the_pick_and_the_call_is_retried_elsewhere():
    """The prefill worker the router picked became a decode worker while the decode side admitted
    the request (a role switch under load; the router's poll already swapped its role's `stub` for
    the Decode one): the Prefill call still reaches its Prefill service, whose refusal
    (FAILED_PRECONDITION) sends the request to the other prefill worker."""
    class Switched(FakeWorker):
        calls = 0

        async def Prefill(self, req, timeout=None):
            Switched.calls += 1
            raise grpc.aio.AioRpcError(grpc.StatusCode.FAILED_PRECONDITION, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "this worker serves decode: prefill work goes to another worker")

    gone, other = worker("p1:1", "prefill", FakeWorker()), worker("p2:1", "prefill", FakeWorker())
    gone.prefill_stub, gone.stub = Switched(), decode_pb2.AdmitResponse()      # (a stub without Prefill)
    other.inflight = 3                                           # the pick goes to the switching one first
    svc = service([gone, worker("d:1", "decode", FakeWorker()), other])
    assert len(asyncio.run(asyncio.wait_for(collect(svc, request(3)), 10))) == 3
    assert Switched.calls == 1


class FullDecode(FakeWorker):
    """A decode worker with no KV room for the prompt now (it could hold it once blocks free)."""

    async def Admit(self, req, timeout=None):
        self.admits.append(req)
        raise grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   f"{KV_FULL}: need 1 KV blocks, 0 free; retry later or elsewhere")


class NoDeadline(FakeContext):
    def time_remaining(self):
        return None


def test_a_request_waiting_for_kv_room_fails_once_no_decode_worker_can_hold_it(monkeypatch):
    """A request in the router's line for decode KV (no deadline of its own) whose one decode
    worker dies: once the decode pool has been gone for the pool gap it ends UNAVAILABLE, as a new
    request does, instead of waiting for room on workers there are none of, forever."""
    monkeypatch.setattr(server_module, "POOL_GAP_S", 0.5)
    d = worker("d:1", "decode", FullDecode())
    d.status.CopyFrom(worker_pb2.WorkerStatus(kv_blocks_total=16, kv_blocks_free=0, block_size=16))
    svc = service([worker("p:1", "prefill", FakeWorker()), d])

    async def main():
        task = asyncio.ensure_future(collect_with(svc, request(3), NoDeadline()))
        await asyncio.sleep(0.6)
        assert not task.done() and svc.kv_line.line               # waiting in line for room
        svc.registry._lose(d, "dead", "UNAVAILABLE: health check")
        d.healthy = False
        t0 = time.monotonic()
        with pytest.raises(ServiceError) as err:
            await asyncio.wait_for(task, 10)
        return err.value, time.monotonic() - t0
    err, seconds = asyncio.run(main())
    assert err.code == grpc.StatusCode.UNAVAILABLE and "decode" in str(err) and seconds < 3, (err, seconds)
    assert not svc.kv_line.line


async def collect_with(svc: RouterService, req, context) -> list[int]:
    return [t async for r in svc.generate(req, context) for t in r.token_ids]
