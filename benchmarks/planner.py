"""`baton plan`: which split of N devices serves a workload best at a TTFT and a TPOT target.

    baton plan --model qwen3-8b --devices 4 --dataset prefill-heavy --slo-ttft-ms 1000 --slo-tpot-ms 25 \\
        --device cuda:0 --profile qwen3-8b-h100.json

Profiles one device briefly through Baton's engine (benchmarks/device_profile.py; cached in
--profile), fits a step-cost line, then predicts every topology's goodput for the workload and
targets: a discrete-event simulation of the deployment (benchmarks/cluster_sim.py) searched as
`bench serve --goodput` searches a real one, same probe sizes, starting from the closed-form
queueing model's estimate (benchmarks/queueing.py, printed beside it). Prints the table and the
recommended split; --output writes the JSON that `bench serve --goodput --plan` and `baton serve
--planner` read. On the CPU it runs too, slowly and on small shapes, and says so.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import shlex
import sys
import time
from pathlib import Path

from baton import environment
from baton.benchmarks import datasets, deployment, device_profile, loadgen, queueing
from baton.benchmarks.cluster_sim import Hardware, simulate_probe
from baton.benchmarks.flags import parse_lengths, parse_slos
from baton.benchmarks.flags import split as _split
from baton.benchmarks.goodput import SLO, Outcome, Probe, Search, probe_plan, slo_pairs
from baton.benchmarks.step_cost import StepCost
from baton.serving.options import flag

SCHEMA = "baton.plan/v1"
# TP2 against one device (one device cannot measure it): qwen3-8b on two H200s with the fused all-reduce, B1 1.52x,
# decode steps 1.42x at batch 64 to 1.62x at 256 (docs/benchmarks.md, twenty-fourth session)
DEFAULT_TP_SPEEDUP = 1.5
# a prefill -> decode KV transfer: device-direct on accelerators (B3: hundreds of GB/s, a few ms of
# control per transfer under load), gRPC bytes on the CPU
KV_LINKS = {"accel": (100e9, 0.005), "cpu": (0.5e9, 0.005)}
# a prefill worker's time per request beyond its steps: one H200 prefill worker of qwen3-8b fed
# 80-token prompts held 208 req/s (two GPUs) and fell behind at 220 (four): ~4.5 ms a request
HANDOFF_MS = 4.5
# a router process's one core per request: on an H200 host one router carried ~280 decode-heavy
# requests a second (64-192 output tokens, its streams paced by its CPU) and no more
ROUTER_MS = 3.5
ROUTER_BOUND = 0.9                 # a goodput this close to what the routers take is theirs, not the devices'
LENGTH_SAMPLES = 400               # requests drawn to describe the workload to the queueing model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model preset, HF directory or .gguf (default: the embedded model)")
    p.add_argument("--devices", type=int, default=None,
                   help="devices to split (default: the accelerators this machine has, else 2)")
    p.add_argument("--device", default=None, help="the device profiled: cpu, cuda:N, npu:N (default cuda:0 where "
                   "there is one, else cpu)")
    p.add_argument("--dataset", default="random",
                   help="random | prefill-heavy | decode-heavy | mixed | shared-prefix | a .jsonl of token ids; "
                        "a comma list plans each")
    p.add_argument("--input-len", default=None, help="MIN:MAX prompt tokens, or NAME=MIN:MAX,... (as bench serve)")
    p.add_argument("--output-len", default=None, help="MIN:MAX output tokens, or NAME=MIN:MAX,...")
    p.add_argument("--slo-ttft-ms", default="1000", help="TTFT target; a comma list plans every (TTFT, TPOT) pair")
    p.add_argument("--slo-tpot-ms", default="50", help="TPOT target; a comma list plans every pair")
    p.add_argument("--topologies", default=None, help="comma list to compare (default: every split of --devices "
                   "with workers of --tp-sizes)")
    p.add_argument("--tp-sizes", default="1,2", help="tensor-parallel sizes a worker may have")
    p.add_argument("--tp-speedup", type=float, default=DEFAULT_TP_SPEEDUP,
                   help="a TP2 worker's speed over one device's (one device cannot measure it; the default is "
                        "qwen3-8b's on two H200s: 1.52x in B1)")
    p.add_argument("--kv-bandwidth-gbs", type=float, default=None,
                   help="prefill -> decode KV bandwidth, GB/s (default 100 on accelerators, 0.5 on the CPU)")
    p.add_argument("--kv-latency-ms", type=float, default=5.0, help="a KV transfer's cost beyond its bytes")
    p.add_argument("--handoff-ms", type=float, default=HANDOFF_MS,
                   help="a prefill worker's own time per request it hands to decode, beside its steps (the "
                        "Prefill call, packing and sending its KV; measured on H200s, not profiled here)")
    p.add_argument("--routers", type=int, default=1, help="router processes in front of the workers (baton router "
                   "--reuse-port, or replicas behind one Service)")
    p.add_argument("--router-ms", type=float, default=ROUTER_MS,
                   help="a router's CPU time per request, ms (measured on an H200 host with ~128-token outputs, not "
                        "profiled here; 0: routers are never the limit)")
    p.add_argument("--profile", default=None, help="profile cache (JSON): read when it matches the model, device "
                   "kind and engine settings, else measured and written there")
    p.add_argument("--reprofile", action="store_true", help="measure again even if --profile matches")
    p.add_argument("--max-num-seqs", type=int, default=None, help="the workers' batch limit (default: the engine's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the workers' token budget per step (default: the engine's)")
    p.add_argument("--worker-args", default="", help="the workers' flags, as bench serve takes them: "
                   "--max-num-seqs and --max-num-batched-tokens are read from them, and --num-kv-blocks "
                   "bounds the simulated workers' KV")
    p.add_argument("--probe-seconds", type=float, default=10.0, help="as bench serve --goodput: simulated probes "
                   "are sized as the measured ones")
    p.add_argument("--probe-lifetimes", type=float, default=3.0, help="as bench serve --goodput")
    p.add_argument("--probe-min-requests", type=int, default=50, help="as bench serve --goodput")
    p.add_argument("--search-tolerance", type=float, default=0.05, help="as bench serve --goodput")
    p.add_argument("--jobs", type=int, default=None, help="processes simulating in parallel (default: cores, <= 8)")
    p.add_argument("--seed", type=int, default=0)
    flag(p, "--tokenizer", help="tokenizer directory for the profiled engine (unset: the model's; presets: the "
                                "embedded model's)")
    p.add_argument("--output", default=None, help="write the plan's JSON here")


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    from baton.engine.config import DEFAULT_MODEL
    args.model = args.model or DEFAULT_MODEL
    args.device = args.device or _default_device()
    if args.devices is None:                             # unset, not 0: that is refused below
        args.devices = _accelerators() or 2
    if args.devices < 1:
        raise ValueError(f"--devices must be >= 1, got {args.devices}")
    args.datasets = _split(args.dataset) or ["random"]
    for ds in args.datasets:
        if ds not in datasets.LENGTHS and not ds.endswith(".jsonl"):
            raise ValueError(f"unknown dataset {ds!r}: use {', '.join(datasets.LENGTHS)} or a .jsonl file")
    defaults = {ds: datasets.LENGTHS.get(ds, datasets.LENGTHS["random"]) for ds in args.datasets}   # (.jsonl: unused)
    args.lengths = {ds: (parse_lengths(args.input_len, ds, "--input-len") or defaults[ds][0],
                         parse_lengths(args.output_len, ds, "--output-len") or defaults[ds][1]) for ds in args.datasets}
    args.slos = slo_pairs(parse_slos(args.slo_ttft_ms, "--slo-ttft-ms"), parse_slos(args.slo_tpot_ms))
    try:
        args.tp = tuple(sorted({int(t) for t in _split(args.tp_sizes)}))
    except ValueError:
        raise ValueError(f"bad --tp-sizes {args.tp_sizes!r}: use e.g. 1,2") from None
    if not args.tp or min(args.tp) < 1:
        raise ValueError(f"bad --tp-sizes {args.tp_sizes!r}: sizes >= 1")
    args.candidates = _split(args.topologies) if args.topologies else deployment.candidates(args.devices, args.tp)
    if not args.candidates:
        raise ValueError(f"no topology of {args.devices} devices has workers of --tp-sizes {args.tp_sizes}: "
                         "add 1 to them, or name --topologies")
    for name in args.candidates:
        if deployment.parse(name).num_devices > args.devices:
            raise ValueError(f"topology {name} needs {deployment.parse(name).num_devices} devices; --devices is "
                             f"{args.devices}")
    if args.kv_bandwidth_gbs is not None and not args.kv_bandwidth_gbs > 0:
        raise ValueError(f"--kv-bandwidth-gbs must be > 0, got {args.kv_bandwidth_gbs}")
    if not args.kv_latency_ms >= 0:
        raise ValueError(f"--kv-latency-ms must be >= 0, got {args.kv_latency_ms}")
    blocks = worker_flag(args.worker_args, "--num-kv-blocks")
    if blocks is not None and not (blocks.isdigit() and int(blocks) >= 1):
        raise ValueError(f"--worker-args: --num-kv-blocks must be an integer >= 1, got {blocks!r}")
    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    probe_plan(args.slos, 1, args.probe_lifetimes, args.probe_seconds, args.probe_min_requests)   # validates
    Search(_never, args.search_tolerance)                                                           # validates
    if args.tp_speedup <= 0:
        raise ValueError(f"--tp-speedup must be > 0, got {args.tp_speedup}")
    if args.handoff_ms < 0:
        raise ValueError(f"--handoff-ms must be >= 0, got {args.handoff_ms}")
    if args.routers < 1 or args.router_ms < 0:
        raise ValueError(f"--routers must be >= 1 and --router-ms >= 0, got {args.routers} and {args.router_ms}")
    args.engine = engine_settings(args)
    return args


async def _never(rate: float) -> Probe:
    raise AssertionError("validation only")


def worker_flag(worker_args: str | None, name: str) -> str | None:
    """A flag's value in --worker-args ('--name V' or '--name=V'), else None."""
    flags = shlex.split(worker_args or "")
    for i, f in enumerate(flags):
        if f == name and i + 1 < len(flags):
            return flags[i + 1]
        if f.startswith(name + "="):
            return f.partition("=")[2]
    return None


