"""`baton bench serve --goodput`: per topology and workload, DistServe's goodput found by an
adaptive search (benchmarks/goodput.py) instead of read off a grid of rates. A topology is
launched once and serves every workload in turn; one probe per rate is judged against every
SLO pair; searches start from `--plan`'s predictions when given. A time budget is shared out
among the searches, so a device lease of fixed length ends with every topology measured to
the precision the time allowed (an unfinished search says so, with its bracket).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import sys
import time
from pathlib import Path

from baton.benchmarks import datasets, deployment, loadgen, prometheus
from baton.benchmarks.goodput import SLO, Probe, Search, probe_plan, slo_pairs
from baton.benchmarks.probes import Load, run_probe
from baton.benchmarks.stats import GOODPUT_ATTAINMENT

PREDICTED_STEP = 1.15              # bracketing factor from a prediction: a close one brackets the knee in two probes


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("goodput search (--goodput)")
    g.add_argument("--goodput", action="store_true",
                   help="search each topology's goodput (>= 90 %% of requests within both SLOs, sustained) to "
                        "--search-tolerance instead of sweeping --request-rates; --dataset may list several "
                        "workloads, each searched on the same deployment")
    g.add_argument("--plan", default=None, help="a `baton plan` JSON: searches start at its predicted goodput, and "
                   "--topologies auto takes its pick (default for auto: run the planner here)")
    g.add_argument("--profile", default=None, help="--topologies auto without --plan: the planner's device profile "
                   "cache (default: <cache dir>/profiles/<model>-<device kind>.json, as baton serve --planner's)")
    g.add_argument("--search-start", type=float, default=None, help="first rate probed, req/s, where no prediction "
                   "exists (default 1)")
    g.add_argument("--search-tolerance", type=float, default=0.05, help="the knee to within this fraction")
    g.add_argument("--search-step", type=float, default=None,
                   help=f"first bracketing factor, squared on each further step the same way (default 2; "
                        f"{PREDICTED_STEP} from a prediction)")
    g.add_argument("--search-min-rate", type=float, default=0.05, help="below this, goodput is reported as none")
    g.add_argument("--search-max-rate", type=float, default=10_000.0, help="no probe above this rate")
    g.add_argument("--probe-seconds", type=float, default=10.0, help="shortest measured window of a probe")
    g.add_argument("--probe-lifetimes", type=float, default=3.0, help="measured window >= this many times the "
                   "longest a request meeting the SLOs can take")
    g.add_argument("--probe-min-requests", type=int, default=50, help="fewest measured requests of a probe")
    g.add_argument("--probe-warmup-s", type=float, default=1.0, help="shortest warm-up of a probe (it lasts at least "
                   "the longest a request meeting the SLOs can take)")
    g.add_argument("--probe-gap-s", type=float, default=1.0,
                   help="idle seconds between probes (the requests cut at a probe's end finish aborting)")
    g.add_argument("--time-budget-s", type=float, default=None, help="wall seconds for the whole run, launches "
                   "included, shared out among the searches (unset: no limit)")


def resolve(args: argparse.Namespace) -> None:
    """Check the search's flags; `args.slos` = every (TTFT, TPOT) pair, loosest first."""
    args.slos = slo_pairs(args.slo_ttfts_ms, args.slo_tpots_ms)
    if not args.goodput:
        if len(args.datasets) > 1:
            raise ValueError("several --dataset workloads need --goodput (a grid sweep runs one)")
        if args.plan or args.auto:
            raise ValueError("--plan and --topologies auto belong to --goodput runs")
        return
    if not args.topologies and not args.auto and args.addr is None:
        raise ValueError("--goodput needs --addr, --launch or --topologies")
    if args.search_start is not None and args.search_start <= 0:
        raise ValueError(f"--search-start must be > 0 req/s, got {args.search_start}")
    if args.probe_gap_s < 0:
        raise ValueError(f"--probe-gap-s must be >= 0, got {args.probe_gap_s}")
    if len(args.apis) > 1:
        raise ValueError("--goodput measures one API a run: --api grpc or --api openai")
    if args.time_budget_s is not None and args.time_budget_s <= 0:
        raise ValueError(f"--time-budget-s must be > 0, got {args.time_budget_s}")
    if args.plan and not Path(args.plan).is_file():
        raise ValueError(f"--plan {args.plan}: no such file (write one with `baton plan ... --output FILE`)")
    probe_plan(args.slos, 1, args.probe_lifetimes, args.probe_seconds, args.probe_min_requests,
               args.probe_warmup_s)                                                             # validates
    Search(_never, args.search_tolerance, args.search_step or 2.0, args.search_min_rate, args.search_max_rate)


