"""The chaos suite: real router, 2 prefill and 2 decode processes on loopback, faults injected
while known-answer traffic runs. decode-0's KV channel goes through a `FaultyLink` proxy, so
the link between prefill and decode can be partitioned or cut mid-transfer.

Every scenario checks the same things: each request ends with a terminal status within its
deadline (nothing lost), completed requests carry the known greedy answer (nothing
corrupted), and no KV block stays held on any survivor. Figures go to the reliability
report (tests/reliability.py; docs/reliability.md quotes one run). BATON_SOAK=1 runs
bigger loads by hand.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import sys
import time
import urllib.request

import grpc
import psutil
import pytest
from cluster import Cluster, Proc, children
from grpc_health.v1 import health_pb2, health_pb2_grpc
from netfault import FaultyLink
from prometheus_client.parser import text_string_to_metric_families
from reliability import Load, Outcomes

from baton.engine import SamplingParams
from baton.serving.grpc_server import retry_after_ms
from baton.serving.processes import free_port
from baton.v1 import decode_pb2, decode_pb2_grpc, router_pb2, router_pb2_grpc

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("one_torch_thread")]

SOAK = os.environ.get("BATON_SOAK") == "1"
PROMPTS = ["The quick brown fox", "def quicksort(arr):", "1, 2, 3,", "Once upon a time"]
LONG_PROMPTS = [f"Chapter {i}. " + "The river ran past the old mill and the miller counted sacks. " * 14
                for i in range(2)]
N_TOKENS = 6
STORIES = [f"Story {i}: once upon a time" for i in range(12)]
STORY_TOKENS = 40                # long enough that every stream is mid-flight at the fault, no longer
FIRST_TOKEN_TIMEOUT_S = 8


def greedy(n: int) -> router_pb2.SamplingParams:
    return router_pb2.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def known(embedded_llm):
    """prompt -> the offline engine's greedy tokens: the answer every survivor must give."""
    prompts = PROMPTS + LONG_PROMPTS
    outs = embedded_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True))
    return {p: o.token_ids for p, o in zip(prompts, outs, strict=True)}


@pytest.fixture(scope="module")
def link():
    port = free_port()
    proxy = FaultyLink(("127.0.0.1", port))
    proxy.kv_port = port                # decode-0's engine core takes KV pushes there
    yield proxy
    proxy.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, link):
    metrics_port = free_port()
    c = Cluster.launch(tmp_path_factory.mktemp("logs"), prefill=2, decode=2,
                       # (a worker's own watchdog ends a hung core after --engine-hang-timeout: the hang tests
                       # hold one for as long as its streams take to migrate, on a loaded 2-core box 25-35 s)
                       worker_args=["--num-kv-blocks", "256", "--grace", "60", "--fault-hooks",
                                    "--engine-hang-timeout", "90"],
                       router_args=["--policy", "round_robin", "--first-token-timeout", str(FIRST_TOKEN_TIMEOUT_S),
                                    "--grace", "60", "--metrics-port", str(metrics_port)],
                       extra={"decode-0": ["--kv-port", str(link.kv_port), "--kv-advertise", link.address]})
    c.router_metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    yield c
    c.stop()


def revive(c: Cluster, but: tuple[str, ...] = ()) -> None:
    """Start again, all at once, every process an earlier scenario left dead (but those named), and
    wait until each serves and the router counts it healthy: a scenario that kills a process leaves
    its restart to the next one that needs it (one start, not two, where that one kills it anyway)."""
    dead = [p for p in c.procs if not p.alive and p.name not in but]
    for p in dead:
        p.start(c.env, c.log_dir)
    for p in dead:
        p.wait_ready(c.tls)
    for p in dead:
        if p is not c.router:
            c.wait_health(p.address, healthy=True)


@pytest.fixture
def cluster(stack):
    """The module's stack with every process up."""
    revive(stack)
    return stack


def known_load(cluster, known, n: int, deadline: float = 60.0, prompts=PROMPTS, stub=None) -> Load:
    load = Load(stub or cluster.stub(), workers=n)
    for i in range(n):
        p = prompts[i % len(prompts)]
        load.submit(router_pb2.GenerateRequest(text=p, sampling=greedy(N_TOKENS)), known[p], deadline)
    return load


