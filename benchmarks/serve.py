"""B2 — online serving (`baton bench serve`): Poisson load against a baton.v1.Router, swept
over request rates, per topology. Per request: TTFT, every ITL, TPOT, E2E, tokens, status.
Per rate: throughput, latency percentiles, errors by status, SLO attainment, handover
latency (from the decode workers' metrics). Per topology: goodput (DistServe's: the
highest rate at which >= 90 % of requests meet both SLOs). Plots next to the JSON.

Point it at a running deployment (--addr) or let it launch local ones (--launch 1p1d, or
--topologies 1p3d,2p2d,3p1d,4colocated to compare any splits of a host's devices in one JSON).
With several TPOT SLOs (--slo-tpot-ms 10,15,25,50) goodput is computed for each from the same
requests, and the best topology per SLO pair is stated as a table (`recommendation`).

--goodput searches each topology's goodput instead of reading it off the grid (serve_goodput.py):
probes to within 5 %, steady state, every SLO pair judged from the same probes, several
workloads on one deployment (--dataset prefill-heavy,decode-heavy,mixed); --topologies auto
measures the planner's pick beside the colocated baseline.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import shlex
import sys
from collections import Counter
from pathlib import Path

from baton.benchmarks import (
    baseline,
    ceilings,
    datasets,
    deployment,
    loadgen,
    prometheus,
    record,
    serve_goodput,
)
from baton.benchmarks.flags import parse_lengths, parse_slos
from baton.benchmarks.flags import split as _split
from baton.benchmarks.model_shape import shape_of
from baton.benchmarks.stats import GOODPUT_ATTAINMENT, attainment, goodput_rate, meets_slo, summarize
from baton.engine.config import DEFAULT_MODEL
from baton.kvtransfer.registry import CROSS_PROCESS_BACKENDS

FULL = dict(request_rates="1,2,4,8,inf", num_prompts=200, worker_args="", prefix_len=datasets.DEFAULT_PREFIX_LEN)
SMOKE = dict(request_rates="4,inf", num_prompts=3, worker_args="--num-kv-blocks 128 --max-num-seqs 16",
             prefix_len=datasets.SMOKE_PREFIX_LEN, launch="1p1d")
DEFAULT_ADDR = "127.0.0.1:50051"


def add_arguments(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("deployment")
    t.add_argument("--addr", default=None, help=f"router of a running deployment (unset: {DEFAULT_ADDR}; but "
                   "--smoke with neither --addr nor --launch/--topologies launches its own 1p1d)")
    t.add_argument("--label", default="external", help="topology name of the --addr deployment in the JSON")
    t.add_argument("--api", default="grpc", help="grpc | openai | grpc,openai: the router API the load goes "
                   "through; both: the same load through each, one after the other (the HTTP layer's cost; the second "
                   "pass's prompts have the same lengths and other token ids, so it finds nothing of the first's "
                   "cached, except from a .jsonl dataset: add --worker-args=--no-prefix-caching there)")
    t.add_argument("--http-url", default=None, help="the --addr deployment's OpenAI API (default: "
                   "http://<--addr host>:8000/v1)")
    t.add_argument("--metrics-urls", default="",
                   help="comma list of the decode workers' metrics endpoints (host:port or URL), for handover")
    t.add_argument("--launch", default=None, help="launch this topology locally: XpYd or Ncolocated "
                   "(unset: none, but 1p1d with --smoke and no --addr)")
    t.add_argument("--topologies", default=None, help="comma list of topologies to launch one after another, "
                   f"each {deployment.GRAMMAR}, e.g. 4colocated,2colocated-tp2,1p3d,2p2d,3p1d,1p2d-ptp2; "
                   "with --goodput, auto: the planner's pick (--plan, or `baton plan` run here) and as many "
                   "colocated replicas as devices")
    t.add_argument("--model", default=DEFAULT_MODEL, help="model of launched deployments")
    t.add_argument("--devices", default=None, help="the device pool, e.g. cuda:0,cuda:1,cuda:2,cuda:3: prefill "
                   "workers take them in order, then decode workers (default: --prefill-devices then --decode-devices)")
    t.add_argument("--prefill-devices", default="cpu", help="comma list; 1p1d's prefill, the first colocated")
    t.add_argument("--decode-devices", default="cpu", help="comma list; 1p1d's decode, the second colocated")
    t.add_argument("--kv-backend", default=None, choices=CROSS_PROCESS_BACKENDS,
                   help="KV transport of launched disaggregated topologies (default: the workers' own, grpc)")
    t.add_argument("--worker-args", default=None, help="extra flags for every launched worker, e.g. "
                   "'--num-kv-blocks 4096 --max-num-seqs 128' (smoke: '--num-kv-blocks 128 --max-num-seqs 16')")
    t.add_argument("--router-args", default="", help="extra flags for a launched router, e.g. '--policy least_loaded'")
    t.add_argument("--routers", type=int, default=None, help="router processes of a launched deployment, sharing "
                   "its ports (--reuse-port; default: one per accelerator of --devices, one on the CPU): one "
                   "router process carries ~280 short requests a second, and must not be what a run measures")
    t.add_argument("--log-dir", default=None, help="worker logs (default: next to the JSON)")
    t.add_argument("--device", default=None,
                   help="device whose ceilings are recorded (default: the launched prefill device; for --addr: cpu)")
    t.add_argument("--offline-baseline", action="store_true",
                   help="after the served runs, the same requests through the offline engine (B1's) on --device: "
                        "each rate gets served / offline throughput and TPOT p50 / offline decode step p50 "
                        "(launched deployments only)")
    w = p.add_argument_group("load")
    w.add_argument("--dataset", default="random",
                   help="random | prefill-heavy | decode-heavy | mixed | shared-prefix | long-8k | long-32k | "
                        "long-128k | path/to/file.jsonl; with --goodput a comma list, each searched on the same "
                        "deployment")
    w.add_argument("--input-len", default=None, help="MIN:MAX prompt tokens (shared-prefix: the unique suffix; "
                   "mixed: the clip of its lognormal), or per dataset: NAME=MIN:MAX,NAME=MIN:MAX; "
                   "default per dataset")
    w.add_argument("--output-len", default=None, help="MIN:MAX output tokens, or NAME=MIN:MAX,...; default per dataset")
    w.add_argument("--prefix-len", type=int, default=None, help="shared-prefix: system prompt tokens (default 1024)")
    w.add_argument("--group-size", type=int, default=8, help="shared-prefix: requests per shared prompt")
    w.add_argument("--request-rates", default=None, help="comma list of req/s, 'inf' = all at once "
                   "(default 1,2,4,8,inf; smoke 4,inf)")
    w.add_argument("--num-prompts", type=int, default=None, help="requests per rate (default 200; smoke 3)")
    w.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    w.add_argument("--seed", type=int, default=0, help="rate i draws prompts with seed+i; arrivals with seed")
    w.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    w.add_argument("--respect-eos", action="store_true", help="stop at EOS (default: ignore_eos, exact lengths)")
    w.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    w.add_argument("--client-processes", type=int, default=None,
                   help="processes generating the load (default: 1, up to 4 where the cores allow it: one Python "
                        "process reads some 20-30k messages a second, and must not be what a run measures)")
    s = p.add_argument_group("SLOs")
    s.add_argument("--slo-ttft-ms", default="1000", help="time-to-first-token SLO; with --goodput a comma list: "
                   "every (TTFT, TPOT) pair is searched")
    s.add_argument("--slo-tpot-ms", default="100", help="time-per-output-token SLO; a comma list computes goodput "
                   "for each (the first is the one per-rate attainment reports)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    serve_goodput.add_arguments(p)


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    defaults = SMOKE if args.smoke else FULL
    for k, v in defaults.items():
        if getattr(args, k, None) is None and not (k == "launch" and (args.addr or args.topologies)):
            setattr(args, k, v)
    if args.launch and args.topologies:
        raise ValueError("give --launch or --topologies, not both")
    if args.addr and (args.launch or args.topologies):
        raise ValueError("--addr measures a running deployment; --launch/--topologies start their own")
    args.auto = False
    if args.topologies:
        names = [t.strip() for t in args.topologies.split(",") if t.strip()]
        for name in names:
            if name != "auto":
                deployment.roles(name)                       # raises on an unknown topology
        args.auto = "auto" in names
        args.topologies = [n for n in names if n != "auto"]
    elif args.launch:
        deployment.roles(args.launch)
        args.topologies = [args.launch]
    else:
        args.addr = args.addr or DEFAULT_ADDR
        args.topologies = []
    args.rates = parse_rates(args.request_rates)
    if args.offline_baseline and not args.topologies:
        raise ValueError("--offline-baseline runs the engine of a launched deployment: use --launch or --topologies")
    if args.client_processes is not None and args.client_processes < 1:
        raise ValueError(f"--client-processes must be >= 1, got {args.client_processes}")
    args.apis = _split(args.api)
    if not args.apis or set(args.apis) - {"grpc", "openai"} or len(set(args.apis)) != len(args.apis):
        raise ValueError(f"--api must be grpc, openai or grpc,openai; got {args.api!r}")
    args.slo_tpots_ms = parse_slos(args.slo_tpot_ms)
    args.slo_ttfts_ms = parse_slos(args.slo_ttft_ms, "--slo-ttft-ms")
    args.slo_ttft_ms = args.slo_ttfts_ms[0]             # the grid sweep's (one TTFT SLO)
    args.device_pool = _split(args.devices) if args.devices else _split(args.prefill_devices) + _split(args.decode_devices)
    args.num_devices = len(args.device_pool) if args.devices else None
    if args.routers is None:
        args.routers = default_routers(args.device_pool)
    if args.routers < 1:
        raise ValueError(f"--routers must be >= 1, got {args.routers}")
    args.datasets = _split(args.dataset) or ["random"]
    _check_load(args)
    args.lengths = {ds: _lengths(args, ds) for ds in args.datasets}
    args.input_len, args.output_len = (list(r) for r in args.lengths[args.datasets[0]])
    serve_goodput.resolve(args)
    if args.auto and args.plan:
        _check_plan(args)
    if args.device is None:
        args.device = args.device_pool[0] if args.topologies or args.auto else "cpu"
    return args


def _check_plan(args: argparse.Namespace) -> None:
    """--topologies auto --plan: its pick and predictions are measured against, so the plan must have
    been made for this run's model, device count and workloads' lengths."""
    plan = serve_goodput.plan_predictions(args.plan)
    made = []
    if plan.get("model") not in (None, args.model):
        made.append(f"for {plan['model']} (this run: --model {args.model})")
    if plan.get("devices") not in (None, len(args.device_pool)):
        made.append(f"for {plan['devices']} devices (this run: {len(args.device_pool)})")
    for ds in args.datasets:
        lengths = plan.get("workloads", {}).get(ds, {}).get("lengths")
        ours = [list(r) for r in args.lengths[ds]]
        if lengths and [lengths.get("input"), lengths.get("output")] != ours:
            made.append(f"for {ds}'s {_span(lengths.get('input'))} prompt and {_span(lengths.get('output'))} output "
                        f"tokens (this run: {_span(ours[0])} and {_span(ours[1])})")
    if made:
        raise ValueError(f"--plan {args.plan} was made {'; '.join(made)}: plan this run again (`baton plan` with "
                         "the same --model, --devices, --dataset, --input-len, --output-len), or leave --plan out "
                         "and --topologies auto plans it here")


def _span(r) -> str:
    return f"{r[0]}:{r[1]}" if r else "?"


def _check_load(args: argparse.Namespace) -> None:
    """The load's flags, refused here rather than once a launched deployment is up (minutes on a GPU)."""
    for ds in args.datasets:
        if ds.endswith(".jsonl"):
            if not Path(ds).is_file():
                raise ValueError(f"dataset file {ds} does not exist")
        elif ds not in datasets.LENGTHS:
            raise ValueError(f"unknown dataset {ds!r}: use {', '.join(datasets.LENGTHS)} or a .jsonl file")
    for flag, value, least, strict in (("--num-prompts", args.num_prompts, 1, False),
                                       ("--max-concurrency", args.max_concurrency, 1, False),
                                       ("--temperature", args.temperature, 0, False),
                                       ("--request-timeout", args.request_timeout, 0, True),
                                       ("--group-size", args.group_size, 1, False),
                                       ("--prefix-len", args.prefix_len, 0, False)):
        if value is not None and (math.isnan(value) or (value <= least if strict else value < least)):
            raise ValueError(f"{flag} must be {'>' if strict else '>='} {least:g}, got {value:g}")


