"""`baton elastic`: roles that follow the load. A control loop beside a running deployment that
reads the traffic mix off its router, asks the plan (`baton plan --output`) which split of its
workers serves that mix best, and switches workers' roles in place toward it (`baton role`:
Admin.SwitchRole, streams moving with their KV) -- one worker at a time, with hysteresis.

    baton plan --model qwen3-8b --devices 2 --dataset prefill-heavy,decode-heavy,mixed \\
        --slo-ttft-ms 1000 --slo-tpot-ms 15 --output plan.json
    baton elastic --plan plan.json --addr 127.0.0.1:50051 --metrics-url http://127.0.0.1:8000/metrics \\
        --admin-token "$BATON_ADMIN_TOKEN"

Every --window seconds: the mix is the mean prompt and output length of the requests the routers
finished in the window (their `baton_prompt_tokens_total`, `baton_generation_tokens_total`,
`baton_requests_total`, summed over every router of --metrics-url: with several routers sharing the
ports, `baton serve --routers N`, each one's own metrics port, as its ready lines print them). A
window in which one of them does not answer decides nothing (a line says which): part of the traffic
is not the mix; the next complete reading is compared with the last complete one. The workload of the plan nearest to it (in log length, prompt and output
alike) names the split the plan picked for it at --slo. The controller acts only when that split
differs from the deployment's for --windows windows in a row (one window of a passing burst does
nothing) and --cooldown seconds have passed since its last switch; then it switches ONE worker
from a role with more workers than the split wants to one with fewer (decode <-> colocated first:
those keep their streams), the least loaded of its role, and looks again at the next window.
Workers of a tensor-parallel split, and prefill workers started by `baton prefill`, are not moved.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from baton.benchmarks.deployment import ROLES, next_move, split_counts, switch_one
from baton.benchmarks.prometheus import merge_routers, metrics_urls, read_routers, said
from baton.client import client_tls
from baton.serving.grpc_server import open_sync_channel
from baton.serving.options import flag, parser
from baton.serving.security import add_tls_args
from baton.v1 import admin_pb2_grpc, router_pb2, router_pb2_grpc

COUNTERS = {"prompt": "baton_prompt_tokens_total", "output": "baton_generation_tokens_total",
            "requests": "baton_requests_total"}


@dataclass(frozen=True, slots=True)
class Mix:
    """One window's traffic: requests finished, and their mean prompt and output length."""
    requests: float
    prompt: float
    output: float


def counters(routers: list[list]) -> dict[str, float]:
    """The totals (summed over labels and routers) from every router's metric families
    (benchmarks/prometheus.py: read_routers)."""
    samples = merge_routers(routers)
    return {key: sum(v for (n, _), v in samples.items() if n == name) for key, name in COUNTERS.items()}


def read_counters(urls: list[str]) -> tuple[dict[str, float] | None, dict[str, str]]:
    """(the routers' totals, None unless every router answered; {URL: why} of each that did not)."""
    routers, down = read_routers(urls, timeout=10)
    return (None if down else counters(routers)), down


def window_mix(before: dict[str, float], after: dict[str, float]) -> Mix | None:
    """The mix between two readings of the counters; None when no request finished in between, or
    when a counter went down (a router restarted: its share began again from 0)."""
    n = after["requests"] - before["requests"]
    if n <= 0 or any(after[k] < before[k] for k in COUNTERS):
        return None
    return Mix(n, (after["prompt"] - before["prompt"]) / n, (after["output"] - before["output"]) / n)


def nearest_workload(plan: dict, mix: Mix) -> str:
    """The plan's workload whose typical lengths (the middle of its input and output ranges) are
    nearest the mix's means, in log length."""
    def distance(entry: dict) -> float:
        i, o = entry["lengths"]["input"], entry["lengths"]["output"]
        mid_in, mid_out = math.sqrt(max(1, i[0]) * max(1, i[1])), math.sqrt(max(1, o[0]) * max(1, o[1]))
        return math.hypot(math.log(max(mix.prompt, 1) / mid_in), math.log(max(mix.output, 1) / mid_out))
    return min(plan["workloads"], key=lambda ds: distance(plan["workloads"][ds]))