def settle(cluster, timeout: float = 20.0) -> int:
    return cluster.wait_workers_idle(timeout)


# -- routing and worker loss ------------------------------------------------------------------
def test_round_robin_spreads_requests_over_every_worker(cluster, known):
    before = {p.name: p.status().requests_served for p in cluster.procs if p is not cluster.router}
    out = known_load(cluster, known, 4).wait()
    out.assert_clean()
    assert out.completed == 4
    after = {p.name: p.status().requests_served for p in cluster.procs if p is not cluster.router}
    assert sorted(n for n in after if after[n] > before[n]) == ["decode-0", "decode-1", "prefill-0", "prefill-1"]
    assert settle(cluster) == 0


@pytest.fixture(scope="module")
def known_long(embedded_llm):
    """The fault-free greedy tokens of the long streams a migration must reproduce exactly."""
    outs = embedded_llm.generate(STORIES, SamplingParams(temperature=0, max_tokens=STORY_TOKENS, ignore_eos=True))
    return {p: o.token_ids for p, o in zip(STORIES, outs, strict=True)}


def story_load(cluster, known_long, n: int = 24, ids: dict[int, str] | None = None) -> Load:
    load = Load(cluster.stub(), workers=n)
    for i in range(n):
        p = STORIES[i % len(STORIES)]
        load.submit(router_pb2.GenerateRequest(text=p, sampling=greedy(STORY_TOKENS), request_id=(ids or {}).get(i, "")),
                    known_long[p], 120)
    return load


def test_sigkill_of_a_decode_worker_mid_stream_migrates_every_stream(cluster, known_long, reliability):
    """24 greedy streams on both decode workers; one is killed mid-stream: the router moves
    its streams to the survivor and every client gets exactly the fault-free tokens."""
    victim = cluster.worker("decode-1")
    load = story_load(cluster, known_long)
    load.wait_streaming(5)
    on_victim = victim.status().running
    t0 = time.monotonic()
    victim.kill()
    out = load.wait()
    out.assert_clean()
    assert out.completed == out.sent == 24, out
    assert on_victim > 0
    leaked = settle(cluster)
    reliability.record("SIGKILL decode mid-stream (24 streams)", out, leaked_blocks=leaked, migrated=on_victim,
                       lost=0, client_stall_s=round(load.longest_gap_s, 2),
                       all_done_after_kill_s=round(time.monotonic() - t0, 1))
    assert leaked == 0


def test_the_same_decode_worker_killed_again_and_aborts_during_the_migration(cluster, known_long, reliability):
    """decode-1 back, then killed again under 24 streams, and 8 of them aborted by their
    clients right as they migrate: the aborted end CANCELLED (or finish, if they were done), the
    others finish exactly, and no block stays held anywhere."""
    victim = cluster.worker("decode-1")            # back: the fixture started it again
    ids = {i: f"migrating-abort-{i}" for i in range(0, 24, 3)}
    load = story_load(cluster, known_long, ids=ids)
    load.wait_streaming(5)
    assert victim.status().running > 0
    stub = cluster.stub()
    victim.kill()
    found = [stub.Abort(router_pb2.AbortRequest(request_id=rid), timeout=5).found for rid in ids.values()]
    out = load.wait()
    out.assert_clean()
    assert set(out.statuses) <= {"CANCELLED"}, out
    assert out.completed + out.statuses["CANCELLED"] == 24 and out.completed >= 16, out
    assert out.statuses["CANCELLED"] == sum(found), (out, found)
    leaked = settle(cluster)
    reliability.record("SIGKILL the same decode again, 8 clients abort as it migrates", out, leaked_blocks=leaked,
                       client_stall_s=round(load.longest_gap_s, 2))
    assert leaked == 0