def default_routers(devices: list[str]) -> int:
    """Routers for a launched deployment: one per accelerator (two H200s serving an 8B model take
    ~280 short requests a second, what one router process carries: one each leaves room for smaller
    models), one on the CPU, where the router is never the limit."""
    return max(1, sum(not d.startswith("cpu") for d in dict.fromkeys(devices)))


def _lengths(args: argparse.Namespace, dataset: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """(input range, output range) of one dataset: its defaults (smoke: the short ones), under the
    --input-len / --output-len given for every dataset or for it by name."""
    in_range, out_range = datasets.LENGTHS.get(dataset, datasets.LENGTHS["random"])
    if args.smoke:
        in_range, out_range = datasets.SMOKE_LENGTHS
    return (parse_lengths(args.input_len, dataset, "--input-len") or in_range,
            parse_lengths(args.output_len, dataset, "--output-len") or out_range)


def parse_rates(spec: str) -> list[float]:
    try:
        rates = [float(r) for r in spec.split(",") if r.strip()]
    except ValueError:
        raise ValueError(f"bad --request-rates {spec!r}: use numbers and 'inf', e.g. 1,2,4,inf") from None
    if not rates or any(r <= 0 or math.isnan(r) for r in rates):
        raise ValueError(f"bad --request-rates {spec!r}: every rate must be > 0 (or inf)")
    return rates


# -- one rate ------------------------------------------------------------------------------------
def summarize_rate(rate: float, results: list[loadgen.RequestResult], wall: float, slo_ttft_s: float | None,
                   slo_tpot_s: float | None) -> dict:
    ok = [r for r in results if r.ok]
    met = [meets_slo(r.ok, r.ttft, r.tpot, slo_ttft_s, slo_tpot_s) for r in results]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "request_rate": rate, "num_requests": len(results), "completed": len(ok), "duration_s": wall,
        "request_throughput": len(ok) / wall, "output_throughput": out_tokens / wall,
        "prompt_tokens": sum(r.prompt_tokens for r in ok), "output_tokens": out_tokens,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "ttft_s": summarize(r.ttft for r in ok if r.ttft is not None),
        "tpot_s": summarize(t for t in (r.tpot for r in ok) if t is not None),
        "itl_s": summarize(x for r in ok for x in r.itls),
        "e2e_s": summarize(r.e2e for r in ok),
        "errors": dict(Counter(r.status for r in results if not r.ok)),
        "slo_met": sum(met), "slo_attainment": attainment(met), "goodput_req_s": sum(met) / wall,
    }