def engine_settings(args: argparse.Namespace) -> dict:
    """The engine knobs the profile is measured under: the workers' batch limit and token budget."""
    out = {}
    for name, key in (("--max-num-seqs", "max_num_seqs"), ("--max-num-batched-tokens", "max_num_batched_tokens")):
        value = getattr(args, key, None)
        if value is None and worker_flag(args.worker_args, name) is not None:
            value = int(worker_flag(args.worker_args, name))
        if value is not None:
            out[key] = value
    if getattr(args, "tokenizer", None):
        out["tokenizer"] = args.tokenizer
    return out


def _default_device() -> str:
    return "cuda:0" if _accelerators() else "cpu"


def _accelerators() -> int:
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


# -- the prediction ------------------------------------------------------------------------------
def hardware(profile: device_profile.Profile, args: argparse.Namespace) -> Hardware:
    kind = "cpu" if profile.device == "cpu" else "accel"
    bandwidth, _ = KV_LINKS[kind]
    if args.kv_bandwidth_gbs is not None:
        bandwidth = args.kv_bandwidth_gbs * 1e9
    e = profile.engine
    blocks = worker_flag(args.worker_args, "--num-kv-blocks")        # the workers' KV, not the profiling engine's
    kv_tokens = int(blocks) * e["block_size"] if blocks else e["kv_capacity_tokens"]
    return Hardware(profile.cost, e["max_num_batched_tokens"], e["max_num_seqs"], kv_tokens,
                    profile.weight_bytes, profile.kv_bytes_per_token, args.tp_speedup, bandwidth,
                    args.kv_latency_ms / 1e3, args.handoff_ms / 1e3, args.router_ms / 1e3, args.routers)