async def _never(rate: float) -> Probe:
    raise AssertionError("validation only")


class Budget:
    """The run's wall-clock budget, shared out: each search gets an even share of what is left
    after the launches still to come (estimated from the first one)."""

    def __init__(self, seconds: float | None, searches: int, launches: int):
        self.end = None if seconds is None else time.monotonic() + seconds
        self.searches, self.launches, self.launch_s = searches, launches, 0.0

    def launched(self, seconds: float) -> None:
        self.launches -= 1
        self.launch_s = max(self.launch_s, seconds)

    def deadline(self) -> float | None:
        """The time the next search must stop probing by."""
        if self.end is None:
            return None
        left = self.end - time.monotonic() - self.launches * self.launch_s
        share = max(0.0, left) / max(1, self.searches)
        self.searches -= 1
        return time.monotonic() + share

    def exhausted(self) -> bool:
        return self.end is not None and time.monotonic() >= self.end


def plan_predictions(path: str | None) -> dict:
    """`baton plan`'s JSON, or {} without one."""
    if not path:
        return {}
    try:
        plan = json.loads(Path(path).read_text())
    except ValueError as exc:
        raise ValueError(f"--plan {path}: not a `baton plan --output` JSON ({exc})") from None
    if not isinstance(plan, dict):
        raise ValueError(f"--plan {path}: not a `baton plan --output` JSON")
    return plan


def predicted(plan: dict, dataset: str, slo: SLO, topology: str) -> float | None:
    try:
        return plan["workloads"][dataset]["slos"][slo.key]["topologies"][topology]["goodput"]
    except (KeyError, TypeError):
        return None


# -- one deployment ------------------------------------------------------------------------------
async def search_workload(args: argparse.Namespace, address: str, dataset: str, metrics_urls: list[str],
                          num_devices: int, starts: dict[str, float], deadline: float | None,
                          http_url: str | None = None, router_metrics: list[str] = ()) -> dict:
    """Every SLO pair's goodput of one workload on one running deployment."""
    info, _ = await loadgen.model_info(address)
    if http_url:
        await loadgen.openai_model(http_url)            # a RuntimeError naming the URL when it is not there
    in_len, out_len = args.lengths[dataset]
    common = dict(max_model_len=info.max_model_len, vocab_size=info.vocab_size, prefix_len=args.prefix_len,
                  group_size=args.group_size, input_len=in_len, output_len=out_len)
    sampling = {"temperature": args.temperature, "ignore_eos": not args.respect_eos}
    warm = datasets.build_requests(dataset, 1, args.seed + 10_007, **common)
    await loadgen.run_rate(address, warm, math.inf, args.seed, None, sampling, args.request_timeout, http_url)
    plan = probe_plan(args.slos, min(out_len[1], info.max_model_len - 1), args.probe_lifetimes, args.probe_seconds,
                      args.probe_min_requests, args.probe_warmup_s, request_timeout_s=args.request_timeout)
    load = Load(address, dataset, common, sampling, args.seed, http_url, args.client_processes)
    probes: list[dict] = []

    async def probe(rate: float) -> Probe:
        if probes:
            await asyncio.sleep(args.probe_gap_s)
        before, _ = await asyncio.to_thread(prometheus.scrape, metrics_urls)
        stages_before = await asyncio.to_thread(prometheus.stage_totals, router_metrics)
        p = await run_probe(load, plan, rate, len(probes))
        after, _ = await asyncio.to_thread(prometheus.scrape, metrics_urls)
        stages_after = await asyncio.to_thread(prometheus.stage_totals, router_metrics)
        p.info["handover_s"] = prometheus.quantiles_between(before, after) if metrics_urls else None
        # the router's time by stage over the whole probe (warm-up and cool-down requests included)
        p.info["stages_s"] = prometheus.stages_between(stages_before, stages_after) if router_metrics else None
        probes.append(_probe_json(p, args.slos, args.search_tolerance))
        _print_probe(dataset, probes[-1])
        return p

    step = args.search_step or (PREDICTED_STEP if starts else 2.0)
    search = Search(probe, args.search_tolerance, step, args.search_min_rate, args.search_max_rate,
                    growth_limit=args.search_tolerance, duration_s=plan.duration_s, deadline=deadline)
    default = args.search_start or 1.0
    results = await search.find_all(args.slos, {s.key: starts.get(s.key, default) for s in args.slos})
    return {"dataset": dataset, "lengths": {"input": list(in_len), "output": list(out_len)},
            "probe_plan": plan.to_json(), "probes": sorted(probes, key=lambda p: p["rate"]),
            "searches": {r.slo.key: r.to_json(num_devices) for r in results},
            "goodput_by_slo": {r.slo.key: r.goodput for r in results}}


