"""Two prefill + two decode workers: load spreads by policy, a killed decode worker's
requests end with a status or are retried, the survivor takes new work, and a restarted
worker returns to rotation."""
from __future__ import annotations

import concurrent.futures as cf
import time

import grpc
import pytest
from baton.v1 import router_pb2
from cluster import Cluster
from test_services import collect, greedy

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster.launch(tmp_path_factory.mktemp("logs"), prefill=2, decode=2,
                       worker_args=["--num-kv-blocks", "256"], router_args=["--policy", "round_robin"])
    yield c
    c.stop()


def test_round_robin_spreads_requests_over_both_decode_workers(cluster):
    stub = cluster.stub()
    before = _request_counts(cluster)
    for i in range(4):
        collect(stub, router_pb2.GenerateRequest(text=f"Item {i}:", sampling=greedy(3)))
    after = _request_counts(cluster)
    used = [name for name in after if after[name] > before.get(name, 0)]
    assert sorted(used) == ["decode-0", "decode-1", "prefill-0", "prefill-1"]


def _request_counts(c: Cluster) -> dict[str, int]:
    """Requests each worker has finished, from its own GetStatus."""
    from baton.v1 import decode_pb2_grpc, prefill_pb2_grpc, worker_pb2
    counts = {}
    for p in c.procs:
        if p.name == "router":
            continue
        ch = grpc.insecure_channel(p.address)
        stub = (prefill_pb2_grpc.PrefillStub if p.name.startswith("prefill") else decode_pb2_grpc.DecodeStub)(ch)
        try:
            counts[p.name] = stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=5).requests_served
        except grpc.RpcError:
            counts[p.name] = -1
        ch.close()
    return counts


def test_killing_a_decode_worker_mid_stream_ends_or_retries_its_requests(cluster):
    stub = cluster.stub()
    victim = cluster.worker("decode-1")
    results: dict[int, object] = {}

    def run(i):
        try:
            return collect(stub, router_pb2.GenerateRequest(text=f"Story {i}: once upon a time",
                                                            sampling=greedy(150)), timeout=120)
        except grpc.RpcError as exc:
            return exc

    with cf.ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(run, i) for i in range(8)]
        time.sleep(2.5)              # streams are under way on both decode workers
        victim.kill()
        for i, f in enumerate(futs):
            results[i] = f.result(timeout=180)
    statuses = [r.code() if isinstance(r, grpc.RpcError) else "ok" for r in results.values()]
    assert all(s == "ok" or s == grpc.StatusCode.UNAVAILABLE for s in statuses), statuses
    assert "ok" in statuses
    cluster.wait_health(victim.address, healthy=False)
    # new requests all go to the survivor and succeed
    for i in range(4):
        ids, _, last = collect(stub, router_pb2.GenerateRequest(text=f"After {i}", sampling=greedy(4)))
        assert len(ids) == 4
    info = cluster.wait_blocks_free()
    assert [w.healthy for w in info.workers if w.address == victim.address] == [False]


def test_restarted_decode_worker_returns_to_rotation(cluster):
    victim = cluster.worker("decode-1")
    if victim.alive:
        victim.kill()
    victim.start(cluster.env, cluster.log_dir)
    victim.wait_ready()
    cluster.wait_health(victim.address, healthy=True)
    before = _request_counts(cluster)["decode-1"]
    stub = cluster.stub()
    for i in range(4):
        collect(stub, router_pb2.GenerateRequest(text=f"Back {i}", sampling=greedy(3)))
    assert _request_counts(cluster)["decode-1"] > before
    cluster.wait_blocks_free()


def test_killing_a_prefill_worker_retries_on_the_other(cluster):
    stub = cluster.stub()
    victim = cluster.worker("prefill-0")
    victim.kill()
    for i in range(4):          # some of these are routed to the dead one first and retried
        ids, _, _ = collect(stub, router_pb2.GenerateRequest(text=f"Retry {i}", sampling=greedy(3)))
        assert len(ids) == 3
    cluster.wait_health(victim.address, healthy=False)
    cluster.restart("prefill-0")
    cluster.wait_health(victim.address, healthy=True)