def predict_workload(job: dict) -> dict:
    """One (workload, topology): every SLO pair's simulated goodput, searched from the queueing
    model's estimate. A plain dict in and out: it runs in a worker process."""
    hw = Hardware(StepCost.from_json(job["cost"]), **job["hardware"])
    topo = deployment.parse(job["topology"])
    slos = [SLO(*s) for s in job["slos"]]
    in_len, out_len = (tuple(r) for r in job["lengths"])
    sample = datasets.sample_lengths(job["dataset"], LENGTH_SAMPLES, job["seed"], in_len, out_len, job["max_model_len"])
    work = queueing.Workload(tuple(sample))
    analytic = {s.key: queueing.goodput(topo, hw, work, s) for s in slos}
    plan = probe_plan(slos, min(out_len[1], job["max_model_len"] - 1), job["lifetimes"], job["probe_seconds"],
                      job["min_requests"])
    count = [0]

    async def probe(rate: float) -> Probe:
        count[0] += 1
        seed = job["seed"] + 7919 * count[0]
        warm, measured, cool = plan.sizes(rate)
        n = warm + measured + cool
        arrivals = loadgen.segment_arrivals([warm, measured, cool], rate, seed)
        lengths = datasets.sample_lengths(job["dataset"], n, seed, in_len, out_len, job["max_model_len"])
        outs = simulate_probe(topo, hw, lengths, arrivals, range(warm, warm + measured), plan.deadline_s)
        return Probe(rate, [Outcome(*o) for o in outs])

    search = Search(probe, job["tolerance"], 1.25, min_rate=1e-3, max_rate=1e5)
    fallback = max((v for v in analytic.values() if v), default=1.0)
    results = asyncio.run(search.find_all(slos, {k: v or fallback for k, v in analytic.items()}))
    return {"dataset": job["dataset"], "topology": job["topology"],
            "by_slo": {r.slo.key: {"goodput": r.goodput, "converged": r.converged, "queueing": analytic[r.slo.key],
                                   "probes": len(r.probed)} for r in results}}


