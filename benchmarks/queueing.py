"""A closed-form model of a deployment's SLO attainment at a request rate, and the goodput it
implies: the planner's quick estimate (and the simulation's first probe), checked against the
simulation in the tests.

Prefill (disaggregated workers, or the prompt share of colocated ones) is an M/G/c queue of
prompts, each costing its share of full token-budget steps; the wait is Allen-Cunneen's
approximation (Erlang C, corrected for the service times' spread), exponential beyond it.
Decode is a continuous batch whose step time grows with its rows and their context; Little's
law closes the loop (rows = arrival rate x steps a request stays x step time), so the step time
is the fixed point  tau = intercept / (1 - work per unit time). A colocated worker's steps carry
the prompt tokens that arrive meanwhile, so its fixed point includes them, and its TPOT spreads
with how often a step carries a prompt chunk.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from baton.benchmarks.cluster_sim import Hardware
from baton.benchmarks.deployment import Topology
from baton.benchmarks.goodput import SLO
from baton.benchmarks.stats import GOODPUT_ATTAINMENT

ROUTER_LOAD = 0.98         # the share of the routers' capacity a rate can use before their queue blows up


@dataclass(frozen=True, slots=True)
class Workload:
    """What the model reads of a workload's (prompt, output) lengths."""
    lengths: tuple[tuple[int, int], ...]

    @property
    def mean_prompt(self) -> float:
        return sum(p for p, _ in self.lengths) / len(self.lengths)

    @property
    def mean_decode_steps(self) -> float:
        """Steps a request stays in a decode batch: one per token after the first."""
        return sum(o - 1 for _, o in self.lengths) / len(self.lengths)

    @property
    def decode_context(self) -> float:
        """Mean context a decode row reads, weighted by the steps it spends at each length."""
        steps = sum(o - 1 for _, o in self.lengths)
        return sum((o - 1) * (p + o / 2) for p, o in self.lengths) / steps if steps else 0.0

    @property
    def size_biased_prompt(self) -> float:
        """The mean length of the prompt a given prompt token belongs to (E[L^2] / E[L])."""
        return sum(p * p for p, _ in self.lengths) / sum(p for p, _ in self.lengths)

    @property
    def pairs_per_token(self) -> float:
        """Causal attention pairs per prompt token (a prompt of L has about L^2 / 2)."""
        return sum(p * p / 2 for p, _ in self.lengths) / sum(p for p, _ in self.lengths)


def erlang_c(servers: int, load: float) -> float:
    """Probability an arrival waits in an M/M/c queue with offered load `load` (< servers)."""
    term, total = 1.0, 1.0
    for k in range(1, servers):
        term *= load / k
        total += term
    last = term * load / servers / (1 - load / servers)
    return last / (total + last)


def attainment(topology: Topology, hw: Hardware, work: Workload, slo: SLO, rate: float) -> float:
    """Share of requests meeting both SLOs at `rate`, in steady state (0 where a queue grows)."""
    if topology.colocated:
        return _colocated(topology, hw, work, slo, rate)
    return _disaggregated(topology, hw, work, slo, rate)


def goodput(topology: Topology, hw: Hardware, work: Workload, slo: SLO, hi: float = 1e5) -> float | None:
    """The highest rate with attainment >= 90 %, by bisection on a log scale (the model's
    attainment falls with the rate). No higher than the routers can take: a request's wait for one
    stays short until they are all but saturated (M/D/c), so they cap the rate, nothing more."""
    hi = min(hi, ROUTER_LOAD * hw.router_rate)
    lo = 1e-3
    if attainment(topology, hw, work, slo, lo) < GOODPUT_ATTAINMENT:
        return None
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        if attainment(topology, hw, work, slo, mid) >= GOODPUT_ATTAINMENT:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1.001:
            break
    return lo