def test_restarted_decode_worker_returns_to_rotation(stack, known):
    """decode-1 killed (by the scenario before, or here) and started again takes requests."""
    cluster = stack
    revive(cluster, but=("decode-1",))
    victim = cluster.worker("decode-1")
    victim.kill()
    victim.start(cluster.env, cluster.log_dir)
    victim.wait_ready()
    cluster.wait_health(victim.address, healthy=True)
    before = victim.status().requests_served
    known_load(cluster, known, 4).wait().assert_clean()
    assert victim.status().requests_served > before
    assert settle(cluster) == 0


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                          "city": {"type": "string", "maxLength": 40},
                                          "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                      "maxItems": 3}},
          "required": ["name", "city", "hobbies"], "additionalProperties": False}
PEOPLE = [f"Describe a person who lives in {city}, in JSON." for city in ("Paris", "Oslo", "Lima", "Cairo", "Quito", "Hanoi")]


@pytest.fixture(scope="module")
def known_json(embedded_llm):
    """The fault-free greedy JSON of each question (each a complete, valid instance)."""
    from baton.engine import StructuredOutput
    outs = embedded_llm.chat([[{"role": "user", "content": q}] for q in PEOPLE],
                             SamplingParams(temperature=0, max_tokens=96, structured=StructuredOutput.json(PERSON)))
    assert all(o.finish_reason == "stop" for o in outs)
    return {q: o.token_ids for q, o in zip(PEOPLE, outs, strict=True)}


def test_json_schema_streams_keep_their_grammar_across_a_migration(cluster, known_json, reliability):
    """12 JSON-schema streams, decode-1 killed under them: the survivor re-prefills prompt + output so
    far and its matcher replays that output, so every client gets the fault-free JSON, token for token
    (a matcher started afresh would force `{"` again mid-object)."""
    victim = cluster.worker("decode-1")
    load = Load(cluster.stub(), workers=12)
    schema = router_pb2.StructuredOutput(json_schema=json.dumps(PERSON))
    for i in range(12):
        q = PEOPLE[i % len(PEOPLE)]
        chat = router_pb2.Chat(messages=[router_pb2.ChatMessage(role="user", content=q)])
        load.submit(router_pb2.GenerateRequest(chat=chat, sampling=router_pb2.SamplingParams(
            temperature=0, max_tokens=96, structured=schema)), known_json[q], 120)
    load.wait_streaming(3)
    on_victim = victim.status().running
    victim.kill()
    out = load.wait()
    out.assert_clean()
    assert out.completed == out.sent == 12, out
    assert on_victim > 0
    leaked = settle(cluster)
    reliability.record("SIGKILL decode under 12 JSON-schema streams", out, leaked_blocks=leaked, migrated=on_victim)
    assert leaked == 0


# -- hung workers: alive, ports open, no progress ----------------------------------------------------
def _signal(proc: Proc, sig: int) -> None:
    """The worker's processes (its front and its engine core) all at once, as a hung host would be."""
    for pid in [proc.popen.pid, *children(proc.popen.pid)]:
        os.kill(pid, sig)


def _losses(cluster, how: str) -> float:
    """The router's baton_worker_losses_total{how=...}, all roles."""
    text = urllib.request.urlopen(cluster.router_metrics, timeout=5).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "baton_worker_losses_total" and s.labels.get("how") == how)


def test_a_hung_engine_core_behind_a_live_front_is_left(cluster, known_long, reliability):
    """Only the engine core stops (a hung device, say): the front still answers health checks, but
    reports the core silent (its pulse stopped); past the router's 5 s grace it leaves the worker and
    its streams migrate. After SIGCONT the core catches up, every block is freed, the worker rejoins."""
    victim = cluster.worker("decode-1")
    hung = _losses(cluster, "hung")
    load = story_load(cluster, known_long)
    load.wait_streaming(5)
    [core] = children(victim.popen.pid)
    os.kill(core, signal.SIGSTOP)
    try:
        out = load.wait()
    finally:
        os.kill(core, signal.SIGCONT)
    out.assert_clean()
    assert out.completed == out.sent == 24, out
    assert load.longest_gap_s < 9.0, load.longest_gap_s         # the 5 s floor, a check round, the move
    cluster.wait_health(victim.address, healthy=True)
    leaked = settle(cluster)
    reliability.record("SIGSTOP decode's engine core only (24 streams), SIGCONT after", out, leaked_blocks=leaked,
                       client_stall_s=round(load.longest_gap_s, 2))
    assert leaked == 0 and _losses(cluster, "hung") == hung + 1