def planned_split(plan: dict, workload: str, slo: str) -> str | None:
    entry = plan["workloads"][workload]["slos"].get(slo)
    if entry is None:
        known = sorted(plan["workloads"][workload]["slos"])
        raise ValueError(f"the plan has no SLO pair {slo!r} for {workload}; it has {', '.join(known)}")
    return entry["best"]


@dataclass
class Controller:
    """The decisions, apart from the I/O: `decide` once per window."""
    plan: dict
    slo: str
    windows: int = 2                    # the same wish this many windows in a row before acting
    cooldown_s: float = 60.0
    wish: str | None = None
    streak: int = 0
    last_switch: float = -math.inf
    log: list[str] = field(default_factory=list)
    why: str = ""                       # why the last window wished nothing (it adds no note to `log`)

    def decide(self, mix: Mix | None, current: dict[str, int], now: float) -> tuple[str, str] | None:
        if mix is None:
            self.streak, self.why = 0, "no request finished in this window"
            return None
        workload = nearest_workload(self.plan, mix)
        split = planned_split(self.plan, workload, self.slo)
        want = split_counts(split) if split else None
        if want is None or sum(want.values()) != sum(current.values()) or want == current:
            self.wish, self.streak = None, 0
            self.why = (f"the plan's split for {workload}, {split}, " +
                        ("is what runs" if want == current else "is not one role switches make of these workers"))
            return None
        self.streak = self.streak + 1 if split == self.wish else 1
        self.wish = split
        note = (f"mix {mix.prompt:.0f} prompt / {mix.output:.0f} output tokens ({mix.requests:.0f} requests): "
                f"{workload} -> {split} ({self.streak}/{self.windows})")
        self.log.append(note)
        if self.streak < self.windows or now - self.last_switch < self.cooldown_s:
            return None
        return next_move(current, want)


def build_parser() -> argparse.ArgumentParser:
    p = parser("baton elastic", "switch workers' roles as the traffic mix moves, by a plan (baton plan --output)",
               usage="baton elastic --plan PLAN.json [flags]")
    flag(p, "--plan", required=True, help="`baton plan --output` of this deployment's model, device count and SLO")
    flag(p, "--slo", help="the plan's SLO pair to serve, TTFT_MS/TPOT_MS as the plan names it, e.g. 1000/15 (unset: its only one)")
    flag(p, "--addr", default="127.0.0.1:50051", help="the router's gRPC address")
    flag(p, "--metrics-url", default="http://127.0.0.1:8000/metrics",
         help="the router's /metrics (its --http-port); with several routers, each one's own, apart by commas "
              "(`baton serve --routers N` prints them): their counters are summed, and a window with one of them "
              "down decides nothing")
    flag(p, "--admin-token", help="the router's --admin-token")
    flag(p, "--window", type=float, default=30.0, help="seconds of traffic each decision reads")
    flag(p, "--windows", type=int, default=2, help="a new split must be wished this many windows in a row")
    flag(p, "--cooldown", type=float, default=60.0, help="seconds after a switch before the next")
    flag(p, "--switch-timeout", type=float, default=60.0, help="seconds a switch's streams get to move")
    flag(p, "--once", type=bool, default=False, help="one window, one decision (printed), then exit")
    add_tls_args(p, server=False)
    return p


def load_plan(path: str) -> dict:
    """`baton plan --output`'s JSON; ValueError naming --plan for a file that is none."""
    try:
        plan = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"--plan {path}: {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"--plan {path}: not a plan written by `baton plan --output` (not JSON: {exc})") from None
    try:
        for workload in plan["workloads"].values():
            workload["slos"].items()
    except (KeyError, TypeError, AttributeError) as exc:
        what = f"it has no {exc.args[0]!r}" if isinstance(exc, KeyError) else "its workloads are not as it writes them"
        raise ValueError(f"--plan {path}: not a plan written by `baton plan --output` ({what})") from None
    return plan


