"""The router's rules for workers that stop making progress, against fake workers in this process
(the real thing, SIGSTOPped workers, is in test_chaos.py): a running stream that gets no token
for its stall limit moves to another worker while its worker stays in rotation; a worker the
health checks lose takes its streams with it at once, and a prefill waiting on it gives up
at once instead of at the first-token timeout."""
from __future__ import annotations

import asyncio
import time

from fake_worker import FakeBus, FakeContext

from baton.router import registry as registry_module
from baton.router.config import RouterConfig
from baton.router.registry import Registry, Worker
from baton.router.server import RouterService
from baton.router.token_bus import TokenBus
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

    async def Prefill(self, req, timeout=None):
        if self.hangs:
            await asyncio.sleep(3600)
        return prefill_pb2.PrefillResponse(first_token=1)

    async def Abort(self, req, timeout=None):
        return worker_pb2.WorkerAbortResponse()


def worker(address: str, role: str, fake: FakeWorker) -> Worker:
    w = Worker(address, role, healthy=True)
    w.stub = fake
    w.bus = TokenBus(fake, address) if role == "decode" else None
    return w


def service(workers: list[Worker], **cfg) -> RouterService:
    reg = Registry([w.address for w in workers if w.role == "prefill"],
                   [w.address for w in workers if w.role == "decode"], [], "m")
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
