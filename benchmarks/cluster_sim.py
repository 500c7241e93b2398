"""A discrete-event simulation of one deployment under Poisson load, step by step: prefill,
decode and colocated workers batch as Baton's scheduler does (decode rows first, then prompt
chunks within the token budget, at most max_num_seqs sequences, KV reserved for prompt and
output at admission), each step priced by the fitted StepCost; the router picks the prefill
worker with the least queued work and the decode or colocated worker with the fewest requests;
a prompt's KV reaches its decode worker after the transfer time and joins at the next step.
Before any of that a request waits its turn at a router: `routers` servers of `router_s` each,
first come first served (the router's whole per-request cost, charged at arrival).

TTFT ends when the first token reaches the client (disaggregated: when the decode worker
joins the request; colocated: after the step that finished the prompt); TPOT is (E2E - TTFT)
/ (tokens - 1), as the load generator measures them. Per decode step the work is O(1) plus the
requests that finish, so a probe of a thousand requests simulates in tens of milliseconds.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from baton.benchmarks.deployment import Topology
from baton.benchmarks.step_cost import StepCost


@dataclass(frozen=True, slots=True)
class Hardware:
    """One device's profile, as the simulation and the queueing model read it."""
    cost: StepCost
    budget: int                        # max_num_batched_tokens
    max_num_seqs: int
    kv_capacity: int                   # tokens of KV one device holds
    weight_bytes: int
    kv_bytes_per_token: int
    tp_speedup: float = 1.5            # a TP2 worker's steps against one device's (planner.DEFAULT_TP_SPEEDUP's)
    kv_bandwidth: float = 100e9        # bytes/s of a prefill -> decode KV transfer
    kv_latency: float = 0.005          # seconds a transfer costs beyond its bytes
    # seconds of a prefill worker's own time per request it hands off, beside its steps (the Prefill
    # RPC, packing the KV, starting its send): what caps a prefill worker at short prompts
    handoff_s: float = 0.0
    # seconds of a router process's one core per request (its gRPC streams, mostly), and how many
    # routers share the load: what caps a deployment at hundreds of short requests a second
    router_s: float = 0.0
    routers: int = 1

    @property
    def router_rate(self) -> float:
        """Requests a second the routers can take at most (inf: not modelled)."""
        return self.routers / self.router_s if self.router_s > 0 else float("inf")

    def worker_cost(self, tp: int) -> StepCost:
        return self.cost.with_tp(tp, self.tp_speedup)

    def worker_kv(self, tp: int) -> int:
        """KV tokens of a worker of `tp` devices: each holds its share of the weights, the rest is KV."""
        if tp <= 1:
            return self.kv_capacity
        return int(tp * self.kv_capacity + (tp - 1) * self.weight_bytes / tp / self.kv_bytes_per_token)

    def transfer_s(self, prompt_tokens: int) -> float:
        return self.kv_latency + prompt_tokens * self.kv_bytes_per_token / self.kv_bandwidth


@dataclass(slots=True)
class Req:
    arrival: float
    prompt: int
    output: int
    first: float | None = None         # first token at the client
    finish: float | None = None
    decode: _Worker | None = None      # disaggregated: the decode worker the router picked