def predict(profile: device_profile.Profile, args: argparse.Namespace) -> dict:
    """Every candidate topology's predicted goodput per workload and SLO pair, and the pick."""
    hw = hardware(profile, args)
    base = {"cost": profile.cost.to_json(), "hardware": _hardware_json(hw), "slos": [(s.ttft_s, s.tpot_s) for s in args.slos],
            "seed": args.seed, "max_model_len": profile.engine["max_model_len"], "lifetimes": args.probe_lifetimes,
            "probe_seconds": args.probe_seconds, "min_requests": args.probe_min_requests,
            "tolerance": args.search_tolerance}
    jobs = [base | {"dataset": ds, "lengths": args.lengths[ds], "topology": t}
            for ds in args.datasets for t in args.candidates]
    workers = max(1, min(args.jobs or min(8, os.cpu_count() or 1), len(jobs)))
    if workers == 1:
        done = [predict_workload(j) for j in jobs]
    else:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            done = list(pool.map(predict_workload, jobs))
    return _tables(done, args)


def _hardware_json(hw: Hardware) -> dict:
    return {"budget": hw.budget, "max_num_seqs": hw.max_num_seqs, "kv_capacity": hw.kv_capacity,
            "weight_bytes": hw.weight_bytes, "kv_bytes_per_token": hw.kv_bytes_per_token,
            "tp_speedup": hw.tp_speedup, "kv_bandwidth": hw.kv_bandwidth, "kv_latency": hw.kv_latency,
            "handoff_s": hw.handoff_s, "router_s": hw.router_s, "routers": hw.routers}