async def sweep(args: argparse.Namespace, address: str, metrics_urls: list[str], http_url: str | None = None,
                router_metrics: list[str] = (), salt: int = 0) -> dict:
    """Every rate of args.rates against one deployment. `salt`: this deployment's pass number (one per --api
    entry): a later pass sends prompts of the same lengths with other token ids, so it does not find the earlier
    passes' prompts in the workers' prefix caches."""
    info, server = await loadgen.model_info(address)
    if http_url:
        await loadgen.openai_model(http_url)            # a RuntimeError naming the URL when it is not there
    sampling = {"temperature": args.temperature, "ignore_eos": not args.respect_eos}
    common = dict(max_model_len=info.max_model_len, vocab_size=info.vocab_size, prefix_len=args.prefix_len,
                  group_size=args.group_size, input_len=tuple(args.input_len), output_len=tuple(args.output_len))
    warm = datasets.build_requests(args.dataset, 1, args.seed + 10_007, **common)
    await loadgen.run_rate(address, warm, math.inf, args.seed, None, sampling, args.request_timeout, http_url)
    points = []
    for i, rate in enumerate(args.rates):
        reqs = datasets.build_requests(args.dataset, args.num_prompts, args.seed + i, salt=salt, **common)
        if not salt:                            # (the same for every topology: the offline baseline runs them)
            args.rate_requests[i] = reqs
        before, _ = await asyncio.to_thread(prometheus.scrape, metrics_urls)
        landed_before, _ = await asyncio.to_thread(prometheus.scrape, metrics_urls, prometheus.KV_LANDED)
        stages_before = await asyncio.to_thread(prometheus.stage_totals, router_metrics)
        processes = args.client_processes or loadgen.default_processes(len(reqs))
        results, wall = await loadgen.run_rate(address, reqs, rate, args.seed, args.max_concurrency, sampling,
                                               args.request_timeout, http_url, processes)
        after, errors = await asyncio.to_thread(prometheus.scrape, metrics_urls)
        landed_after, _ = await asyncio.to_thread(prometheus.scrape, metrics_urls, prometheus.KV_LANDED)
        stages_after = await asyncio.to_thread(prometheus.stage_totals, router_metrics)
        point = summarize_rate(rate, results, wall, _s(args.slo_ttft_ms), _s(args.slo_tpots_ms[0]))
        point["api"] = "openai" if http_url else "grpc"
        point["slo_attainment_by_tpot_ms"] = {
            f"{slo:g}": attainment([meets_slo(r.ok, r.ttft, r.tpot, _s(args.slo_ttft_ms), _s(slo)) for r in results])
            for slo in args.slo_tpots_ms}
        point["handover_s"] = prometheus.quantiles_between(before, after) if metrics_urls else None
        point["kv_landed_s"] = prometheus.quantiles_between(landed_before, landed_after) if metrics_urls else None
        point["stages_s"] = prometheus.stages_between(stages_before, stages_after) if router_metrics else None
        if errors:
            point["metrics_errors"] = errors
        point["dataset"] = datasets.describe(reqs)
        point["requests"] = [r.to_json() for r in results]
        points.append(point)
        _print_point(point)
    return {"model_info": {"name": info.name, "architecture": info.architecture, "max_model_len": info.max_model_len,
                           "vocab_size": info.vocab_size},
            "server_info": [{"address": w.address, "role": w.role, "kv_blocks_total": w.kv_blocks_total}
                            for w in server.workers],
            "rates": points,
            "goodput_rate": goodput_rate((p["request_rate"], p["slo_attainment"]) for p in points),
            "goodput_by_tpot_ms": {f"{slo:g}": goodput_rate((p["request_rate"], p["slo_attainment_by_tpot_ms"][f"{slo:g}"])
                                                            for p in points) for slo in args.slo_tpots_ms}}