# -- the pieces ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Queue:
    """M/G/c waiting: P(wait) and the mean wait of those who wait; None where unstable."""
    p_wait: float
    mean_wait: float

    def p_within(self, t: float) -> float:
        if t < 0:
            return 0.0
        return 1.0 - self.p_wait * math.exp(-t / self.mean_wait) if self.mean_wait > 0 else 1.0


def _mgc(servers: int, rate: float, service: list[float]) -> _Queue | None:
    mean = sum(service) / len(service)
    var = sum((s - mean) ** 2 for s in service) / len(service)
    load = rate * mean
    if load >= servers:
        return None
    c = erlang_c(servers, load)
    cs2 = var / mean ** 2 if mean > 0 else 0.0
    wq = c / (servers / mean - rate) * (1 + cs2) / 2            # Allen-Cunneen
    return _Queue(c, wq / c if c > 0 else 0.0)


def _full_step(hw: Hardware, cost, work: Workload, rows: float, kv: float) -> float:
    """A step that spends the whole token budget: `rows` decode rows, prompt tokens for the rest."""
    a_p, _, tok, row, pair, kvc = cost.coef
    prompt = max(1.0, hw.budget - rows)
    sampled = rows + prompt / max(1.0, work.mean_prompt)
    return (a_p + tok * hw.budget + row * sampled + pair * prompt * work.pairs_per_token + kvc * kv) / cost.tp_speedup


def _alone(hw: Hardware, cost, prompt: int) -> float:
    """Prefill of one prompt on an idle worker, chunk by chunk."""
    t, done = 0.0, 0
    while done < prompt:
        n = min(hw.budget, prompt - done)
        t += cost.step(0, 0, [(done, n)], 1 if done + n == prompt else 0)
        done += n
    return t


def _tpot_ok(tau: float, spread: float, out: int, slo: float, corr_steps: float) -> float:
    """P(mean of a request's out - 1 step times <= slo): normal, the per-step spread shrunk by
    the number of independent stretches of `corr_steps` steps the request spans."""
    if out < 2:
        return 1.0
    sd = spread / math.sqrt(max(1.0, (out - 1) / max(1.0, corr_steps)))
    if sd <= 0:
        return 1.0 if tau <= slo else 0.0
    return 0.5 * math.erfc((tau - slo) / (sd * math.sqrt(2)))


def _tpot_ok_beside_prompts(base: float, extra: float, mean: float, out: int, slo: float) -> float:
    """P(TPOT <= slo) for a colocated request whose out - 1 decode steps take `base` each, plus
    `extra` for each prompt chunk among them, a Poisson number of mean `mean`. A short output that
    meets one long prompt step misses on it alone, which a normal spread would understate."""
    if out < 2:
        return 1.0
    if base > slo:
        return 0.0
    most = math.inf if extra <= 0 else math.floor((slo - base) * (out - 1) / extra)
    if most >= mean + 10 * math.sqrt(mean) + 10:
        return 1.0
    term = total = math.exp(-mean)
    for k in range(1, int(most) + 1):
        term *= mean / k
        total += term
    return min(1.0, total)


def _disaggregated(topology: Topology, hw: Hardware, work: Workload, slo: SLO, rate: float) -> float:
    p_cost, d_cost = hw.worker_cost(topology.tp("prefill")), hw.worker_cost(topology.tp("decode"))
    n_p, n_d = topology.count("prefill"), topology.count("decode")
    full = _full_step(hw, p_cost, work, 0, 0)
    service = [p * full / hw.budget + hw.handoff_s for p, _ in work.lengths]
    queue = _mgc(n_p, rate, service)
    decode = _decode_fixed_point(hw, d_cost, work, rate / n_d, hw.worker_kv(topology.tp("decode")))
    if queue is None or decode is None:
        return 0.0
    tau, spread, _ = decode
    rho = rate * sum(service) / len(service) / n_p
    ok = 0.0
    for p, o in work.lengths:
        # its steps also carry the prompts that arrive meanwhile: longer by 1 / (1 - rho), at most full
        own = min(_alone(hw, p_cost, p) / (1 - rho), math.ceil(p / hw.budget) * full)
        ttft = own + hw.transfer_s(p) + tau / 2                                  # joins at the next step
        ok += queue.p_within(slo.ttft_s - ttft) * _tpot_ok(tau, spread, o, slo.tpot_s, work.mean_decode_steps)
    return ok / len(work.lengths)


