"""`baton bench flip`: roles that follow the load, measured. One deployment of switchable workers
(each `baton decode --role R --admin-token T`, so any of them can change role in place) serves a
load whose mix flips: --phases, by default prefill-heavy for 90 s then decode-heavy for 90 s
(Poisson arrivals, each phase's count fixed, the same prompts and arrival times for every run).

The schedule runs once per entry of --runs: a split (XpYd or Ncolocated) is set by role switches
before its run and held (a static split); `elastic` starts from --elastic-from and has `baton
elastic --plan` switch roles while the load runs (its decisions and switch moments are recorded).
Every request is judged against one SLO pair; errors and requests cut at their deadline are
misses. A run's goodput is the requests that met the SLO per second of the schedule: every run
is offered the same load, so what it served in time is what tells them apart. Reported per run:
that goodput, attainment per phase and per --bin-s bin, TTFT / TPOT percentiles; and the elastic
run's goodput over the best static run's. The plot: attainment against time, one line per run,
the phase boundary and the elastic run's switches marked.

The deployment runs --routers router processes sharing its ports (default as `bench serve`'s: one
per accelerator), and `baton elastic` reads the mix off every one of them (their metrics summed).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from baton.benchmarks import datasets, deployment, loadgen, record
from baton.benchmarks.deployment import ROLES, next_move, split_counts
from baton.benchmarks.flags import parse_lengths
from baton.benchmarks.goodput import SLO
from baton.benchmarks.serve import default_routers
from baton.benchmarks.stats import meets_slo, summarize
from baton.engine.config import DEFAULT_MODEL
from baton.serving.grpc_server import open_sync_channel
from baton.v1 import admin_pb2_grpc, router_pb2, router_pb2_grpc

FULL = dict(phases="prefill-heavy:60:90,decode-heavy:380:90", runs="elastic,2p2d,3p1d,1p3d", elastic_from="3p1d",
            devices="cuda:0,cuda:1,cuda:2,cuda:3", slo_ttft_ms=1000.0, slo_tpot_ms=15.0, window=5.0, windows=2,
            cooldown=5.0, bin_s=5.0,
            input_len="prefill-heavy=1024:2048,decode-heavy=32:128", output_len="prefill-heavy=8:32,decode-heavy=64:192")
# seconds-long on the embedded model: two CPU workers, a plan that wants 1P1D for long prompts and
# two colocated replicas for long outputs, SLOs a loaded 2-core box meets
SMOKE = dict(phases="prefill-heavy:1.5:8,decode-heavy:2:10", runs="elastic,1p1d", elastic_from="1p1d",
             devices="cpu", slo_ttft_ms=10_000.0, slo_tpot_ms=1000.0, window=2.0, windows=1, cooldown=1.0, bin_s=2.0,
             input_len="prefill-heavy=96:128,decode-heavy=8:16", output_len="prefill-heavy=2:4,decode-heavy=24:32")
DEADLINE_GRACE_S = 1.0            # past TTFT + TPOT x tokens by this much, a request can no longer count


@dataclass(frozen=True, slots=True)
class Phase:
    dataset: str
    rate: float
    seconds: float

    @property
    def count(self) -> int:
        return max(1, round(self.rate * self.seconds))

    def to_json(self) -> dict:
        return {"dataset": self.dataset, "rate": self.rate, "seconds": self.seconds, "count": self.count}


def parse_phases(spec: str) -> list[Phase]:
    """'prefill-heavy:60:90,decode-heavy:380:90' -> DATASET:RATE:SECONDS, in order."""
    phases = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        parts = item.split(":")
        try:
            dataset, rate, seconds = parts[0], float(parts[1]), float(parts[2])
        except (IndexError, ValueError):
            raise ValueError(f"bad --phases entry {item!r}: use DATASET:RATE:SECONDS, e.g. prefill-heavy:60:90") from None
        if len(parts) != 3 or not (rate > 0 and math.isfinite(rate)) or not seconds > 0:
            raise ValueError(f"bad --phases entry {item!r}: a finite rate > 0 req/s and seconds > 0")
        if dataset not in datasets.LENGTHS:
            raise ValueError(f"--phases: unknown dataset {dataset!r} (use {', '.join(datasets.LENGTHS)})")
        phases.append(Phase(dataset, rate, seconds))
    if len(phases) < 2:
        raise ValueError("--phases needs at least two phases (the mix must change)")
    return phases


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--devices", default=None, help=f"one device per worker, in order (default: {FULL['devices']})")
    p.add_argument("--phases", default=None, help=f"DATASET:RATE:SECONDS,... (default: {FULL['phases']})")
    p.add_argument("--runs", default=None, help="splits to hold, and `elastic`, each run on the same schedule "
                   f"(default: {FULL['runs']})")
    p.add_argument("--elastic-from", default=None, help=f"the elastic run's first split (default: {FULL['elastic_from']})")
    p.add_argument("--plan", default=None, help="`baton plan --output` for the elastic run (default with --smoke: a "
                   "two-worker plan written here)")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help=f"(default: {FULL['slo_ttft_ms']:g})")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help=f"(default: {FULL['slo_tpot_ms']:g})")
    p.add_argument("--input-len", default=None, help=f"per dataset, NAME=MIN:MAX,... (default: {FULL['input_len']})")
    p.add_argument("--output-len", default=None, help=f"per dataset (default: {FULL['output_len']})")
    p.add_argument("--window", type=float, default=None, help="baton elastic --window")
    p.add_argument("--windows", type=int, default=None, help="baton elastic --windows")
    p.add_argument("--cooldown", type=float, default=None, help="baton elastic --cooldown")
    p.add_argument("--bin-s", type=float, default=None, help="attainment is also reported per bin of this many seconds")
    p.add_argument("--kv-backend", default=None, help="the workers' --kv-backend (default: theirs)")
    p.add_argument("--routers", type=int, default=None, help="router processes sharing the deployment's ports "
                   "(default: one per accelerator of --devices, one on the CPU); `baton elastic` reads all of them")
    p.add_argument("--worker-args", default="", help="more flags for every worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="skip the runs that would end past this many seconds from the start (launch included)")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--no-plots", action="store_true", help="skip the PNG")


def resolve(args: argparse.Namespace) -> None:
    base = SMOKE if args.smoke else FULL
    for key, value in base.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.phase_list = parse_phases(args.phases)
    args.run_list = [r.strip() for r in args.runs.split(",") if r.strip()]
    args.device_list = [d.strip() for d in args.devices.split(",") if d.strip()]
    if not args.run_list:
        raise ValueError("--runs is empty")
    if args.routers is None:
        args.routers = default_routers(args.device_list)
    if args.routers < 1:
        raise ValueError(f"--routers must be >= 1, got {args.routers}")
    workers: dict[str, int] = {}
    for name in [n for n in args.run_list if n != "elastic"] + [args.elastic_from]:
        counts = split_counts(name)         # (raises ValueError on a name it cannot parse)
        if counts is None:
            raise ValueError(f"{name}: a tensor-parallel split cannot be reached by role switches")
        workers[name] = sum(counts.values())
    if len(set(workers.values())) > 1:
        raise ValueError("every split of one run (--runs, --elastic-from) must have as many workers: "
                         + ", ".join(f"{n} has {w} workers" if i == 0 else f"{n} {w}"
                                     for i, (n, w) in enumerate(workers.items())))
    if not args.bin_s > 0:
        raise ValueError(f"--bin-s must be > 0, got {args.bin_s}")
    if "elastic" in args.run_list and not args.plan and not args.smoke:
        raise ValueError("the elastic run needs --plan (baton plan ... --output plan.json)")
    if args.plan and not Path(args.plan).is_file():
        raise ValueError(f"--plan {args.plan}: no such file")
    if args.slo_ttft_ms <= 0 or args.slo_tpot_ms <= 0:
        raise ValueError("--slo-ttft-ms and --slo-tpot-ms must be > 0")
    args.slo = SLO(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)


def build_schedule(args: argparse.Namespace, max_model_len: int, vocab_size: int) -> tuple[list, list[float], list[int]]:
    """(requests, arrival times, phase index) of the whole schedule, phases back to back."""
    reqs, arrivals, phase_of, t0 = [], [], [], 0.0
    for i, ph in enumerate(args.phase_list):
        lengths = (parse_lengths(args.input_len, ph.dataset, "--input-len") or datasets.LENGTHS[ph.dataset][0],
                   parse_lengths(args.output_len, ph.dataset, "--output-len") or datasets.LENGTHS[ph.dataset][1])
        reqs += datasets.build_requests(ph.dataset, ph.count, args.seed + 101 * i, *lengths,
                                        max_model_len=max_model_len, vocab_size=vocab_size)
        arrivals += [t0 + t for t in loadgen.segment_arrivals([ph.count], ph.rate, args.seed + 101 * i)]
        phase_of += [i] * ph.count
        t0 += ph.seconds
    return reqs, arrivals, phase_of


def deadlines(reqs: list, slo: SLO) -> list[float]:
    """Each request is cut once it can no longer meet the SLO."""
    return [slo.ttft_s + slo.tpot_s * r.max_tokens + DEADLINE_GRACE_S for r in reqs]


def judge(results: list, phase_of: list[int], phases: list[Phase], slo: SLO, bin_s: float) -> dict:
    """A run's goodput (requests in SLO per second of the schedule), attainment by phase and by bin."""
    met = [meets_slo(r.ok, r.ttft, r.tpot, slo.ttft_s, slo.tpot_s) for r in results]
    length = sum(p.seconds for p in phases)
    by_phase = []
    for i, ph in enumerate(phases):
        mine = [m for m, k in zip(met, phase_of, strict=True) if k == i]
        by_phase.append({"dataset": ph.dataset, "rate": ph.rate, "seconds": ph.seconds, "requests": len(mine),
                         "attainment": sum(mine) / len(mine) if mine else None,
                         "goodput": sum(mine) / ph.seconds})
    bins: dict[int, list[bool]] = {}
    for r, m in zip(results, met, strict=True):
        bins.setdefault(int(r.sent_at // bin_s), []).append(m)
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.status] = errors.get(r.status, 0) + 1
    return {"goodput": sum(met) / length, "attainment": sum(met) / len(met) if met else None,
            "requests": len(results), "met": sum(met), "phases": by_phase,
            "bins": [{"t": k * bin_s, "requests": len(v), "attainment": sum(v) / len(v)} for k, v in sorted(bins.items())],
            "ttft_s": summarize(r.ttft for r in ok if r.ttft is not None),
            "tpot_s": summarize(t for t in (r.tpot for r in ok) if t is not None), "errors": errors}


class Roles:
    """The deployment's workers by role, read off the router, and role switches through its Admin service."""

    def __init__(self, address: str, token: str):
        self.channel = open_sync_channel(address, None)
        self.router = router_pb2_grpc.RouterStub(self.channel)
        self.admin = admin_pb2_grpc.AdminStub(self.channel)
        self.metadata = [("authorization", f"Bearer {token}")]

    def workers(self) -> list[router_pb2.WorkerInfo]:
        return [w for w in self.router.GetServerInfo(router_pb2.GetServerInfoRequest(), timeout=10).workers
                if w.healthy]

    def counts(self) -> dict[str, int]:
        ws = self.workers()
        return {r: sum(w.role == r for w in ws) for r in ROLES}

    def set_split(self, split: str, timeout_s: float = 120.0) -> list[dict]:
        """Switch workers, one at a time, until the deployment runs `split`; the switches made."""
        want, done, deadline = split_counts(split), [], time.monotonic() + timeout_s
        while (move := next_move(self.counts(), want)) is not None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"could not reach {split} within {timeout_s:.0f}s: at {self.counts()}")
            dst = move[1]
            r = deployment.switch_one(self.admin, self.workers(), move, 60.0, self.metadata)
            done.append({"worker": r.worker, "from": r.from_role, "to": r.to_role, "seconds": r.seconds})
            deadline_seen = time.monotonic() + 10     # the router adopts the new role at its next status poll
            while self.counts().get(dst, 0) < want.get(dst, 0) and next_move(self.counts(), want) == move \
                    and time.monotonic() < deadline_seen:
                time.sleep(0.2)
        return done

    def close(self) -> None:
        self.channel.close()