def _probe_json(p: Probe, slos: list[SLO], growth_limit: float) -> dict:
    return {"rate": p.rate, **p.info, "backlog_growth": p.backlog_growth,
            "attainment": {s.key: p.attainment(s) for s in slos},
            "passes": {s.key: p.passes(s, growth_limit=growth_limit) for s in slos}}


def _ms(d: dict) -> str:
    return "-" if d["p50"] is None else f"{d['p50'] * 1e3:.0f}/{d['p99'] * 1e3:.0f}"


def _print_probe(dataset: str, p: dict) -> None:
    s, z = p["summary"], p["sizes"]
    att = ", ".join(f"{k} {100 * v:.0f}%{'' if p['passes'][k] else ' x'}" for k, v in p["attainment"].items())
    print(f"[bench] {dataset} probe {p['rate']:g} req/s: {z['measured']} measured ({z['warmup']} warm-up, "
          f"{z['cooldown']} cool-down, window {z['window_s']:.1f}s), {s['completed']} ok, TTFT p50/p99 "
          f"{_ms(s['ttft_s'])} ms, TPOT {_ms(s['tpot_s'])} ms, growth {p['backlog_growth']:+.3f}; SLO {att}"
          + (f", errors {s['errors']}" if s["errors"] else ""), file=sys.stderr, flush=True)


# -- the run -------------------------------------------------------------------------------------
def run(args: argparse.Namespace, topologies: list[str], pool: list[str], log_root: Path) -> dict:
    """Launch each topology once, search every workload on it; the results by workload."""
    plan = plan_predictions(args.plan)
    budget = Budget(args.time_budget_s, len(topologies) * len(args.datasets), len(topologies))
    by_workload: dict[str, dict] = {ds: {} for ds in args.datasets}
    for name in topologies:
        if budget.exhausted():
            for ds in args.datasets:
                by_workload[ds][name] = {"skipped": "time budget spent before its launch"}
            continue
        t0 = time.monotonic()
        try:
            dep = deployment.launch(name, args.model, pool, _worker_args(args, name), log_root / name,
                                    shlex.split(args.router_args), routers=args.routers)
        except deployment.LaunchError as exc:       # one topology that cannot start must not end the matrix
            print(f"[bench] {name}: did not start: {str(exc).splitlines()[0]}", file=sys.stderr, flush=True)
            budget.launched(time.monotonic() - t0)
            for ds in args.datasets:
                budget.deadline()
                by_workload[ds][name] = {"error": str(exc)[-4000:]}
            continue
        budget.launched(time.monotonic() - t0)
        try:
            for ds in args.datasets:
                starts = {s.key: v for s in args.slos if (v := predicted(plan, ds, s, name))}
                res = asyncio.run(search_workload(args, dep.router_address, ds, dep.metrics_urls,
                                                  deployment.parse(name).num_devices, starts, budget.deadline(),
                                                  dep.http_url if args.apis == ["openai"] else None,
                                                  dep.router_metrics))
                res["deployment"] = dep.describe() | {"kv_backend": args.kv_backend or "grpc", "devices": dep.devices}
                res["predicted"] = {k: v for k, v in starts.items()}
                by_workload[ds][name] = res
                _print_goodput(name, res)
        finally:
            dep.stop()
    return by_workload


def run_external(args: argparse.Namespace, metrics_urls: list[str]) -> dict:
    """The same searches against a running deployment (--addr)."""
    plan = plan_predictions(args.plan)
    budget = Budget(args.time_budget_s, len(args.datasets), 0)
    out: dict[str, dict] = {}
    for ds in args.datasets:
        starts = {s.key: v for s in args.slos if (v := predicted(plan, ds, s, args.label))}
        api_url = args.http_url or f"http://{args.addr.rsplit(':', 1)[0]}:8000/v1"
        http_url = api_url if args.apis == ["openai"] else None
        res = asyncio.run(search_workload(args, args.addr, ds, metrics_urls, args.num_devices or 0, starts,
                                          budget.deadline(), http_url, [prometheus.router_metrics_url(api_url)]))
        res["deployment"] = {"router": args.addr, "metrics_urls": metrics_urls}
        out[ds] = {args.label: res}
        _print_goodput(args.label, res)
    return out


