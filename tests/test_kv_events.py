"""KV events and the router's prefix index (issue 51): the block manager records what its prefix
cache stores and evicts, the worker numbers those events for routers, the router's index follows
them (and forgets a worker that restarted or was lost, and remembers where it just sent a prompt),
and `--policy kv_aware` sends each turn of a conversation where its prefix is. Through 1P2D the
decode workers reuse 90 % of the blocks sending every conversation to one decode worker (the
oracle) would, with the conversations spread over both. (Two colocated workers: the same bar,
through `bench multiturn --compare-policies --smoke` in tests/test_benchmarks.py.)"""
from __future__ import annotations

import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

from baton.benchmarks import prometheus
from baton.engine.requests.prefix_hash import prompt_block_hashes
from baton.engine.requests.sampling_params import SamplingParams
from baton.engine.scheduling.block_manager import BlockManager
from baton.engine.scheduling.sequence import Sequence
from baton.router.policies import make_policy
from baton.router.prefix_index import PrefixIndex
from baton.serving.worker.kv_events import KVEventLog
from baton.v1 import router_pb2
from tests.cluster import Cluster

BS = 4


def sequence(tokens: list[int], rid: str = "r") -> Sequence:
    seq = Sequence(rid, tokens, SamplingParams(max_tokens=4), 4096)
    return seq


def run_prompt(bm: BlockManager, tokens: list[int], rid: str) -> Sequence:
    seq = sequence(tokens, rid)
    bm.match_prefix(seq)
    bm.allocate(seq, len(tokens) - seq.num_computed_tokens)
    seq.num_computed_tokens = len(tokens)
    bm.register_full_blocks(seq)
    return seq


def test_the_block_manager_records_what_its_prefix_cache_gains_and_loses():
    bm = BlockManager(4, BS)
    first = run_prompt(bm, list(range(9)), "a")          # 2 full blocks registered before any asking
    events, snapshot = bm.take_kv_events()
    assert snapshot and {h for _, h in events} == set(prompt_block_hashes(list(range(9)), BS))
    bm.free_sequence(first)
    assert bm.take_kv_events() == ([], False)
    second = run_prompt(bm, [100 + i for i in range(13)], "b")      # 4 blocks: evicts the first prompt's
    events, snapshot = bm.take_kv_events()
    stored = [h for s, h in events if s]
    removed = [h for s, h in events if not s]
    assert not snapshot and set(removed) == set(prompt_block_hashes(list(range(9)), BS))
    assert stored == prompt_block_hashes([100 + i for i in range(13)], BS)
    bm.free_sequence(second)


def test_unasked_for_events_stop_at_a_bound_and_the_next_ask_gets_a_snapshot():
    """A router that asked once and left must not make the block manager record forever: past
    max_kv_events unasked-for events it stops, and the next ask gets the whole set again, which
    the worker's log hands its followers as a reset (an eviction meanwhile is not lost)."""
    bm = BlockManager(4, BS)
    log, index = KVEventLog(), PrefixIndex()
    bm.free_sequence(run_prompt(bm, list(range(9)), "a"))
    log.add(*bm.take_kv_events())                        # a router asks: recording on
    index.apply("w", log.since("", 0))
    assert index.blocks["w"] == set(prompt_block_hashes(list(range(9)), BS))
    bm.max_kv_events = 3
    for k in range(3):                                   # its router is gone: nobody asks
        bm.free_sequence(run_prompt(bm, [100 * (k + 1) + i for i in range(9)], f"x{k}"))
    assert bm.kv_events is None                          # stopped at the bound
    events, snapshot = bm.take_kv_events()               # a router asks again
    assert snapshot and {h for _, h in events} == set(bm.cached)
    log.add(events, snapshot)
    reply = log.since(*index.cursor["w"])                # the old follower: a reset, not a gap
    assert reply.reset
    index.apply("w", reply)
    assert index.blocks["w"] == set(bm.cached) and not set(prompt_block_hashes(list(range(9)), BS)) & set(bm.cached)