class ElasticProcess:
    """`baton elastic` beside a run, its stderr lines stamped on the run's clock."""
    SWITCHED = re.compile(r"\[elastic\] (\S+): (\w+) -> (\w+) in ([\d.]+)s")

    def __init__(self, args: argparse.Namespace, plan: Path, dep: deployment.Deployment, token: str):
        cmd = elastic_command(args, plan, dep, token)
        self.stamped: list[tuple[float, str]] = []      # (time.perf_counter(), line)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.stamped.append((time.perf_counter(), line.rstrip()))

    def events(self, t_zero: float) -> tuple[list[dict], list[dict]]:
        """(switches, every line), in seconds on the run's clock; a switch is placed where its call
        began (its line comes when it ends)."""
        lines, switches = [], []
        for pc, line in self.stamped:
            t = pc - t_zero
            lines.append({"t": round(t, 3), "line": line})
            if m := self.SWITCHED.search(line):
                switches.append({"t": round(t - float(m[4]), 3), "t_end": round(t, 3), "worker": m[1],
                                 "from": m[2], "to": m[3], "seconds": float(m[4])})
        return switches, lines

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        self.reader.join(timeout=5)


def elastic_command(args: argparse.Namespace, plan: Path, dep: deployment.Deployment, token: str) -> list[str]:
    """`baton elastic` for this deployment: every router's metrics (each router counts its own requests)."""
    metrics = ",".join(dep.router_metrics) or dep.http_url.removesuffix("/v1") + "/metrics"
    return [sys.executable, "-m", "baton", "elastic", "--plan", str(plan), "--slo", args.slo.key,
            "--addr", dep.router_address, "--metrics-url", metrics, "--admin-token", token,
            "--window", str(args.window), "--windows", str(args.windows), "--cooldown", str(args.cooldown)]


