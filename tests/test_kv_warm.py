"""KV channels warmed before traffic (issue 49): the router has each healthy prefill worker open,
handshake and set up its KV sender to each healthy decode worker (`Prefill.ConnectKV`) as soon
as the pair is healthy, so the pair's first transfer pays none of it; again after a worker
restarts; a warm-up that cannot finish fails within its timeout and nothing else notices.
Routing prefers warm pairs and never waits for one.

The cluster tests run real processes (router, prefill and decode workers on the embedded model);
the routing preference is checked in-process against the router's own pick. Two GPUs: the last
test warms a direct (NCCL) pair and times the first transfer after it.
"""
from __future__ import annotations

import asyncio
import socket
import time
import urllib.request

import grpc
import pytest
import torch
from cluster import Cluster
from prometheus_client.parser import text_string_to_metric_families

from baton.router.config import RouterConfig
from baton.router.registry import KVPairs, Registry, Worker
from baton.router.server import RouterService, kv_backend
from baton.serving.processes import free_port
from baton.v1 import prefill_pb2, prefill_pb2_grpc, router_pb2, worker_pb2

pytestmark = pytest.mark.timeout(240)
WAIT_S = 60.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Router + one prefill + one decode worker of its own (a test restarts the decode worker)."""
    port = free_port()
    c = Cluster.launch(tmp_path_factory.mktemp("kv-warm"), prefill=1, decode=1,
                       worker_args=["--num-kv-blocks", "64", "--max-num-seqs", "4"],
                       extra={"prefill-0": ["--metrics-port", str(port)]})
    c.prefill_metrics = f"http://127.0.0.1:{port}/metrics"
    yield c
    c.stop()


def scrape(url: str) -> dict[tuple, float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def handshakes(c: Cluster, by: str) -> float:
    return scrape(c.prefill_metrics).get(("baton_kv_handshakes_total", (("backend", "grpc"), ("by", by))), 0.0)


def warmups(c: Cluster) -> float:
    return scrape(c.prefill_metrics).get(("baton_kv_warmup_seconds_count", (("backend", "grpc"),)), 0.0)


def sent_bytes(c: Cluster) -> float:
    return scrape(c.prefill_metrics).get(("baton_kv_transfer_bytes_total", (("direction", "out"),)), 0.0)


def wait_until(what, timeout: float = WAIT_S, why: str = ""):
    deadline = time.monotonic() + timeout
    while not (value := what()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g}s: {why}")
        time.sleep(0.2)
    return value


def warm_lines(c: Cluster) -> list[str]:
    p, d = c.worker("prefill-0").address, c.worker("decode-0").address
    return [line for line in c.router.tail(400).splitlines() if f"KV pair {p} -> {d} (grpc) warm in" in line]


def generate(c: Cluster, text: str = "The capital of France is") -> list[int]:
    req = router_pb2.GenerateRequest(text=text, sampling=router_pb2.SamplingParams(temperature=0, max_tokens=4,
                                                                                  ignore_eos=True))
    return [t for r in c.stub().Generate(req, timeout=60) for t in r.token_ids]


def test_the_pair_is_warm_before_the_first_request_which_then_opens_no_channel(stack):
    wait_until(lambda: warm_lines(stack), why="the router logs the pair warmed")
    wait_until(lambda: warmups(stack) >= 1, why="the prefill worker records the warm-up")
    assert handshakes(stack, "warm-up") == 1 and handshakes(stack, "request") == 0
    assert "warm in" in warm_lines(stack)[0] and " ms" in warm_lines(stack)[0]
    out_before = sent_bytes(stack)
    assert len(generate(stack)) == 4
    # the core's metrics arrive in order: once the transfer's bytes are in, a handshake it made would be too
    wait_until(lambda: sent_bytes(stack) > out_before, why="the first transfer is recorded")
    assert handshakes(stack, "request") == 0 and handshakes(stack, "warm-up") == 1


class SilentPeer:
    """A TCP port that accepts connections and never says a word (no HTTP/2 settings)."""

    def __enter__(self) -> str:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        return f"127.0.0.1:{self.sock.getsockname()[1]}"

    def __exit__(self, *exc) -> None:
        self.sock.close()


def test_warming_a_peer_that_never_answers_fails_within_its_timeout_and_serving_goes_on(stack):
    prefill = stack.worker("prefill-0")
    with grpc.insecure_channel(prefill.address) as ch, SilentPeer() as silent:
        stub = prefill_pb2_grpc.PrefillStub(ch)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as hung:
            stub.ConnectKV(prefill_pb2.ConnectKVRequest(decode_address=silent, backend="grpc", timeout_ms=1000),
                           timeout=20)
        seconds = time.monotonic() - t0
        with pytest.raises(grpc.RpcError) as refused:           # nobody listens there at all
            stub.ConnectKV(prefill_pb2.ConnectKVRequest(decode_address=f"127.0.0.1:{free_port()}",
                                                        backend="grpc", timeout_ms=1000), timeout=20)
    assert hung.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and seconds < 3, (hung.value, seconds)
    assert "within 1s" in hung.value.details() or "KV warm-up" in hung.value.details()
    assert refused.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert len(generate(stack, "Two plus two is")) == 4
    assert prefill.status().role == "prefill" and "Traceback" not in prefill.tail(400)


def test_a_restarted_decode_worker_is_warmed_again(stack):
    wait_until(lambda: warmups(stack) >= 1, why="the first warm-up")
    before, lines = warmups(stack), len(warm_lines(stack))
    stack.restart("decode-0")
    wait_until(lambda: warmups(stack) > before, why="the restarted decode worker is warmed")
    assert len(warm_lines(stack)) == lines + 1
    out_before = sent_bytes(stack)
    assert len(generate(stack)) == 4
    wait_until(lambda: sent_bytes(stack) > out_before, why="the transfer is recorded")
    assert handshakes(stack, "request") == 0          # its new KV address was handshaken by the warm-up


# -- routing: warm pairs first, cold ones when nothing else is healthy (the router's pick, in-process) --
def worker(address: str, role: str) -> Worker:
    return Worker(address, role, healthy=True, status=worker_pb2.WorkerStatus(
        role=role, kv_backends=["grpc"], kv_address=f"kv-{address}"))


def router(workers: list[Worker]) -> RouterService:
    reg = Registry([w.address for w in workers if w.role == "prefill"],
                   [w.address for w in workers if w.role == "decode"], [], "m")
    reg.workers = workers
    info = router_pb2.ModelInfo(name="m", max_model_len=4096, vocab_size=50_000)
    return RouterService(reg, None, info, RouterConfig(prefill=["p:1"], decode=["d:1"], policy="round_robin"))


def picks(svc: RouterService, n: int, tried: set[str] = frozenset()) -> set[tuple[str, str]]:
    return {(d.address, p.address) for d, p in (svc._pick_pair([1], set(tried)) for _ in range(n))}


def test_routing_prefers_warm_pairs_and_uses_cold_ones_when_nothing_else_is_healthy():
    p1, p2, d1, d2 = (worker("p1:1", "prefill"), worker("p2:1", "prefill"), worker("d1:1", "decode"),
                      worker("d2:1", "decode"))
    svc = router([p1, p2, d1, d2])
    assert picks(svc, 8) == {("d1:1", "p1:1"), ("d2:1", "p2:1")}         # none warm: round robin
    svc.kv_pairs.warm[("p2:1", "d1:1")] = ("kv-d1:1", "grpc")
    assert picks(svc, 8) == {("d1:1", "p2:1")}
    d1.status.kv_address = "kv-elsewhere"            # d1 restarted on a new KV port: that pair is cold again
    assert picks(svc, 8) == {("d1:1", "p1:1"), ("d2:1", "p2:1")}
    svc.kv_pairs.warm[("p1:1", "d1:1")] = ("kv-elsewhere", "grpc")
    assert picks(svc, 4, {"d1:1"}) == {("d2:1", "p1:1"), ("d2:1", "p2:1")}   # a retry avoids d1: cold, not refused


def test_a_pair_whose_warm_up_fails_is_retried_later_and_one_that_left_is_forgotten():
    class Stub:
        def __init__(self, fail: bool):
            self.fail, self.calls = fail, []

        async def ConnectKV(self, req, timeout=None):        # noqa: N802 - the RPC's name
            self.calls.append((req.decode_address, req.backend, timeout))
            if self.fail:
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           "no route")
            return prefill_pb2.ConnectKVResponse(seconds=0.01, handshaken=True)

    p1, p2, d = worker("p1:1", "prefill"), worker("p2:1", "prefill"), worker("d:1", "decode")
    p1.stub, p2.stub = Stub(fail=False), Stub(fail=True)
    p1.prefill_stub, p2.prefill_stub = p1.stub, p2.stub
    pairs = KVPairs(kv_backend, timeout=1.0, retry_after=0.3)

    async def main():
        pairs.reconcile([p1, p2, d])
        await asyncio.wait_for(asyncio.gather(*pairs.warming.values()), 5)
        assert pairs.is_warm(p1, d) and not pairs.is_warm(p2, d) and ("p2:1", "d:1") in pairs.retry_at
        assert p1.stub.calls == [("kv-d:1", "grpc", 3.0)]
        pairs.reconcile([p1, p2, d])                      # too soon to try p2 again
        assert not pairs.warming and len(p2.stub.calls) == 1
        await asyncio.sleep(0.35)
        pairs.reconcile([p1, p2, d])
        await asyncio.wait_for(asyncio.gather(*pairs.warming.values()), 5)
        assert len(p2.stub.calls) == 2
        d.healthy = False                                 # down (a restart): its pairs are forgotten ...
        pairs.reconcile([p1, p2, d])
        assert not pairs.warm and not pairs.retry_at
        d.healthy = True                                  # ... and warmed again once it is back
        pairs.reconcile([p1, p2, d])
        await asyncio.wait_for(asyncio.gather(*pairs.warming.values()), 5)
        assert pairs.is_warm(p1, d) and len(p1.stub.calls) == 2
    asyncio.run(asyncio.wait_for(main(), 20))


# -- two GPUs: a direct (NCCL) pair warmed, then its first transfer ------------------------------------
@pytest.mark.device
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (device-direct KV over NCCL)")
def test_a_warmed_nccl_pair_makes_the_first_transfer_as_fast_as_the_next():
    from baton.benchmarks.kv_loopback import direct_loopback
    from baton.kvtransfer.backend import TransferDescriptor

    n = 64 << 20
    payload = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:0")

    async def main():
        landed = {}
        async with direct_loopback("cuda:0", "cuda:1") as (pending, sender, receiver):
            t0 = time.perf_counter()
            await sender.warm(60)
            warm_s, pair = time.perf_counter() - t0, sender.pair
            seconds = []
            for tid in ("first", "second", "third"):
                pending.expect(tid, n, 30, lambda t, p, *_: landed.__setitem__(t, p), lambda t, why: None)
                t0 = time.perf_counter()
                await sender.send(TransferDescriptor(tid, nbytes=n), payload, 1, timeout=30)
                seconds.append(time.perf_counter() - t0)
            return warm_s, seconds, sender.pair is pair, landed
    warm_s, (first, *rest), same_pair, landed = asyncio.run(main())
    print(f"[kv-warm] NCCL pair warmed in {warm_s * 1e3:.0f} ms; transfers of 64 MiB after it: first "
          f"{first * 1e3:.1f} ms, then {', '.join(f'{s * 1e3:.1f}' for s in rest)} ms")
    assert same_pair and torch.equal(landed["first"].cpu(), payload.cpu())
    assert first < max(0.05, 3 * max(rest)), "the first transfer still paid for a set-up"