def _worker_args(args: argparse.Namespace, name: str) -> list[str]:
    flags = shlex.split(args.worker_args)
    if args.kv_backend and not deployment.parse(name).colocated:
        flags += ["--kv-backend", args.kv_backend]
    return flags


def _print_goodput(name: str, res: dict) -> None:
    for key, s in res["searches"].items():
        g, (lo, hi) = s["goodput_req_s"], s["bracket"]
        state = "" if s["converged"] else f" (not converged: {s['reason']}, bracket {lo} .. {hi})"
        print(f"[bench] {name} {res['dataset']} SLO {key} ms: goodput {'none' if g is None else f'{g:g} req/s'}"
              f"{state}", file=sys.stderr, flush=True)


def recommend(by_workload: dict[str, dict], slos: list[SLO], baseline: str | None) -> dict:
    """Per workload and SLO pair: each topology's goodput and per device, the best (ties: fewer
    devices, then the first listed) and its ratio to the colocated baseline."""
    out = {}
    for ds, topos in by_workload.items():
        rows = []
        for slo in slos:
            by = {n: t.get("goodput_by_slo", {}).get(slo.key) for n, t in topos.items()}
            size = {n: _devices(n) for n in topos}
            ranked = sorted((n for n in by if by[n] is not None), key=lambda n: (-by[n], size[n]))
            best = ranked[0] if ranked else None
            base = by.get(baseline) if baseline else None
            rows.append({"slo": slo.to_json(), "by_topology": by,
                         "per_device": {n: (g / size[n] if g is not None and size[n] else None) for n, g in by.items()},
                         "best": best, "goodput": by[best] if best else None, "baseline": baseline,
                         "best_over_baseline": by[best] / base if best and base else None})
        out[ds] = rows
    return out


def summary_lines(recommendation: dict, by_workload: dict[str, dict]) -> list[str]:
    """The run's closing lines, per workload and SLO pair: the best and every topology's goodput
    ("none" where none was found, why where its search stopped short) beside its prediction."""
    lines = []
    for ds, rows in recommendation.items():
        for row in rows:
            slo = row["slo"]
            key = f"{slo['ttft_ms']:g}/{slo['tpot_ms']:g}"
            ratio = f", {row['best_over_baseline']:.2f}x {row['baseline']}" \
                if row["best_over_baseline"] and row["best"] != row["baseline"] else ""
            best = f"{row['best']} ({row['goodput']:.3g} req/s{ratio})" if row["best"] else "none"
            lines.append(f"[bench] {ds}, TTFT <= {slo['ttft_ms']:g} ms, TPOT <= {slo['tpot_ms']:g} ms: best {best}; "
                         + ", ".join(f"{n} {_cell(g, by_workload.get(ds, {}).get(n, {}), key)}"
                                     for n, g in row["by_topology"].items()))
    return lines


def _cell(goodput: float | None, topo: dict, key: str) -> str:
    notes = []
    search = topo.get("searches", {}).get(key, {})
    if search and not search.get("converged", True):
        notes.append(f"not converged: {search.get('reason')}")
    predicted = topo.get("predicted", {}).get(key)
    if predicted:
        notes.append(f"predicted {predicted:.3g}")
    return ("none" if goodput is None else f"{goodput:.3g}") + (f" ({'; '.join(notes)})" if notes else "")


def _devices(name: str) -> int:
    try:
        return deployment.parse(name).num_devices
    except ValueError:
        return 0


def method_json(args: argparse.Namespace) -> dict:
    return {"definition": "highest Poisson request rate at which >= 90 % of measured requests meet both the TTFT "
                          "and the TPOT target, and the backlog does not grow (TTFT's slope against arrival time "
                          "<= the tolerance)",
            "attainment_target": GOODPUT_ATTAINMENT, "tolerance": args.search_tolerance,
            "step": args.search_step, "predicted_step": PREDICTED_STEP, "min_rate": args.search_min_rate,
            "max_rate": args.search_max_rate, "probe_seconds": args.probe_seconds,
            "probe_lifetimes": args.probe_lifetimes, "probe_min_requests": args.probe_min_requests,
            "probe_warmup_s": args.probe_warmup_s,
            "probe_gap_s": args.probe_gap_s, "time_budget_s": args.time_budget_s,
            "arrivals": "Poisson, each phase's count fixed (warm-up, measured, cool-down)",
            "slos": [s.to_json() for s in args.slos]}