def test_an_engine_core_stuck_inside_one_step_is_left(cluster, known_long, reliability):
    """The core is held inside one model step (--fault-hooks' SIGUSR1: an endless loop, a deadlocked
    collective): it still pulses, but the step runs past its budget (its expected cost x 10, at
    least 5 s: these steps take milliseconds), so after the router's grace the worker is left and
    its streams migrate. SIGUSR2 lets the step end once the router has left the worker (held for
    longer, its own watchdog would end it: --engine-hang-timeout past the budget): every block is
    freed, the worker rejoins."""
    victim = cluster.worker("decode-1")
    hung = _losses(cluster, "hung")
    load = story_load(cluster, known_long)
    load.wait_streaming(5)
    [core] = children(victim.popen.pid)
    os.kill(core, signal.SIGUSR1)
    try:
        budget = _held_step_budget(victim)
        deadline = time.monotonic() + budget + 20
        while _losses(cluster, "hung") == hung and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        os.kill(core, signal.SIGUSR2)
    out = load.wait()
    out.assert_clean()
    assert out.completed == out.sent == 24, out
    assert budget < 60, budget                       # decode steps of milliseconds: a budget of seconds
    # the step's budget, the router's grace, a check round and the move (on a loaded box steps run slower,
    # so their budget grows with them: the bound is the detector's own)
    assert load.longest_gap_s < budget + 9.0, (load.longest_gap_s, budget)
    cluster.wait_health(victim.address, healthy=True)
    leaked = settle(cluster)
    reliability.record("decode's engine core held inside one step (24 streams), released after", out,
                       leaked_blocks=leaked, client_stall_s=round(load.longest_gap_s, 2))
    assert leaked == 0 and _losses(cluster, "hung") == hung + 1