def smoke_plan(path: Path, slo: SLO) -> Path:
    """The two-worker plan --smoke's elastic run follows (the shape `baton plan --output` writes)."""
    plan = {"workloads": {
        "prefill-heavy": {"lengths": {"input": [96, 128], "output": [2, 4]}, "slos": {slo.key: {"best": "1p1d"}}},
        "decode-heavy": {"lengths": {"input": [8, 16], "output": [24, 32]}, "slos": {slo.key: {"best": "2colocated"}}}}}
    path.write_text(json.dumps(plan))
    return path


def run_schedule(address: str, reqs: list, arrivals: list[float], timeouts: list[float]) -> tuple[list, float, float]:
    """(results, wall seconds, the run's clock zero on time.perf_counter)."""
    processes = loadgen.default_processes(len(reqs))
    t_zero = time.perf_counter() + (loadgen.PROCESS_START_S if processes > 1 else 0.0)
    mean_rate = len(reqs) / max(max(arrivals), 1e-9) if arrivals else 1.0      # what its progress lines name
    results, wall = asyncio.run(loadgen.run_rate(address, reqs, mean_rate, 0, None,
                                                 {"temperature": 0.0, "ignore_eos": True},
                                                 timeouts, None, processes, arrivals))
    return results, wall, t_zero