def _tables(done: list[dict], args: argparse.Namespace) -> dict:
    baseline = f"{args.devices}colocated"
    router_rate = args.routers / (args.router_ms / 1e3) if args.router_ms > 0 else None
    out = {}
    for ds in args.datasets:
        rows = [d for d in done if d["dataset"] == ds]
        slos = {}
        for slo in args.slos:
            topos = {}
            for d in rows:
                r = d["by_slo"][slo.key]
                n = deployment.parse(d["topology"]).num_devices
                topos[d["topology"]] = r | {"per_device": r["goodput"] / n if r["goodput"] else None, "devices": n,
                                            "router_bound": bool(router_rate and r["goodput"]
                                                                 and r["goodput"] >= ROUTER_BOUND * router_rate)}
            ranked = sorted((t for t in topos if topos[t]["goodput"]), key=lambda t: (-topos[t]["goodput"],
                                                                                    topos[t]["devices"]))
            best = ranked[0] if ranked else None
            base = topos.get(baseline, {}).get("goodput")
            slos[slo.key] = {"slo": slo.to_json(), "topologies": topos, "best": best, "routers": args.routers,
                             "goodput": topos[best]["goodput"] if best else None, "baseline": baseline,
                             "best_over_baseline": topos[best]["goodput"] / base if best and base else None}
        out[ds] = {"lengths": {"input": list(args.lengths[ds][0]), "output": list(args.lengths[ds][1])}, "slos": slos}
    return out


def picks(plan: dict, workloads: list[str], slos: list[SLO]) -> list[str]:
    """The recommended topology of every (workload, SLO pair) the plan covers, each once."""
    out, unmet = [], []
    for ds in workloads:
        for slo in slos:
            row = plan.get("workloads", {}).get(ds, {}).get("slos", {}).get(slo.key)
            if row and row.get("best"):
                out.append(row["best"])
            elif row is not None:
                unmet.append(f"TTFT <= {slo.ttft_s * 1e3:g} ms, TPOT <= {slo.tpot_s * 1e3:g} ms for {ds}")
    if not out and unmet:
        raise ValueError(f"the plan predicts that no split meets {'; '.join(unmet)}: loosen the SLOs, or name "
                         "--topologies to measure")
    if not out:
        raise ValueError("the plan covers none of these workloads and SLO pairs: plan them with `baton plan` "
                         "(same --dataset, --slo-ttft-ms, --slo-tpot-ms)")
    return list(dict.fromkeys(out))