def _held_step_budget(victim: Proc, timeout: float = 10.0) -> float:
    """The budget the worker reports for the step its core is held in."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = victim.status()
        if status.busy_seconds > 1.0:
            return status.busy_budget_seconds
        time.sleep(0.2)
    raise AssertionError("the core was never seen inside a held step")


def test_a_hung_decode_worker_is_left_within_seconds(cluster, known_long, reliability):
    """SIGSTOP mid-stream: the router's health check of it times out within ~2.5 s, the router closes
    its token bus, and every stream there migrates: no client waits 5 s for its next token, and each
    gets the fault-free tokens. After SIGCONT the worker finds its streams gone (their bus ended),
    frees every block, and rejoins. The router counts a hang, not a death."""
    victim = cluster.worker("decode-1")
    hung = _losses(cluster, "hung")
    load = story_load(cluster, known_long)
    load.wait_streaming(5)
    on_victim = victim.status().running
    t0 = time.monotonic()
    _signal(victim, signal.SIGSTOP)
    try:
        out = load.wait()
        done_s = time.monotonic() - t0
    finally:
        _signal(victim, signal.SIGCONT)
    out.assert_clean()
    assert out.completed == out.sent == 24 and on_victim > 0, out
    assert load.longest_gap_s < 5.0, load.longest_gap_s
    cluster.wait_health(victim.address, healthy=True)
    leaked = settle(cluster)
    reliability.record("SIGSTOP decode mid-stream (24 streams), SIGCONT after", out, leaked_blocks=leaked,
                       migrated=on_victim, client_stall_s=round(load.longest_gap_s, 2),
                       all_done_after_hang_s=round(done_s, 1))
    assert leaked == 0 and _losses(cluster, "hung") == hung + 1


def test_a_hung_prefill_worker_is_left_within_seconds(cluster, known, reliability):
    """SIGSTOP while it prefills long prompts: the router leaves it within seconds (not at the
    first-token timeout) and retries its requests on the other prefill worker; after SIGCONT it
    frees every block and rejoins."""
    victim = cluster.worker("prefill-0")
    hung = _losses(cluster, "hung")
    load = known_load(cluster, known, 16, prompts=LONG_PROMPTS)
    time.sleep(0.2)                                  # its share of the prompts is in its engine now
    t0 = time.monotonic()
    _signal(victim, signal.SIGSTOP)
    try:
        cluster.wait_health(victim.address, healthy=False)
        left_s = time.monotonic() - t0
        out = load.wait()
    finally:
        _signal(victim, signal.SIGCONT)
    out.assert_clean()
    assert out.completed == out.sent, out.summary()
    assert left_s < 4.0, left_s                      # its requests moved then, not at the first-token timeout
    cluster.wait_health(victim.address, healthy=True)
    leaked = settle(cluster)
    reliability.record("SIGSTOP prefill during long prefills, SIGCONT after", out, leaked_blocks=leaked,
                       left_after_s=round(left_s, 2), slowest_request_s=round(out.slowest_s, 2))
    assert leaked == 0 and _losses(cluster, "hung") == hung + 1


def test_sigkill_of_a_prefill_worker_is_retried_on_the_other(cluster, known, reliability):
    victim = cluster.worker("prefill-0")
    victim.kill()
    out = known_load(cluster, known, 6).wait()      # some are routed to the dead one first and retried
    out.assert_clean()
    assert out.completed == out.sent, out.summary()
    cluster.wait_health(victim.address, healthy=False)
    leaked = settle(cluster)
    reliability.record("SIGKILL idle prefill (retry)", out, leaked_blocks=leaked)
    assert leaked == 0


# -- the KV link --------------------------------------------------------------------------------
def _prefill_holding(cluster, link: FaultyLink) -> Proc | None:
    """The prefill worker with a TCP connection into the proxy (its KV push is what stalled: its
    engine core, a child of the worker's process, pushes it)."""
    ports = link.client_ports()
    for p in cluster.procs:
        if not p.name.startswith("prefill") or not p.alive:
            continue
        worker = psutil.Process(p.popen.pid)
        for proc in (worker, *worker.children(recursive=True)):
            if any(c.laddr and c.laddr.port in ports for c in proc.net_connections(kind="tcp")):
                return p
    return None


def test_sigkill_of_a_prefill_worker_mid_transfer(cluster, link, known, reliability):
    """The proxy lets 256 KiB of a multi-MiB KV push through, then holds the rest; the prefill
    worker doing that push is killed while its transfer is half done."""
    link.stall_after(256 << 10)
    load = known_load(cluster, known, 4, prompts=LONG_PROMPTS)
    deadline = time.monotonic() + 30
    while not link.stalled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert link.stalled, "no KV push reached the proxy"
    victim = _prefill_holding(cluster, link)
    assert victim is not None
    victim.kill()
    link.open()
    during = known_load(cluster, known, 4)
    out = load.wait()
    out.merge(during.wait())
    out.assert_clean()
    assert out.completed == out.sent, out.summary()       # retried on the surviving prefill worker
    leaked = settle(cluster)
    reliability.record("SIGKILL prefill mid-transfer", out, leaked_blocks=leaked,
                       transfer_cut_after_kib=256)
    assert leaked == 0


def test_partition_between_prefill_and_decode(cluster, link, known, reliability):
    """decode-0 stops hearing from every prefill worker: attempts through it get no first token
    within --first-token-timeout and are retried on decode-1; a request whose deadline is
    shorter than that ends DEADLINE_EXCEEDED on time; nothing stays held."""
    link.stall()
    try:
        load = known_load(cluster, known, 8, deadline=60)
        short = known_load(cluster, known, 2, deadline=2.5)
        held = 0
        t_end = time.monotonic() + 10
        while held == 0 and time.monotonic() < t_end:
            held = link.held()
            time.sleep(0.1)
        out = load.wait()
        s = short.wait()
    finally:
        link.open()
    assert held > 0, "the partition was never hit"
    out.assert_clean()
    s.assert_clean()
    assert out.completed == out.sent, out.summary()
    assert set(s.statuses) <= {"DEADLINE_EXCEEDED"}, s.summary()
    out.merge(s)
    leaked = settle(cluster, 30)
    reliability.record("partition prefill -> decode (stalled transfer)", out, leaked_blocks=leaked,
                       bytes_held_by_partition=held, first_token_timeout_s=FIRST_TOKEN_TIMEOUT_S)
    assert leaked == 0


def test_garbage_on_the_kv_channel(cluster, known, reliability):
    """Random bytes, a truncated HTTP/2 preface and hostile KV messages at decode-1, while
    known-answer traffic runs through it."""
    victim = cluster.worker("decode-1")
    target = victim.status().kv_address                  # its engine core's KV port; the front's port gets garbage too
    load = known_load(cluster, known, 8)
    rng = random.Random(0)
    tried = 0
    for i in range(20):
        host, port = (target if i % 2 else victim.address).rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as s:
            if i % 4 == 0:
                s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + rng.randbytes(rng.randint(1, 4096)))
            elif i % 4 == 1:
                s.sendall(b"PRI * HTTP/2.0\r\n")            # truncated preface, then silence
            else:
                s.sendall(rng.randbytes(rng.randint(1, 65536)))
            tried += 1
    tried += _hostile_kv_messages(target, rng)
    out = load.wait()
    out.assert_clean()
    assert out.completed == out.sent, out.summary()
    assert cluster.worker("decode-1").alive
    leaked = settle(cluster)
    reliability.record("garbage on the KV channel", out, leaked_blocks=leaked, bad_inputs_tried=tried)
    assert leaked == 0