def run(args: argparse.Namespace, rec: dict) -> None:
    started = time.monotonic()
    log_root = Path(args.log_dir) if args.log_dir else Path(args.output).with_suffix("").with_name(
        Path(args.output).stem + "-logs")
    token = secrets.token_hex(16)
    worker_args = ["--admin-token", token, *args.worker_args.split()]
    if args.kv_backend:
        worker_args += ["--kv-backend", args.kv_backend]
    first = args.elastic_from if args.run_list[0] == "elastic" else args.run_list[0]
    rec["device"] = record.device_info(sorted(set(args.device_list)))
    rec["workload"] = {"phases": [p.to_json() for p in args.phase_list], "slo": args.slo.to_json(),
                       "input_len": args.input_len, "output_len": args.output_len, "seed": args.seed,
                       "goodput": "requests meeting both SLOs per second of the schedule (every run offered the same)"}
    log_root.mkdir(parents=True, exist_ok=True)
    plan = Path(args.plan) if args.plan else smoke_plan(log_root / "smoke-plan.json", args.slo)
    dep = deployment.launch(first, args.model, args.device_list, worker_args, log_root, switchable=True,
                            router_args=["--admin-token", token], routers=args.routers)
    launch_s = time.monotonic() - started
    roles = Roles(dep.router_address, token)
    runs: dict[str, dict] = {}
    try:
        info, _ = asyncio.run(loadgen.model_info(dep.router_address))
        reqs, arrivals, phase_of = build_schedule(args, info.max_model_len, info.vocab_size)
        timeouts = deadlines(reqs, args.slo)
        length = sum(p.seconds for p in args.phase_list)
        mix = ", ".join(f"{p.dataset} {p.rate:g} req/s for {p.seconds:g}s" for p in args.phase_list)
        print(f"[bench] flip: {len(reqs)} requests over {length:g}s ({mix}); SLO {args.slo.key} ms; launched in "
              f"{launch_s:.0f}s", file=sys.stderr, flush=True)
        for name in args.run_list:
            expect = length + max(timeouts) + 20
            if args.time_budget_s is not None and time.monotonic() - started + expect > args.time_budget_s:
                print(f"[bench] flip: {name} skipped: the time budget is spent", file=sys.stderr, flush=True)
                runs[name] = {"skipped": "time budget"}
                continue
            runs[name] = one_run(args, name, dep, roles, plan, token, reqs, arrivals, timeouts, phase_of)
    finally:
        roles.close()
        dep.stop()
    rec["results"] = {"launch_s": launch_s, "deployment": dep.describe(), "plan": str(plan), "runs": runs}
    statics = {n: r["goodput"] for n, r in runs.items() if n != "elastic" and "goodput" in r}
    if statics and "goodput" in runs.get("elastic", {}):
        best = max(statics, key=statics.get)
        ratio = runs["elastic"]["goodput"] / statics[best] if statics[best] > 0 else math.inf
        rec["results"]["elastic_over_best_static"] = {"best_static": best, "ratio": ratio}
        print(f"[bench] flip: elastic {runs['elastic']['goodput']:.1f} req/s in SLO vs best static {best} "
              f"{statics[best]:.1f}: {ratio:.2f}x", file=sys.stderr, flush=True)
    if not args.no_plots:
        rec["results"]["plot"] = plot(runs, args.phase_list, Path(args.output).with_suffix(".png"))