# -- the command ---------------------------------------------------------------------------------
@contextlib.contextmanager
def _worker_threads(args: argparse.Namespace):
    """On the CPU, profile on the threads each of the plan's --devices workers gets when launched
    (OMP_NUM_THREADS, else cores // workers, as bench serve and baton serve give them), not on every core."""
    if not str(args.device).startswith("cpu"):
        yield
        return
    import torch
    given = environment.get("OMP_NUM_THREADS") or ""
    threads = int(given) if given.isdigit() and int(given) > 0 else max(1, (os.cpu_count() or 1) // args.devices)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def make_plan(args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    with _worker_threads(args):
        prof = device_profile.load_or_measure(args.profile, args.model, args.device, args.engine,
                                              refresh=args.reprofile)
    t1 = time.perf_counter()
    print(f"[plan] predicting {len(args.candidates)} topologies x {len(args.datasets)} workload(s) x "
          f"{len(args.slos)} SLO pair(s) by simulation ...", file=sys.stderr, flush=True)
    workloads = predict(prof, args)
    t2 = time.perf_counter()
    return {"schema": SCHEMA, "model": args.model, "devices": args.devices, "device": args.device,
            "device_name": prof.device_name, "on_cpu": prof.device == "cpu",
            "method": "discrete-event simulation of each topology, searched like bench serve --goodput, "
                      "from the queueing model's estimate",
            "assumptions": {"tp_speedup": args.tp_speedup, **_hardware_json(hardware(prof, args))},
            "profile": prof.to_json(), "profile_path": args.profile, "candidates": args.candidates,
            "workloads": workloads,
            "seconds": {"profile": prof.seconds, "profile_cached": prof.cached, "profile_this_run": t1 - t0,
                        "predict": t2 - t1}}


def report(plan: dict) -> list[str]:
    """The table a person reads: per workload and SLO pair, every topology, best first."""
    lines = []
    if plan["on_cpu"]:
        lines.append("(profiled on the CPU: figures for this machine's cores, far below an accelerator's; "
                     "the split they favour may differ on one)")
    for ds, w in plan["workloads"].items():
        for s in w["slos"].values():
            slo = s["slo"]
            lines.append(f"{ds}, TTFT <= {slo['ttft_ms']:g} ms, TPOT <= {slo['tpot_ms']:g} ms "
                         f"({plan['devices']} x {plan['device_name'] or plan['device']}):")
            lines.append(f"  {'topology':<18} {'goodput req/s':>14} {'per device':>11} {'queueing model':>15}")
            order = sorted(s["topologies"].items(), key=lambda kv: -(kv[1]["goodput"] or 0))
            for name, t in order:
                mark = "  <- recommended" if name == s["best"] else ""
                mark += "  (held by the routers)" if t.get("router_bound") else ""
                lines.append(f"  {name:<18} {_num(t['goodput']):>14} {_num(t['per_device']):>11} "
                             f"{_num(t['queueing']):>15}{mark}")
            if any(t.get("router_bound") for t in s["topologies"].values()):
                n = s.get("routers", 1)
                lines.append(f"  {n} router(s) hold some of these: plan again with --routers {n + 1} (and serve with "
                             "as many; README, Routers) to see what the devices would give")
            ratio = f" ({s['best_over_baseline']:.2f}x {s['baseline']})" \
                if s["best_over_baseline"] and s["best"] != s["baseline"] else ""
            lines.append(f"  recommended: {s['best'] or 'none meets the targets'}"
                         + (f", predicted goodput {s['goodput']:.3g} req/s{ratio}" if s["best"] else ""))
        if ds == "shared-prefix":
            lines.append("  (the simulation has no prefix cache: every prompt's shared prefix is priced as computed, "
                         "so these predictions are pessimistic)")
    secs = plan["seconds"]
    cached = f" (read from {plan['profile_path']}; measured in {secs['profile']:.0f} s)" if secs["profile_cached"] else ""
    lines.append(f"(profile {secs['profile_this_run']:.0f} s{cached}, prediction {secs['predict']:.0f} s)")
    return lines


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def plan_for_bench(args: argparse.Namespace, path: Path) -> dict:
    """`bench serve --goodput --topologies auto` without --plan: plan its workloads, SLOs and
    device pool here, profiling its first device (cached in --profile)."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    argv = ["--model", args.model, "--devices", str(len(args.device_pool)), "--device", args.device_pool[0],
            "--dataset", ",".join(args.datasets), "--slo-ttft-ms", ",".join(f"{t:g}" for t in args.slo_ttfts_ms),
            "--slo-tpot-ms", ",".join(f"{t:g}" for t in args.slo_tpots_ms), "--worker-args", args.worker_args or "",
            "--probe-seconds", str(args.probe_seconds), "--probe-lifetimes", str(args.probe_lifetimes),
            "--probe-min-requests", str(args.probe_min_requests), "--routers", str(getattr(args, "routers", 1)),
            "--output", str(path)]
    argv += ["--input-len", ",".join(f"{ds}={i[0]}:{i[1]}" for ds, (i, _) in args.lengths.items()),
             "--output-len", ",".join(f"{ds}={o[0]}:{o[1]}" for ds, (_, o) in args.lengths.items())]
    if args.profile:
        argv += ["--profile", args.profile]
    plan = make_plan(resolve(p.parse_args(argv)))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan, indent=1) + "\n")
    for line in report(plan):
        print(f"[plan] {line}", file=sys.stderr, flush=True)
    return plan


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="baton plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    if args.output:
        from baton.benchmarks.cli import unwritable
        problem = unwritable(Path(args.output))
        if problem:                      # found now, not after the profile
            print(f"baton plan: --output {args.output}: {problem}", file=sys.stderr)
            sys.exit(2)
    try:
        resolve(args)
        plan = make_plan(args)
    except ValueError as exc:
        print(f"baton plan: {exc}", file=sys.stderr)
        sys.exit(2)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(plan, indent=1) + "\n")
    for line in report(plan):
        print(line)
    if args.output:
        print(f"[plan] wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