def _hostile_kv_messages(address: str, rng: random.Random) -> int:
    """Well-formed gRPC carrying nonsense: pushes for unknown transfers, chunks out of order,
    with bad checksums, wrong sizes, no open. Each must end with a status, not a crash."""
    from baton.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc

    def chunks(kind: int):
        tid = "nope" if kind % 2 else rng.randbytes(8).hex()
        if kind % 3 == 0:
            yield kvtransfer_pb2.KVChunk(transfer_id=tid, open=kvtransfer_pb2.PushOpen(
                total_bytes=rng.randint(0, 1 << 40), chunk_bytes=rng.randint(0, 1 << 30), window_bytes=1))
        for _ in range(rng.randint(0, 4)):
            data = rng.randbytes(rng.randint(0, 2048))
            yield kvtransfer_pb2.KVChunk(transfer_id=tid, index=rng.randint(0, 9), offset=rng.randint(0, 1 << 20),
                                         data=data, crc32=rng.randint(0, (1 << 32) - 1))
        yield kvtransfer_pb2.KVChunk(transfer_id=tid, done=kvtransfer_pb2.PushDone(first_token=rng.randint(0, 1 << 31)))

    n = 0
    with grpc.insecure_channel(address) as ch:
        stub = kvtransfer_pb2_grpc.KVTransferStub(ch)
        for kind in range(12):
            try:
                for _ in stub.Push(chunks(kind), timeout=5):
                    pass
            except grpc.RpcError as exc:
                assert exc.code() != grpc.StatusCode.UNKNOWN, exc
            n += 1
    return n


# -- clients and the router ---------------------------------------------------------------------
def test_a_client_that_stops_reading(cluster, known, reliability):
    """Three clients read one message and stop; everyone else is served, their KV is freed
    when generation ends (not when the client reads), and cancelling them ends cleanly."""
    stub = cluster.stub()
    stalled = []
    for i in range(3):
        it = stub.Generate(router_pb2.GenerateRequest(text=f"Stalled {i}: count to a hundred", sampling=greedy(64)),
                           timeout=120)
        next(it)
        stalled.append(it)
    out = known_load(cluster, known, 8).wait()
    out.assert_clean()
    assert out.completed == out.sent, out.summary()
    leaked = settle(cluster, 60)             # generation finished; the unread tokens are not KV
    ended = Outcomes()
    for it in stalled:
        it.cancel()
        try:
            for _ in it:
                pass
            result = []
        except grpc.RpcError as exc:
            result = exc
        ended.add(result, None, 0.0, 120)
    assert set(ended.statuses) <= {"CANCELLED"}
    out.merge(ended)
    reliability.record("client stops reading (backpressure)", out, leaked_blocks=leaked, stalled_clients=3)
    assert leaked == 0