def _slo_key(plan: dict, asked: str | None) -> str:
    keys = sorted({k for w in plan["workloads"].values() for k in w["slos"]})
    if asked:
        return asked
    if len(keys) != 1:
        raise ValueError(f"the plan has {len(keys)} SLO pairs ({', '.join(keys)}): choose one with --slo")
    return keys[0]


def _roles(router) -> tuple[dict[str, int], list[router_pb2.WorkerInfo]]:
    workers = [w for w in router.GetServerInfo(router_pb2.GetServerInfoRequest(), timeout=10).workers if w.healthy]
    return {r: sum(w.role == r for w in workers) for r in ROLES}, workers


def main(argv: list[str] | None = None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        plan = load_plan(args.plan)
        ctl = Controller(plan, _slo_key(plan, args.slo), args.windows, args.cooldown)
        tls = client_tls(args)
        urls = metrics_urls(args.metrics_url)
    except (OSError, ValueError, KeyError) as exc:
        p.error(str(exc))
    metadata = [("authorization", f"Bearer {args.admin_token}")] if args.admin_token else None
    with open_sync_channel(args.addr, tls) as ch:
        router, admin = router_pb2_grpc.RouterStub(ch), admin_pb2_grpc.AdminStub(ch)
        before = _read(urls, "at the start")
        while True:
            time.sleep(args.window)
            after = _read(urls, "this window")
            if args.once and (before is None or after is None):
                sys.exit(1)                # (said above which router did not answer)
            if after is not None and before is not None:
                mix = window_mix(before, after)
                try:                        # (no traffic: nothing to ask the router)
                    current, workers = _roles(router) if mix is not None else ({}, [])
                except grpc.RpcError as exc:
                    print(f"[elastic] holding this window: the router at {args.addr} did not answer "
                          f"({exc.code().name}: {exc.details()})", file=sys.stderr, flush=True)
                    if args.once:
                        sys.exit(1)
                    continue                # (the next window spans this one)
                notes = len(ctl.log)
                move = ctl.decide(mix, current, time.monotonic())
                if ctl.log:
                    print(f"[elastic] {ctl.log[-1]}; now {current}", file=sys.stderr, flush=True)
                if args.once and len(ctl.log) == notes:     # --once promises its decision, printed
                    print(f"[elastic] no decision: {ctl.why}", file=sys.stderr, flush=True)
                if move is not None:
                    _switch(admin, workers, move, args.switch_timeout, metadata, ctl)
            before = after if after is not None else before    # (a gap: the next window spans it)
            if args.once:
                return


def _read(urls: list[str], when: str) -> dict[str, float] | None:
    """The routers' totals; None, said in one line naming those down, unless every router answered."""
    totals, down = read_counters(urls)
    if down:
        print(f"[elastic] holding {when}: no switch on part of the traffic; {len(down)} of {len(urls)} router(s) "
              f"did not answer: {said(down)} (is it up? is --metrics-url its metrics port?)",
              file=sys.stderr, flush=True)
    return totals


def _switch(admin, workers, move: tuple[str, str], timeout: float, metadata, ctl: Controller) -> None:
    src, dst = move
    try:
        r = switch_one(admin, workers, move, timeout, metadata)
    except grpc.RpcError as exc:
        print(f"[elastic] switching a {src} worker to {dst} failed: {exc.code().name}: {exc.details()}",
              file=sys.stderr, flush=True)
        ctl.last_switch = time.monotonic()          # (a refusal waits the cooldown out too: no flapping)
        return
    ctl.last_switch = time.monotonic()             # (the wish stands: the next step after the cooldown)
    print(f"[elastic] {r.worker}: {r.from_role} -> {r.to_role} in {r.seconds:.2f}s ({r.streams_moved} stream(s) "
          f"moved with their KV)", file=sys.stderr, flush=True)
