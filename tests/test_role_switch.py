"""A worker's role switched in place under load (issue 52): 2 prefill + 2 decode workers serve
steady streams while decode-1 becomes a prefill worker and then a decode worker again, through
the router's Admin service. Its streams move to decode-0 with their KV: no stream fails, every
greedy token is the one a run without the switch gives, no prompt is prefilled again (the
workers' own count of prompt tokens computed), no KV block stays held; the switch time is
reported. Without the admin token the switch is refused and changes nothing."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest

from baton.serving.processes import free_port
from baton.v1 import admin_pb2, admin_pb2_grpc, router_pb2, router_pb2_grpc
from tests.cluster import Cluster

TOKEN = "switch-secret"
STREAMS, MAX_TOKENS = 6, 48


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # no prefix cache: every run computes every prompt token once, so a recomputed prefix would show
    # (and --max-migrations 0: a stream that could not move with its KV would fail, not recompute)
    metrics_port = free_port()
    c = Cluster.launch(tmp_path_factory.mktemp("role-switch"), prefill=2, decode=2, env={"BATON_ADMIN_TOKEN": TOKEN},
                       worker_args=["--no-prefix-caching"], http=True,
                       router_args=["--max-migrations", "0", "--worker-metrics", "--metrics-port", str(metrics_port)])
    c.metrics_port = metrics_port
    yield c
    c.stop()


def prompts() -> list[str]:
    return [f"Write item {i} of a long numbered list about the rivers of Europe." for i in range(STREAMS)]


def run_streams(c: Cluster, during=None) -> tuple[list[list[int]], list[str]]:
    """Every prompt streamed at once (greedy, ignore_eos); `during()` runs once they all have tokens."""
    stub = c.stub()
    tokens: list[list[int]] = [[] for _ in range(STREAMS)]
    errors: list[str] = []
    started = threading.Barrier(STREAMS + 1)

    def one(i: int, text: str) -> None:
        req = router_pb2.GenerateRequest(text=text, sampling=router_pb2.SamplingParams(
            temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
        first = True
        try:
            for resp in stub.Generate(req, timeout=120):
                tokens[i].extend(resp.token_ids)
                if first and len(tokens[i]) >= 4:
                    first = False
                    started.wait(60)
        except grpc.RpcError as exc:
            errors.append(f"stream {i}: {exc.code().name}: {exc.details()}")
        if first:
            started.abort()
    threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(prompts())]
    for t in threads:
        t.start()
    started.wait(120)
    if during is not None:
        during()
    for t in threads:
        t.join(180)
    return tokens, errors


def admin(c: Cluster, worker: str, role: str, token: str | None = TOKEN) -> admin_pb2.AdminSwitchRoleResponse:
    stub = admin_pb2_grpc.AdminStub(grpc.insecure_channel(c.router.address))
    metadata = [("authorization", f"Bearer {token}")] if token else None
    return stub.SwitchRole(admin_pb2.AdminSwitchRoleRequest(worker=worker, role=role, timeout_ms=30_000),
                           timeout=60, metadata=metadata)


def prefill_tokens(c: Cluster, but: str = "") -> int:
    """Prompt tokens every worker's engine computed (their metrics, through the router's /metrics);
    `but`: leave that worker out (one that restarts: its count starts over)."""
    text = urllib.request.urlopen(c.http_url.removesuffix("/v1") + "/metrics", timeout=10).read().decode()
    found = re.findall(r"^baton_prefill_tokens_total\{([^}]*)\} (\S+)$", text, re.M)
    return int(sum(float(v) for labels, v in found if not but or f'worker="{but}"' not in labels))


def roles(c: Cluster) -> dict[str, str]:
    return {w.address: w.role for w in c.server_info().workers}


def test_a_decode_worker_switches_to_prefill_and_back_under_load(cluster):
    c = cluster
    expected, errors = run_streams(c)
    assert not errors and all(len(t) == MAX_TOKENS for t in expected)
    assert c.wait_workers_idle() == 0
    computed = prefill_tokens(c)
    assert computed > 0
    target = c.worker("decode-1").address
    switched: list = []

    def switch_there_and_back() -> None:
        switched.append(admin(c, target, "prefill"))
        switched.append(roles(c)[target])
        switched.append(admin(c, target, "decode"))
    got, errors = run_streams(c, switch_there_and_back)
    assert not errors, errors
    there, role_between, back = switched
    assert (there.from_role, there.to_role, role_between) == ("decode", "prefill", "prefill")
    assert (back.from_role, back.to_role) == ("prefill", "decode")
    assert there.streams_moved >= 1, there          # some streams were running on decode-1
    assert 0 < there.seconds < 30 and back.seconds < 30
    assert got == expected                          # token for token, as without the switch
    # the moved streams' prefixes were not computed again: the second run computed its prompts, no more
    assert prefill_tokens(c) - computed == computed
    assert c.wait_workers_idle() == 0               # no block held on any worker
    assert roles(c)[target] == "decode"


def test_the_routers_metrics_port_carries_every_workers_series_too(cluster):
    """--worker-metrics: the router's own metrics port is a whole target as its HTTP port's /metrics is (several
    routers of one deployment each have one: `baton top --url A,B` sees the workers through them)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=10).read().decode()
    seen = set(re.findall(r'^baton_kv_blocks_total\{[^}]*worker="([^"]+)"', text, re.M))
    assert seen == set(roles(cluster)), text[-2000:]
    assert re.search(r"^baton_requests_total\{", text, re.M) or "# TYPE baton_requests_total" in text