def _key(topology: str, api: str, apis: list[str]) -> str:
    """A result's name: the topology, and the API when the run measures more than one."""
    return topology if apis == ["grpc"] else f"{topology}@{api}"


def _s(ms: float | None) -> float | None:
    return None if ms is None else ms / 1e3


def _print_point(p: dict) -> None:
    def ms(d: dict) -> str:
        return "-" if d["p99"] is None else f"{d['p50'] * 1e3:.0f}/{d['p99'] * 1e3:.0f}"
    att = p["slo_attainment"]
    print(f"[bench] rate {p['request_rate']:g}{' ' + p['api'] if p.get('api') else ''}: "
          f"{p['completed']}/{p['num_requests']} ok, "
          f"{p['request_throughput']:.2f} req/s, {p['output_throughput']:.1f} tok/s, TTFT p50/p99 {ms(p['ttft_s'])} ms, "
          f"TPOT {ms(p['tpot_s'])} ms, SLO {'-' if att is None else f'{100 * att:.0f}%'}"
          + (f", errors {p['errors']}" if p["errors"] else "") + _handover(p) + _stages(p), file=sys.stderr, flush=True)


def _handover(p: dict) -> str:
    h, k = p.get("handover_s") or {}, p.get("kv_landed_s") or {}
    if not h.get("count"):
        return ""
    text = f", handover p50/p99 {h['p50'] * 1e3:.1f}/{h['p99'] * 1e3:.1f} ms"
    return text + (f" (KV landed {k['p50'] * 1e3:.1f}/{k['p99'] * 1e3:.1f})" if k.get("count") else "")