def test_router_restart_while_workers_live(cluster, known, reliability):
    streams = Load(cluster.stub(), workers=4)
    for i in range(4):
        streams.submit(router_pb2.GenerateRequest(text=f"Long {i}: the history of", sampling=greedy(300)), None, 120)
    streams.wait_streaming(2)
    cluster.router.kill()                  # SIGKILL: the workers see their streams cancelled
    out = streams.wait()
    leaked = settle(cluster, 20)           # asked of each worker directly: no router up
    assert set(out.statuses) <= {"UNAVAILABLE", "CANCELLED"} and out.lost == 0, out.summary()
    cluster.restart("router")
    after = known_load(cluster, known, 6).wait()
    after.assert_clean()
    assert after.completed == after.sent, after.summary()
    out.merge(after)
    reliability.record("router restart (SIGKILL) with workers live", out, leaked_blocks=leaked)
    assert leaked == 0


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status
        except grpc.RpcError:
            return -1


def test_sigterm_drains_a_decode_worker(cluster, known, reliability):
    victim = cluster.worker("decode-1")
    streams = known_load(cluster, known, 4, deadline=120)
    long = Load(cluster.stub(), workers=4)
    for i in range(4):
        long.submit(router_pb2.GenerateRequest(text=f"Drain {i}: a long story", sampling=greedy(80)), None, 120)
    deadline = time.monotonic() + 20
    while victim.status().running == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert victim.status().running > 0
    t0 = time.monotonic()
    victim.popen.send_signal(signal.SIGTERM)
    # asked at once, not after a pause: on a fast machine the streams in flight finish (and the worker
    # exits) within half a second
    deadline = time.monotonic() + 5
    while (state := _health(victim.address)) == health_pb2.HealthCheckResponse.SERVING and time.monotonic() < deadline:
        time.sleep(0.02)
    assert state == health_pb2.HealthCheckResponse.NOT_SERVING
    with grpc.insecure_channel(victim.address) as ch:      # new work is refused while it drains
        with pytest.raises(grpc.RpcError) as err:
            decode_pb2_grpc.DecodeStub(ch).Admit(decode_pb2.AdmitRequest(request_id="late", prompt_token_ids=[1, 2]),
                                                 timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    out = long.wait()
    out.merge(streams.wait())
    out.assert_clean()
    assert out.completed == out.sent, out.summary()        # in-flight requests all finished
    assert victim.popen.wait(70) == 0
    drained_in = time.monotonic() - t0
    leaked = settle(cluster)
    reliability.record("SIGTERM drain of a decode worker", out, leaked_blocks=leaked,
                       drained_in_s=round(drained_in, 1), grace_s=60, refused_while_draining="UNAVAILABLE")
    assert leaked == 0


# -- overload -------------------------------------------------------------------------------------
def _extra_router(cluster, name: str, flags: list[str]) -> Proc:
    workers = [p for p in cluster.procs if p is not cluster.router]
    port = free_port()
    cmd = [sys.executable, "-m", "baton.router", "--port", str(port),
           "--prefill", ",".join(p.address for p in workers if p.name.startswith("prefill")),
           "--decode", ",".join(p.address for p in workers if p.name.startswith("decode")), *flags]
    p = Proc(name, cmd, f"127.0.0.1:{port}")
    p.start(cluster.env, cluster.log_dir)
    p.wait_ready()
    return p


async def _streams(address: str, n: int, known, deadline: float, tokens: int = N_TOKENS) -> tuple[Outcomes, list]:
    """n concurrent streams over a few channels, as many clients would open them, each the first
    `tokens` of its known answer."""
    channels = [grpc.aio.insecure_channel(address) for _ in range(8)]
    hints = []

    async def one(i: int):
        stub = router_pb2_grpc.RouterStub(channels[i % len(channels)])
        p = PROMPTS[i % len(PROMPTS)]
        t0 = time.monotonic()
        ids: list[int] = []
        try:
            call = stub.Generate(router_pb2.GenerateRequest(text=p, sampling=greedy(tokens)), timeout=deadline)
            async for resp in call:
                ids += resp.token_ids
            result = ids
        except grpc.aio.AioRpcError as exc:
            result = exc
            hints.append(retry_after_ms(exc.trailing_metadata()))
        return result, known[p][:tokens], time.monotonic() - t0

    try:
        results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), deadline + 30)
    finally:
        for ch in channels:
            await ch.close()
    out = Outcomes()
    for result, expected, seconds in results:
        out.add(result, expected, seconds, deadline)
    return out, hints