def _decode_fixed_point(hw: Hardware, cost, work: Workload, rate: float,
                        kv_capacity: int) -> tuple[float, float, float] | None:
    """(step time, its spread, rows) of a decode worker fed `rate` requests a second."""
    _, a_d, tok, row, _, kvc = cost.coef
    per_row = (tok + row + kvc * work.decode_context) / cost.tp_speedup
    busy = rate * work.mean_decode_steps * per_row
    if busy >= 1:
        return None
    tau = a_d / cost.tp_speedup / (1 - busy)
    rows = rate * work.mean_decode_steps * tau
    if rows > hw.max_num_seqs or rows * (work.decode_context + work.mean_decode_steps) > kv_capacity:
        return None
    return tau, per_row * math.sqrt(rows), rows


def _colocated(topology: Topology, hw: Hardware, work: Workload, slo: SLO, rate: float) -> float:
    tp = topology.tp("colocated")
    cost, n = hw.worker_cost(tp), topology.count("colocated")
    a_p, a_d, tok, row, pair, kvc = (c / cost.tp_speedup for c in cost.coef)
    lam = rate / n
    per_row = tok + row + kvc * work.decode_context
    per_prompt_token = tok + pair * work.pairs_per_token + row / max(1.0, work.mean_prompt)
    busy = lam * (work.mean_decode_steps * per_row + work.mean_prompt * per_prompt_token)
    if busy >= 1:
        return 0.0
    tau = a_d / (1 - busy)
    for _ in range(20):                   # the intercept: the share of steps that carry a prompt chunk
        rows = lam * work.mean_decode_steps * tau
        chunk = max(1.0, hw.budget - rows)
        share = min(1.0, lam * tau * sum(math.ceil(p / chunk) for p, _ in work.lengths) / len(work.lengths))
        tau = (a_d + share * (a_p - a_d)) / (1 - busy)
    rows = lam * work.mean_decode_steps * tau
    if rows > hw.max_num_seqs or rows * (work.decode_context + work.mean_decode_steps) > hw.worker_kv(tp):
        return 0.0
    full = _full_step(hw, cost, work, rows, rows * work.decode_context)
    chunk = max(1.0, hw.budget - rows)
    service = [p * full / chunk for p, _ in work.lengths]
    queue = _mgc(n, rate, service)
    if queue is None:
        return 0.0
    # a step carries a prompt chunk (of about a size-biased prompt's length) or none
    piece = min(chunk, work.size_biased_prompt)
    carry = min(1.0, lam * work.mean_prompt * tau / piece)          # share of steps with a prompt chunk
    extra = per_prompt_token * piece + a_p - a_d                    # what such a step adds
    # the router sends a new request to a worker with fewer requests: one lands beside a decoding
    # request only while every other worker is occupied too
    occupied = min(1.0, lam * (a_p + work.mean_prompt * per_prompt_token + work.mean_decode_steps * tau))
    beside = occupied ** (n - 1)

    def exposure(p: int, o: int) -> float:
        """Prompt chunks expected among a request's decode steps: those of prompts that arrive while
        its own last prefill step runs (they share its first decode step), and each later step's
        share."""
        last = a_p + min(p, chunk) * per_prompt_token
        return beside * (lam * last * work.mean_prompt / piece + carry * (o - 1))
    ok = 0.0
    for p, o in work.lengths:
        own = math.ceil(p / chunk) * (a_p + rows * per_row) + p * per_prompt_token   # its chunks' steps
        ok += queue.p_within(slo.ttft_s - own) * _tpot_ok_beside_prompts(
            tau - carry * extra, extra, exposure(p, o), o, slo.tpot_s)
    return ok / len(work.lengths)