def _stages(p: dict) -> str:
    """The router's mean time per stage of the requests that finished (queue/admit/prefill/handover/decode)."""
    st = p.get("stages_s") or {}
    if not st:
        return ""
    order = ("queue", "admit", "prefill", "handover", "decode")
    return ", stages " + " / ".join(f"{k} {st[k]['mean_s'] * 1e3:.0f}" for k in order if k in st) + " ms"


# -- the run ---------------------------------------------------------------------------------------
def run(args: argparse.Namespace, rec: dict) -> None:
    if args.goodput:
        return run_goodput(args, rec)
    out = Path(args.output)
    pool = args.device_pool
    used = [d for t in args.topologies for _, ranks in deployment.plan(t, pool) for d in ranks] or [args.device]
    peer = next((d for d in used if d != args.device), None)
    if args.topologies:
        rec["model"] = shape_of(args.model).to_json()           # an unknown model fails here, not later
    rec["ceilings"] = ceilings.measure(args.device, peer_device=peer, quick=args.smoke)
    rec["device"] = record.device_info(used)
    topologies: dict[str, dict] = {}
    args.rate_requests = {}
    if args.topologies:
        log_root = Path(args.log_dir) if args.log_dir else out.with_suffix("").with_name(out.stem + "-logs")
        for name in args.topologies:
            worker_args = shlex.split(args.worker_args)
            if args.kv_backend and "colocated" not in name:
                worker_args += ["--kv-backend", args.kv_backend]
            dep = deployment.launch(name, args.model, pool, worker_args, log_root / name,
                                    shlex.split(args.router_args), routers=args.routers)
            try:
                for salt, api in enumerate(args.apis):
                    key = _key(name, api, args.apis)
                    topologies[key] = asyncio.run(sweep(args, dep.router_address, dep.metrics_urls,
                                                        dep.http_url if api == "openai" else None,
                                                        dep.router_metrics, salt))
                    topologies[key]["deployment"] = dep.describe() | {"kv_backend": args.kv_backend or "grpc",
                                                                      "devices": dep.devices, "api": api}
            finally:
                dep.stop()
        if args.offline_baseline:
            _offline_baseline(args, topologies, log_root)
    else:
        urls = [prometheus.metrics_url(u) for u in _split(args.metrics_urls)]
        http_url = args.http_url or f"http://{args.addr.rsplit(':', 1)[0]}:8000/v1"
        for salt, api in enumerate(args.apis):
            key = _key(args.label, api, args.apis)
            topologies[key] = asyncio.run(sweep(args, args.addr, urls, http_url if api == "openai" else None,
                                                [prometheus.router_metrics_url(http_url)], salt))
            topologies[key]["deployment"] = {"router": args.addr, "metrics_urls": urls, "api": api,
                                             "http_url": http_url if api == "openai" else None}
        rec["model"] = _shape_or_name(next(iter(topologies.values()))["model_info"]["name"])
    rec["dtype"] = _worker_dtype(args) if args.topologies else None      # a running deployment's is not known
    rec["results"] = {"slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpots_ms[0],
                              "tpot_ms_all": args.slo_tpots_ms, "goodput_attainment": GOODPUT_ATTAINMENT},
                      "topologies": topologies, "recommendation": recommend(topologies, args.slo_tpots_ms),
                      "plots": []}
    record.write(rec, out)                  # the figures are safe before any plot is tried
    if not args.no_plots:
        try:
            from baton.benchmarks.plots import plot_sweep
            paths = plot_sweep({n: t["rates"] for n, t in topologies.items()}, _s(args.slo_ttft_ms),
                               _s(args.slo_tpots_ms[0]), out.with_suffix(""))
            rec["results"]["plots"] = [str(p) for p in paths]
        except ImportError:
            print(f"[bench] no plots: matplotlib is not installed (pip install 'baton[bench]'); the results are "
                  f"in {out}", file=sys.stderr, flush=True)
    for name, t in topologies.items():
        g = t["goodput_rate"]
        print(f"[bench] {name}: goodput {'none' if g is None else f'{g:g} req/s'}", file=sys.stderr, flush=True)
    for line in recommendation_lines(rec["results"]["recommendation"], args.slo_ttft_ms):
        print(line, file=sys.stderr, flush=True)