class _Worker:
    """Decode rows and prompt chunks of one worker (a prefill worker never has decode rows;
    a decode worker never has prompt chunks)."""

    def __init__(self, sim: Simulation, cost: StepCost, kv_capacity: int, hands_off: bool):
        self.sim, self.cost, self.kv_capacity, self.hands_off = sim, cost, kv_capacity, hands_off
        self.busy = False
        self.prompts: deque[list] = deque()          # [req, tokens computed]: admitted, prefilling
        self.waiting: deque[Req] = deque()           # not admitted yet (batch slots or KV)
        self.rows = 0                                 # decode rows
        self.kv_read = 0                              # their context tokens, summed
        self.kv_used = 0                              # KV reserved by admitted requests
        self.load = 0                                 # requests the router sent here, unfinished
        self.queued_tokens = 0                        # prompt tokens waiting (the prefill policy's measure)
        self.step_index = 0
        self.finishing: dict[int, list[Req]] = {}

    # -- arrivals --------------------------------------------------------------------------------
    def take_prompt(self, now: float, req: Req) -> None:
        self.waiting.append(req)
        self.queued_tokens += req.prompt
        self.kick(now)

    def land(self, now: float, req: Req) -> None:
        """Disaggregated: the request's KV has arrived; it joins at the next step."""
        self.waiting.append(req)
        self.kick(now)

    # -- steps -----------------------------------------------------------------------------------
    def kick(self, now: float) -> None:
        if not self.busy:
            self._start(now)

    def _admit(self, now: float) -> None:
        hw = self.sim.hw
        while self.waiting and self.rows + len(self.prompts) < hw.max_num_seqs:
            req = self.waiting[0]
            need = self._kv_need(req)
            if self.kv_used + need > self.kv_capacity and (self.rows or self.prompts):
                return
            self.waiting.popleft()
            self.kv_used += need
            if req.decode is self and req.first is None:     # landed KV: the first token leaves now
                self._first_token(req, now)
            else:
                self.prompts.append([req, 0])

    def _kv_need(self, req: Req) -> int:
        """A prefill worker holds the prompt's KV until it is sent; others the whole request's."""
        return req.prompt if self.hands_off else req.prompt + req.output

    def _start(self, now: float) -> None:
        self._admit(now)
        budget = self.sim.hw.budget - self.rows
        chunks, done = [], []
        for entry in self.prompts:
            if budget <= 0:
                break
            req, computed = entry
            n = min(req.prompt - computed, budget)
            chunks.append((computed, n))
            entry[1] += n
            budget -= n
            self.queued_tokens -= n
            if entry[1] == req.prompt:
                done.append(req)
        if not chunks and not self.rows:
            self.busy = False
            return
        self.busy = True
        seconds = self.cost.step(self.rows, self.kv_read, chunks, self.rows + len(done))
        self.sim.at(now + seconds, self._end, done)

    def _end(self, now: float, done: list[Req]) -> None:
        self.step_index += 1
        self.kv_read += self.rows
        for req in self.finishing.pop(self.step_index, ()):
            self._finish(req, now)
        for req in done:
            self.prompts.popleft()
            if self.hands_off:                       # prefill: the KV goes to the decode worker
                self.kv_used -= req.prompt
                self.load -= 1
                self.sim.at(now + self.sim.hw.transfer_s(req.prompt), req.decode.land, req)
            else:
                self._first_token(req, now)
        handoffs = len(done) * self.sim.hw.handoff_s if self.hands_off else 0.0
        if handoffs > 0:                             # the worker's host time before its next step
            self.sim.at(now + handoffs, self._start)
        else:
            self._start(now)

    def _first_token(self, req: Req, now: float) -> None:
        req.first = now
        if req.output <= 1:
            self._finish(req, now, joined=False)
            return
        self.rows += 1
        self.kv_read += req.prompt + 1
        # tokens 2..n come at the ends of the next n - 1 steps
        self.finishing.setdefault(self.step_index + req.output - 1, []).append(req)

    def _finish(self, req: Req, now: float, joined: bool = True) -> None:
        req.finish = now
        if joined:
            self.rows -= 1
            self.kv_read -= req.prompt + req.output
        self.kv_used -= req.prompt + req.output
        self.load -= 1


class Simulation:
    def __init__(self, topology: Topology, hw: Hardware):
        self.hw = hw
        self.events: list = []
        self._seq = itertools.count()
        self.prefill = [_Worker(self, hw.worker_cost(tp), hw.worker_kv(tp), True)
                        for role, tp in topology.workers if role == "prefill"]
        self.decode = [_Worker(self, hw.worker_cost(tp), hw.worker_kv(tp), False)
                       for role, tp in topology.workers if role != "prefill"]
        self.router_free = [0.0] * max(1, hw.routers)   # when each router is next free (a heap)

    def at(self, t: float, fn: Callable, *args) -> None:
        heapq.heappush(self.events, (t, next(self._seq), fn, args))

    def _route(self, now: float, req: Req) -> None:
        """The request reaches the workers once a router has spent `router_s` on it."""
        if self.hw.router_s <= 0:
            self._arrive(now, req)
            return
        done = max(now, heapq.heappop(self.router_free)) + self.hw.router_s
        heapq.heappush(self.router_free, done)
        self.at(done, self._arrive, req)

    def _arrive(self, now: float, req: Req) -> None:
        d = min(self.decode, key=lambda w: w.load)
        d.load += 1
        if not self.prefill:
            d.take_prompt(now, req)
            return
        req.decode = d
        p = min(self.prefill, key=lambda w: w.queued_tokens)
        p.load += 1
        p.take_prompt(now, req)

    def run(self, requests: list[Req], until: float) -> list[Req]:
        """Every request arrives at its time; the simulation stops at `until` (requests still
        running then have no finish)."""
        for r in requests:
            self.at(r.arrival, self._route, r)
        while self.events:
            t, _, fn, args = heapq.heappop(self.events)
            if t > until:
                break
            fn(t, *args)
        return requests


def simulate_probe(topology: Topology, hw: Hardware, lengths: list[tuple[int, int]], arrivals: list[float],
                   measured: range, deadline_s: float) -> list[tuple[bool, float | None, float | None, float]]:
    """One probe: requests with these (prompt, output) lengths arriving at these times; for each
    measured one (ok, TTFT, TPOT, arrival), a request not done within `deadline_s` failed (the
    load generator cuts it there)."""
    reqs = [Req(t, p, o) for t, (p, o) in zip(arrivals, lengths, strict=True)]
    Simulation(topology, hw).run(reqs, until=arrivals[measured[-1]] + deadline_s)
    out = []
    for i in measured:
        r = reqs[i]
        done = r.finish is not None and r.finish - r.arrival <= deadline_s
        ttft = None if r.first is None else r.first - r.arrival
        tpot = (r.finish - r.first) / (r.output - 1) if done and r.output > 1 else None
        out.append((done, ttft, tpot, r.arrival))
    return out