def test_a_switch_without_the_admin_token_is_refused(cluster):
    c = cluster
    target = c.worker("decode-0").address
    for token in (None, "wrong"):
        with pytest.raises(grpc.RpcError) as err:
            admin(c, target, "prefill", token)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # nor straight to the worker, bypassing the router
    from baton.v1 import decode_pb2, decode_pb2_grpc
    worker = decode_pb2_grpc.DecodeStub(grpc.insecure_channel(target))
    with pytest.raises(grpc.RpcError) as err:
        worker.SwitchRole(decode_pb2.SwitchRoleRequest(role="prefill"), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    time.sleep(0.6)
    assert roles(c)[target] == "decode"
    # a prefill worker (`baton prefill`) cannot switch, and says so
    with pytest.raises(grpc.RpcError) as err:
        admin(c, c.worker("prefill-0").address, "decode")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    out = router_pb2_grpc.RouterStub(grpc.insecure_channel(c.router.address)).Generate(
        router_pb2.GenerateRequest(text="Hello", sampling=router_pb2.SamplingParams(temperature=0, max_tokens=4)),
        timeout=60)
    assert sum(len(r.token_ids) for r in out) == 4


def test_baton_elastic_moves_a_worker_toward_the_plans_split_for_the_mix(cluster, tmp_path):
    """`baton elastic` against this deployment: output-heavy traffic, a plan that wants colocated
    replicas for it; after one window it switches one decode worker to colocated (the move that keeps
    its streams), and requests go on."""
    c = cluster
    plan = {"workloads": {
        "prefill-heavy": {"lengths": {"input": [1000, 2000], "output": [8, 32]}, "slos": {"1000/15": {"best": "2p2d"}}},
        "decode-heavy": {"lengths": {"input": [4, 32], "output": [16, 64]},
                         "slos": {"1000/15": {"best": "4colocated"}}}}}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    elastic = subprocess.Popen(
        [sys.executable, "-m", "baton", "elastic", "--plan", str(tmp_path / "plan.json"), "--addr", c.router.address,
         "--metrics-url", c.http_url.removesuffix("/v1") + "/metrics", "--window", "6", "--windows", "1",
         "--cooldown", "0", "--once"], env=dict(c.env, BATON_ADMIN_TOKEN=TOKEN), stderr=subprocess.PIPE, text=True)
    stub = c.stub()
    deadline = time.monotonic() + 90
    # traffic until its window has been read, however long its start takes (a fixed few requests may end first)
    while elastic.poll() is None and time.monotonic() < deadline:
        chunks = stub.Generate(router_pb2.GenerateRequest(text="Hi", sampling=router_pb2.SamplingParams(
            temperature=0, max_tokens=24, ignore_eos=True)), timeout=60)
        assert sum(len(r.token_ids) for r in chunks) == 24
    _, err = elastic.communicate(timeout=30)
    assert elastic.returncode == 0, err
    assert "decode-heavy -> 4colocated (1/1)" in err and "decode -> colocated in" in err, err
    now = roles(c)
    switched = [a for a, role in now.items() if role == "colocated"]
    assert len(switched) == 1 and sorted(now.values()) == ["colocated", "decode", "prefill", "prefill"]
    out = stub.Generate(router_pb2.GenerateRequest(text="Hello", sampling=router_pb2.SamplingParams(
        temperature=0, max_tokens=4)), timeout=60)
    assert sum(len(r.token_ids) for r in out) == 4
    assert admin(c, switched[0], "decode").to_role == "decode"


def test_a_draining_decode_worker_hands_its_streams_over_with_their_kv(cluster):
    """SIGTERM on a decode worker under load: its streams move to the other decode worker with their KV
    (no prompt computed again, no stream failed, the fault-free tokens), so it exits long before its
    grace (30 s) would let its streams finish there."""
    c = cluster
    victim = c.worker("decode-1")
    before = prefill_tokens(c, but=victim.address)
    expected, errors = run_streams(c)
    assert not errors
    computed = prefill_tokens(c, but=victim.address) - before
    drained: list[float] = []

    def drain() -> None:
        t0 = time.monotonic()
        victim.popen.send_signal(signal.SIGTERM)
        assert victim.popen.wait(25) == 0
        drained.append(time.monotonic() - t0)
    got, errors = run_streams(c, drain)
    assert not errors, errors
    assert got == expected
    assert drained[0] < 15, drained
    assert prefill_tokens(c, but=victim.address) - before == 2 * computed
    victim.start(c.env, c.log_dir)
    victim.wait_ready()
    c.wait_health(victim.address, healthy=True)
    assert c.wait_workers_idle() == 0


def test_a_switch_that_would_leave_no_worker_to_decode_or_prefill_is_refused_up_front():
    """Checked before the worker is asked (no stub here: a call would fail otherwise): the router's last healthy
    decoding worker cannot become a prefill one, nor its last prefilling one a decode one; with another of the
    kind (or a colocated worker, which does both) left, the switch goes ahead."""
    import asyncio
    from types import SimpleNamespace

    from baton.router.admin import switch_role
    from baton.serving.grpc_server import ServiceError

    def worker(address, role, healthy=True):
        return SimpleNamespace(address=address, target=address, role=role, healthy=healthy, retired=False,
                               status=SimpleNamespace(switchable=True), decode_stub=None)

    def refusal(workers, address, role):
        svc = SimpleNamespace(cfg=SimpleNamespace(admin_token=TOKEN), registry=SimpleNamespace(workers=workers),
                              metrics=None)
        req = admin_pb2.AdminSwitchRoleRequest(worker=address, role=role)
        try:
            asyncio.run(switch_role(svc, req, (("authorization", f"Bearer {TOKEN}"),)))
        except ServiceError as exc:
            return exc.code, str(exc)
        except AttributeError:          # past the checks: it went on to call the worker (decode_stub None)
            return None

    code, why = refusal([worker("p:1", "prefill"), worker("d:1", "decode"), worker("d:2", "decode", healthy=False)],
                        "d:1", "prefill")
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "only healthy worker that decodes" in why, why
    code, why = refusal([worker("p:1", "prefill"), worker("d:1", "decode")], "p:1", "decode")
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "only healthy worker that prefills" in why, why
    assert refusal([worker("c:1", "colocated")], "c:1", "decode")[0] == grpc.StatusCode.FAILED_PRECONDITION
    assert refusal([worker("p:1", "prefill"), worker("d:1", "decode"), worker("d:2", "decode")], "d:1", "prefill") \
        is None
    assert refusal([worker("c:1", "colocated"), worker("d:1", "decode")], "d:1", "prefill") is None
    assert refusal([worker("c:1", "colocated"), worker("c:2", "colocated")], "c:1", "decode") is None