def recommendation_lines(rows: list[dict], ttft_ms: float) -> list[str]:
    """The sweep's closing lines: per TPOT SLO the best topology and each one's goodput ("none" where
    no rate met the SLOs, not 0)."""
    def g(v: float | None) -> str:
        return "none" if v is None else f"{v:g}"
    return [f"[bench] TTFT <= {ttft_ms:g} ms, TPOT <= {row['tpot_ms']:g} ms: best "
            + (f"{row['best']} ({g(row['goodput'])} req/s)" if row["best"] else "none") + "; "
            + ", ".join(f"{k} {g(v)}" for k, v in row["by_topology"].items()) for row in rows]


def run_goodput(args: argparse.Namespace, rec: dict) -> None:
    """--goodput: every topology's searched goodput per workload and SLO pair, the recommendation
    per workload, and the attainment-against-rate plots with the knees marked."""
    out = Path(args.output)
    pool = args.device_pool
    launched = bool(args.topologies or args.auto)
    if args.auto:
        args.topologies = _auto_topologies(args, out)
    used = [d for t in args.topologies for _, ranks in deployment.plan(t, pool) for d in ranks] or [args.device]
    if launched:
        rec["model"] = shape_of(args.model).to_json()
    rec["ceilings"] = ceilings.measure(args.device, peer_device=next((d for d in used if d != args.device), None),
                                       quick=args.smoke)
    rec["device"] = record.device_info(used)
    if launched:
        log_root = Path(args.log_dir) if args.log_dir else out.with_suffix("").with_name(out.stem + "-logs")
        by_workload = serve_goodput.run(args, args.topologies, pool, log_root)
        baseline = f"{len(pool)}colocated" if f"{len(pool)}colocated" in args.topologies else None
    else:
        urls = [prometheus.metrics_url(u) for u in _split(args.metrics_urls)]
        by_workload = serve_goodput.run_external(args, urls)
        baseline = None
    rec["dtype"] = _worker_dtype(args) if launched else None
    rec["results"] = {"slo": {"pairs": [s.to_json() for s in args.slos], "goodput_attainment": GOODPUT_ATTAINMENT},
                      "goodput": {"method": serve_goodput.method_json(args), "workloads": by_workload,
                                  "recommendation": serve_goodput.recommend(by_workload, args.slos, baseline),
                                  "plan": args.plan},
                      "plots": []}
    record.write(rec, out)
    if not args.no_plots:
        try:
            from baton.benchmarks.plots import plot_goodput
            rec["results"]["plots"] = [str(p) for p in plot_goodput(by_workload, args.slos, out.with_suffix(""))]
        except ImportError:
            print(f"[bench] no plots: matplotlib is not installed (pip install 'baton[bench]'); the results are "
                  f"in {out}", file=sys.stderr, flush=True)
    for line in serve_goodput.summary_lines(rec["results"]["goodput"]["recommendation"], by_workload):
        print(line, file=sys.stderr, flush=True)