def test_500_concurrent_streams_with_bounded_memory(cluster, known, reliability):
    n = 5000 if SOAK else 500
    router = _extra_router(cluster, "router-load", ["--max-inflight", "64", "--max-queued", str(n * 2),
                                                    "--queue-timeout", "300"])
    try:
        procs = [p for p in cluster.procs if p.alive] + [router]
        rss_before = {p.name: p.peak_rss_mib() for p in procs}
        t0 = time.monotonic()
        out, _ = asyncio.run(_streams(router.address, n, known, deadline=300, tokens=2))
        seconds = time.monotonic() - t0
        rss_after = {p.name: p.peak_rss_mib() for p in procs}
        assert router.alive and all(p.alive for p in procs)
    finally:
        router.kill(signal.SIGTERM)
    out.assert_clean()
    assert out.completed == n, out.summary()               # queued, not dropped: the queue held them all
    leaked = settle(cluster, 30)
    growth = {k: round(rss_after[k] - rss_before[k]) for k in rss_after}
    reliability.record(f"load: {n} concurrent streams", out, leaked_blocks=leaked, seconds=round(seconds, 1),
                       router_max_inflight=64, peak_rss_mib={k: round(v) for k, v in rss_after.items()},
                       peak_rss_growth_mib=growth)
    assert leaked == 0
    assert growth[router.name] < 300 and max(growth.values()) < 600, growth   # bounded, not proportional


def test_beyond_capacity_is_resource_exhausted_with_a_retry_hint(cluster, known, reliability):
    router = _extra_router(cluster, "router-small", ["--max-inflight", "2", "--max-queued", "2",
                                                     "--queue-timeout", "20"])
    try:
        out, hints = asyncio.run(_streams(router.address, 24, known, deadline=60))
    finally:
        router.kill(signal.SIGTERM)
    out.assert_clean()
    assert out.statuses.get("RESOURCE_EXHAUSTED", 0) > 0 and out.completed >= 4, out.summary()
    assert set(out.statuses) == {"RESOURCE_EXHAUSTED"}
    assert all(h and h > 0 for h in hints), hints
    leaked = settle(cluster)
    reliability.record("overload: 24 at once into 2 running + 2 queued", out, leaked_blocks=leaked,
                       retry_after_ms_range=[min(hints), max(hints)])
    assert leaked == 0


# last: the router it drains is not started again (the overload scenarios run their own routers)
def test_sigterm_drains_the_router(cluster, known, reliability):
    long = Load(cluster.stub(), workers=4)
    for i in range(3):
        long.submit(router_pb2.GenerateRequest(text=f"Router drain {i}:", sampling=greedy(50)), None, 120)
    long.wait_streaming(2)
    t0 = time.monotonic()
    cluster.router.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    while True:                  # refused as soon as it drains (however long the signal takes to land)
        try:
            list(cluster.stub().Generate(router_pb2.GenerateRequest(text="late", sampling=greedy(2)), timeout=5))
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            break
        assert time.monotonic() < deadline, "the router took new work 5 s after SIGTERM"
        time.sleep(0.02)
    assert any(p[0] < 50 for p in long.progress), long.progress     # refused while streams were still running
    out = long.wait()
    out.assert_clean()
    assert out.completed == out.sent, out.summary()
    assert cluster.router.popen.wait(70) == 0
    drained_in = time.monotonic() - t0
    leaked = settle(cluster)
    reliability.record("SIGTERM drain of the router", out, leaked_blocks=leaked, drained_in_s=round(drained_in, 1),
                       refused_while_draining="UNAVAILABLE")
    assert leaked == 0