def one_run(args, name: str, dep, roles: Roles, plan: Path, token: str, reqs, arrivals, timeouts, phase_of) -> dict:
    start = args.elastic_from if name == "elastic" else name
    set_by = roles.set_split(start)
    time.sleep(1.0)                        # the router's next poll sees every role
    elastic = None
    try:
        if name == "elastic":
            elastic = ElasticProcess(args, plan, dep, token)
        results, wall, t_zero = run_schedule(dep.router_address, reqs, arrivals, timeouts)
    finally:
        if elastic is not None:
            elastic.stop()
    out = judge(results, phase_of, args.phase_list, args.slo, args.bin_s)
    out |= {"start": start, "set_by": set_by, "wall_s": wall, "end_roles": roles.counts(),
            "requests_detail": [{"sent_at": round(r.sent_at, 4), "phase": k, "status": r.status,
                                 "ttft": None if r.ttft is None else round(r.ttft, 5),
                                 "tpot": None if r.tpot is None else round(r.tpot, 6), "output_tokens": r.output_tokens}
                                for r, k in zip(results, phase_of, strict=True)]}
    if elastic is not None:
        out["switches"], out["elastic_log"] = elastic.events(t_zero)
    phases = ", ".join(f"{p['dataset']} {100 * (p['attainment'] or 0):.0f} %" for p in out["phases"])
    moves = f"; {len(out.get('switches', []))} switch(es) at " + ", ".join(
        f"{s['t']:.0f}s {s['from']}->{s['to']}" for s in out.get("switches", [])) if elastic is not None else ""
    print(f"[bench] flip {name}: goodput {out['goodput']:.1f} req/s in SLO ({100 * (out['attainment'] or 0):.0f} % of "
          f"{out['requests']}: {phases}), TPOT p50 {1e3 * (out['tpot_s']['p50'] or 0):.1f} ms, errors {out['errors']}"
          f"{moves}", file=sys.stderr, flush=True)
    return out


def plot(runs: dict[str, dict], phases: list[Phase], path: Path) -> str | None:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 4.2))
    for name, r in runs.items():
        if "bins" not in r:
            continue
        ax.plot([b["t"] for b in r["bins"]], [100 * b["attainment"] for b in r["bins"]], marker=".",
                label=f"{name} ({r['goodput']:.1f} req/s in SLO)", linewidth=2.2 if name == "elastic" else 1.2)
        for s in r.get("switches", []):
            ax.axvline(s["t"], color="black", linestyle=":", linewidth=1)
            ax.annotate(f"{s['from'][0]}->{s['to'][0]}", (s["t"], 3), fontsize=7, rotation=90)
    t = 0.0
    for p in phases[:-1]:
        t += p.seconds
        ax.axvline(t, color="red", linestyle="--", linewidth=1)
    ax.set_xlabel("seconds into the schedule (sent at); red: the mix flips; dotted: elastic's switches")
    ax.set_ylabel("requests meeting the SLO, %")
    ax.set_ylim(0, 105)
    ax.set_title(" then ".join(f"{p.dataset} {p.rate:g} req/s" for p in phases))
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