def _auto_topologies(args: argparse.Namespace, out: Path) -> list[str]:
    """--topologies auto: the planner's pick for every workload and SLO pair (from --plan, or
    planned here and written next to the JSON), the colocated baseline, and any named beside it."""
    from baton.benchmarks import device_profile, planner
    if not args.plan:
        args.profile = args.profile or str(device_profile.default_path(args.model, args.device_pool[0]))
        args.plan = str(out.with_name(out.stem + "-plan.json"))
        planner.plan_for_bench(args, Path(args.plan))
    picks = planner.picks(serve_goodput.plan_predictions(args.plan), args.datasets, args.slos)
    names = [f"{len(args.device_pool)}colocated", *picks, *args.topologies]
    print(f"[bench] --topologies auto: {', '.join(dict.fromkeys(names))} (planner: {args.plan})",
          file=sys.stderr, flush=True)
    return list(dict.fromkeys(names))


def _offline_baseline(args: argparse.Namespace, topologies: dict[str, dict], log_root: Path) -> None:
    """Each rate's requests through the offline engine; every topology's point of that rate gets
    the comparison (baseline.py). A deployment of one tensor-parallel worker (1colocated-tp2) is
    compared with the offline engine across the same devices; any other with one device's engine."""
    flags = baseline.engine_flags(args.worker_args, args.max_concurrency)
    by_flags: dict[tuple[str, ...], list[str]] = {}
    for name in topologies:
        by_flags.setdefault(tuple(flags + _baseline_tp_flags(name, args.device_pool)), []).append(name)
    for run, (run_flags, names) in enumerate(by_flags.items()):
        for i, reqs in args.rate_requests.items():
            offline = baseline.run_offline(args.model, args.device, reqs, args.temperature, list(run_flags),
                                           log_root / f"offline-baseline-{i}{f'-{run}' if run else ''}.log")
            for name in names:
                point = topologies[name]["rates"][i]
                point["offline_baseline"] = baseline.compare(point, offline)
                b = point["offline_baseline"]
                print(f"[bench] {name} rate {point['request_rate']:g}: served {point['output_throughput']:.0f} tok/s / "
                      f"offline {b['output_tokens_per_s']:.0f} tok/s = {b['served_over_offline']:.3f}; TPOT p50 / "
                      f"offline decode step p50 = {_ratio(b['tpot_p50_over_decode_step_p50'])}, / offline TPOT p50 = "
                      f"{_ratio(b['tpot_p50_over_offline_tpot_p50'])}", file=sys.stderr, flush=True)