def test_a_prompts_block_hashes_are_the_same_in_every_process():
    """The router hashes prompts in its own process: the hash must not depend on the process (Python
    3.11 salts hash(None) by address, which the first block's parent once was)."""
    tokens = list(range(40))
    code = ("from baton.engine.requests.prefix_hash import prompt_block_hashes; "
            f"print(prompt_block_hashes({tokens}, {BS}))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert eval(other) == prompt_block_hashes(tokens, BS)


def test_the_index_follows_events_restarts_and_losses():
    log, index = KVEventLog(kept=8), PrefixIndex()
    log.add([(True, 1), (True, 2), (True, 3)], snapshot=True)
    index.apply("w", log.since("", 0))                   # a new router: the whole set
    assert index.hits("w", [1, 2, 3, 4]) == 3
    log.add([(False, 2), (True, 4)], snapshot=False)
    reply = log.since(*index.cursor["w"])
    assert not reply.reset and [(e.block_hash, e.removed) for e in reply.events] == [(2, True), (4, False)]
    index.apply("w", reply)
    assert index.hits("w", [1, 2, 3]) == 1 and index.blocks["w"] == {1, 3, 4}
    log.add([(True, 100 + i) for i in range(20)], snapshot=False)        # more than it keeps: a reset
    reply = log.since(*index.cursor["w"])
    assert reply.reset and len(reply.events) == 23
    restarted = KVEventLog()                                             # a restart: another epoch
    restarted.add([(True, 9)], snapshot=True)
    index.apply("w", restarted.since(*index.cursor["w"]))
    assert index.blocks["w"] == {9}
    index.drop("w")                                                      # lost: gone at once
    assert index.hits("w", [9]) == 0


class _Worker:
    """What kv_aware reads of a worker: its address, load, free KV, queued work and status."""

    def __init__(self, address: str, load: int = 0, seconds_per_token: float = 1e-4):
        self.address, self.running, self.inflight_tokens = address, load, 0
        self.status = SimpleNamespace(block_size=BS, seconds_per_token=seconds_per_token)

    def load(self) -> int:
        return self.running

    def kv_free_fraction(self) -> float:
        return 0.5

    def expected_wait(self) -> float:
        return 0.0


def _holds(index: PrefixIndex, address: str, tokens: list[int]) -> None:
    log = KVEventLog()
    log.add([(True, h) for h in prompt_block_hashes(tokens, BS)], snapshot=True)
    index.apply(address, log.since("", 0))


def test_kv_aware_spreads_new_conversations_that_share_only_a_system_prompt():
    """Every conversation starts with the same instructions (8 of its 20 tokens). Cached on one
    worker only, they must not draw each new conversation there: new work goes by load. A returning
    conversation goes where its history is, until that worker is clearly busier than the rest."""
    index, policy = PrefixIndex(), make_policy("kv_aware", "colocated", None)
    policy.index = index
    shared = list(range(1, 9))
    workers = [_Worker("a"), _Worker("b"), _Worker("c")]
    _holds(index, "a", shared)
    placed = []
    for k in range(6):                                   # six new conversations arriving together
        w = policy.pick(workers, shared + [100 + 12 * k + i for i in range(12)])
        w.running += 1
        placed.append(w.address)
    assert sorted(placed) == ["a", "a", "b", "b", "c", "c"]
    history = shared + list(range(200, 228))             # a returning conversation, its history on c
    _holds(index, "c", history)
    assert policy.pick(workers, history + [7, 7, 7, 7]).address == "c"
    workers[2].running = 2 + 4 + 1                       # c: more than the slack past the others' 2
    assert policy.pick(workers, history + [7, 7, 7, 7]).address in ("a", "b")


def test_a_returning_conversation_stays_with_its_history_whatever_the_workers_recent_steps():
    """A worker's seconds_per_token averages its recent steps: one that was decoding (a step a few rows)
    reads tenfold slower per token than one that just ran a prompt. The conversation still goes where its
    history is (24 tokens to prefill there, 72 elsewhere): what decides is tokens to prefill, not that
    swing. Queued prompt tokens count the same way: enough of them there, and the other worker wins."""
    index, policy = PrefixIndex(), make_policy("kv_aware", "colocated", None)
    policy.index = index
    decoding, prefilling = _Worker("a", seconds_per_token=3e-2), _Worker("b", seconds_per_token=2e-3)
    history = list(range(600, 648))                      # 3 blocks, then the answer and a new message
    _holds(index, "a", history)
    turn = history + list(range(700, 724))
    assert policy.pick([decoding, prefilling], turn).address == "a"
    policy.index = index = PrefixIndex()                 # (again, without the hint that pick left)
    _holds(index, "a", history)
    decoding.inflight_tokens = 49                        # 49 + 24 queued and lacking there, against 72
    assert policy.pick([decoding, prefilling], turn).address == "b"


def test_a_conversation_back_before_the_workers_events_goes_where_it_was_sent():
    """An agent's next call can come back within the 0.5 s between rounds of KV events: where the
    policy sent the last one counts as cached there, until an event says otherwise or it expires."""
    index, policy = PrefixIndex(), make_policy("kv_aware", "colocated", None)
    policy.index = index
    workers = [_Worker("a"), _Worker("b")]
    logs = {w.address: KVEventLog() for w in workers}
    for address, log in logs.items():                    # the router has followed both since they started
        log.add([], snapshot=True)
        index.apply(address, log.since("", 0))
    first = [300 + i for i in range(24)]
    went = policy.pick(workers, first)
    other = next(w for w in workers if w is not went)
    other.running = 1                                    # what load alone would not choose
    again = first + [7] * 8
    assert policy.pick(workers, again) is went           # no event has come: the routing remembers
    log = logs[went.address]
    log.add([(False, prompt_block_hashes(first, BS)[2])], snapshot=False)      # evicted before it was asked
    reply = log.since(*index.cursor[went.address])
    assert not reply.reset
    index.apply(went.address, reply)
    assert index.hits(went.address, prompt_block_hashes(again, BS)) == 2       # an event outranks the hint
    index.expect("b", prompt_block_hashes(first, BS), now=0.0)
    assert index.hits("b", prompt_block_hashes(again, BS), now=1.0) == 5
    assert index.hits("b", prompt_block_hashes(again, BS), now=1e9) == 0     # never confirmed: expired
    _holds(index, "b", first)                            # its events say it holds them: no hints kept
    index.expect("b", prompt_block_hashes(again, BS))
    assert set(index.expected["b"]) == set(prompt_block_hashes(again, BS)[5:])
    index.drop("b")                                      # the worker was lost
    assert index.hits("b", prompt_block_hashes(again, BS)) == 0


def test_kv_aware_sends_a_returning_conversations_decode_where_its_history_is():
    """In PD the decode workers keep their own prefix caches (--decode-prefix-reuse) and the prefill
    worker sends only what they lack: a returning conversation's decode goes where its history is,
    even to a somewhat busier worker; new conversations and a clearly busier worker go by load."""
    index = PrefixIndex()
    policy = make_policy("kv_aware", "decode", index)
    workers = [_Worker("d0"), _Worker("d1", load=3)]
    history = list(range(500, 540))
    _holds(index, "d1", history)
    assert policy.pick(workers, history + [9] * 6).address == "d1"     # 3 streams busier, within the slack
    assert policy.pick(workers, list(range(600, 646))).address == "d0"           # new: by load
    workers[1].running = 9                                                       # past the slack
    assert policy.pick(workers, history + [9] * 6).address == "d0"
    assert make_policy("kv_aware", "prefill", index).index is index              # one index, every role


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """1P2D behind a kv_aware router: the prefill worker's cache and each decode worker's
    (--decode-prefix-reuse) are followed by their events. (Two colocated workers behind kv_aware:
    `bench multiturn --compare-policies --smoke`, tests/test_benchmarks.py.)"""
    from baton.serving.processes import free_port
    ports = {name: free_port() for name in ("decode-0", "decode-1")}
    c = Cluster.launch(tmp_path_factory.mktemp("kv-aware"), prefill=1, decode=2,
                       router_args=["--policy", "kv_aware"],
                       extra={name: ["--metrics-port", str(port)] for name, port in ports.items()})
    c.metrics_urls = {name: f"http://127.0.0.1:{port}/metrics" for name, port in ports.items()}
    yield c
    c.stop()


def reused_tokens(c: Cluster) -> float:
    """Prompt tokens the decode workers found in their own caches (the prefill worker did not send)."""
    return sum(prometheus.counter_sum(url, "baton_pd_reused_tokens_total") for url in c.metrics_urls.values())


@pytest.mark.slow
def test_kv_aware_sends_each_turns_decode_where_its_history_is(cluster):
    """Four conversations of four turns, two at a time, through 1P2D: each turn is the last one's
    prompt and answer plus new tokens, so the decode worker that served the last turn holds every
    full block of it (the answer's too) and the prefill worker need send only the rest. The decode
    side reuses >= 90 % of what sending every conversation to one decode worker (the oracle) would,
    with the conversations spread over both."""
    c = cluster
    stub = c.stub()
    bs = c.worker("decode-0").status().block_size
    oracle = [0]
    lock = threading.Lock()
    before = prometheus.settled(lambda: reused_tokens(c))

    def conversation(k: int) -> None:
        prompt, held = [1000 + 37 * k + i for i in range(70)], 0
        for turn in range(4):
            resp = list(stub.Generate(router_pb2.GenerateRequest(
                tokens=router_pb2.TokenIds(ids=prompt), sampling=router_pb2.SamplingParams(
                    temperature=0, max_tokens=12, ignore_eos=True)), timeout=120))
            out = [t for r in resp for t in r.token_ids]
            with lock:
                oracle[0] += held
            held = (len(prompt) + len(out) - 1) // bs * bs           # what this turn leaves cached
            prompt = prompt + out + [2000 + 11 * k + turn * 3 + i for i in range(9)]
    for wave in (range(2), range(2, 4)):
        threads = [threading.Thread(target=conversation, args=(k,)) for k in wave]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    reused = prometheus.settled(lambda: reused_tokens(c)) - before
    assert oracle[0] > 0 and reused >= 0.9 * oracle[0], (reused, oracle)
    served = [c.worker(f"decode-{i}").status().requests_served for i in range(2)]
    assert all(served), f"every conversation went to one decode worker ({served}): kv_aware must weigh load too"
    assert c.wait_workers_idle() == 0


@pytest.mark.slow
def test_after_a_decode_worker_restarts_the_index_follows_what_it_holds_now(cluster):
    """The restarted worker's events come from a new epoch: the index drops what it knew of it (the
    unit test above checks that exactly) and learns its cache afresh, so prefixes are found again."""
    c = cluster
    victim = c.worker("decode-0")
    victim.kill()
    victim.start(c.env, c.log_dir)
    victim.wait_ready()
    c.wait_health(victim.address, healthy=True)
    prompt = [5000 + i for i in range(70)]
    before = prometheus.settled(lambda: reused_tokens(c))
    for _ in range(2):
        resp = list(c.stub().Generate(router_pb2.GenerateRequest(
            tokens=router_pb2.TokenIds(ids=prompt), sampling=router_pb2.SamplingParams(temperature=0, max_tokens=4)),
            timeout=60))
        assert sum(len(r.token_ids) for r in resp) == 4
    assert prometheus.settled(lambda: reused_tokens(c)) - before >= 64     # the second's decode went where the first's is
    assert c.wait_workers_idle() == 0