def _baseline_tp_flags(topology: str, devices: list[str]) -> list[str]:
    """The offline engine's tensor-parallel flags for a deployment of one worker across K devices; else none."""
    workers = deployment.plan(topology.partition("@")[0], devices)      # (name@api: one API's pass)
    return deployment.tp_flags(workers[0][1]) if len(workers) == 1 else []


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def recommend(topologies: dict[str, dict], slo_tpots_ms: list[float]) -> list[dict]:
    """Per TPOT SLO: every topology's goodput and the one that maximizes it (ties: fewer devices,
    then the first listed); `best` is None when none reaches the attainment target."""
    rows = []
    for slo in slo_tpots_ms:
        by = {name: t.get("goodput_by_tpot_ms", {}).get(f"{slo:g}") for name, t in topologies.items()}
        size = {name: len(t.get("deployment", {}).get("workers", [])) for name, t in topologies.items()}
        ranked = sorted((name for name in by if by[name] is not None), key=lambda n: (-by[n], size[n]))
        rows.append({"tpot_ms": slo, "by_topology": by, "best": ranked[0] if ranked else None,
                     "goodput": by[ranked[0]] if ranked else None})
    return rows


def _shape_or_name(name: str) -> dict:
    try:
        return shape_of(name).to_json()
    except ValueError:
        return {"name": name}


def _worker_dtype(args: argparse.Namespace) -> str:
    flags = shlex.split(args.worker_args or "")
    if "--dtype" in flags and flags.index("--dtype") + 1 < len(flags):
        return flags[flags.index("--dtype") + 1]
    return "float32" if args.device == "cpu" else "bfloat16"
