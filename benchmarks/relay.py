"""`baton bench relay`: how many tokens per second ONE router process relays. W synthetic workers
(the stock colocated worker, `--engine-core` benchmarks/synthetic_core.py: the real worker front
over a core that emits one token per request every --step-ms, no model) behind one real router (`python -m baton.router --colocated`);
C client processes open S concurrent Router.Generate streams of T tokens each, all at once.

Per step interval (one deployment each): tokens relayed per second (client tokens / wall from
the first send to the last finish), client messages per second (tokens per message shows the
coalescing), the router's CPU seconds over that window (/proc/<pid>/stat) and so its share of
one core, TPOT p50 / p99 as the clients see it, and TTFT as the clients see it and as the router
does (its own histogram: a client's TTFT far above it is time before the router's handler ran).
Offered load: S x 1000 / step-ms tok/s. One router process is measured, nothing more: a fleet
needing more runs several replicas.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import select
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from baton import environment
from baton.benchmarks import environment as bench_env
from baton.benchmarks import prometheus
from baton.benchmarks.deployment import wait_ready
from baton.benchmarks.stats import summarize
from baton.engine.config import DEFAULT_MODEL
from baton.serving.processes import Child, free_port, stop_all
from baton.v1 import router_pb2, router_pb2_grpc

SYNTHETIC_CORE = "baton.benchmarks.synthetic_core:SyntheticCore"

GOAL_TOK_S = 100_000
FULL = dict(workers=4, clients=4, streams=1000, max_tokens=2000, step_ms="5", timeout=300.0)
SMOKE = dict(workers=2, clients=1, streams=40, max_tokens=20, step_ms="5", timeout=60.0)
START_TIMEOUT_S = 120.0
STREAMS_PER_CHANNEL = 64            # streams share an HTTP/2 connection, as a real client's would
CLIENT_OPTIONS = [("grpc.use_local_subchannel_pool", 1)]    # each channel its own connection
CLK_TCK = os.sysconf("SC_CLK_TCK")
STOP_GRACE_S = 10.0
# the router's own view of a request: arrival at its Generate handler -> first token sent
ROUTER_HISTOGRAMS = {"router_ttft_ms": "baton_ttft_seconds", "router_queue_ms": "baton_queue_seconds"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = p.add_argument_group("deployment")
    d.add_argument("--workers", type=int, default=None, help="synthetic colocated workers (default 4; smoke 2)")
    d.add_argument("--step-ms", default=None, help="comma list of step intervals, one run each: every stream "
                   "gets one token per step (default 5: 200k tok/s offered by 1000 streams; smoke 5)")
    d.add_argument("--model", default=DEFAULT_MODEL, help="the model name the router serves (its tokenizer "
                   "is loaded; the workers only take the name)")
    d.add_argument("--tokenizer", default=None, help="tokenizer directory instead of the model's own (a preset "
                   "on a machine without the embedded model: any HF tokenizer directory)")
    d.add_argument("--text", action="store_true", help="workers send text with the tokens, made with --tokenizer "
                   "or the model's tokenizer, as real workers do (default: token ids only)")
    d.add_argument("--router-args", default="", help="extra router flags, e.g. '--policy round_robin'")
    d.add_argument("--log-dir", default=None, help="process logs (default: next to the JSON)")
    c = p.add_argument_group("load")
    c.add_argument("--clients", type=int, default=None, help="client processes (default 4; smoke 1)")
    c.add_argument("--streams", type=int, default=None, help="concurrent streams, all clients together "
                   "(default 1000; smoke 40)")
    c.add_argument("--max-tokens", type=int, default=None, help="tokens per stream (default 2000: ten seconds at "
                   "5 ms steps, so the figure is the steady relay rather than the streams' set-up; smoke 20)")
    c.add_argument("--prompt-len", type=int, default=8, help="prompt token ids per request")
    c.add_argument("--timeout", type=float, default=None, help="seconds per run (default 300; smoke 60)")
    c.add_argument("--api", default="grpc", choices=("grpc", "openai"),
                   help="the router API the streams use: grpc (Router.Generate) or openai (streamed "
                        "/v1/completions over its HTTP port, as benchmarks/loadgen.py sends them)")


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    for k, v in (SMOKE if args.smoke else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    try:
        args.steps_ms = [float(s) for s in str(args.step_ms).split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--step-ms must be a comma list of milliseconds, got {args.step_ms!r}") from None
    if not args.steps_ms or min(args.steps_ms) <= 0:
        raise ValueError(f"--step-ms must list intervals > 0, got {args.step_ms!r}")
    if min(args.workers, args.clients, args.max_tokens, args.prompt_len) < 1:
        raise ValueError("--workers, --clients, --max-tokens and --prompt-len must be >= 1")
    if args.streams < args.clients:
        raise ValueError(f"--streams {args.streams} is fewer than --clients {args.clients}")
    return args


def run(args: argparse.Namespace, rec: dict) -> None:
    from baton.benchmarks import record
    rec["model"] = {"name": args.model, "synthetic": True}
    rec["device"] = record.device_info(["cpu"])
    log_root = Path(args.log_dir) if args.log_dir else Path(args.output).with_suffix("").with_name(
        Path(args.output).stem + "-logs")
    worker_tokenizer = _worker_tokenizer(args)
    levels = []
    for step_ms in args.steps_ms:
        level = run_level(args, step_ms, worker_tokenizer, log_root / f"step-{step_ms:g}ms")
        levels.append(level)
        print(summary_line(level), file=sys.stderr, flush=True)
    rec["results"] = {"goal_tok_s": GOAL_TOK_S, "router_processes": 1, "text": args.text, "levels": levels,
                      "best_tok_s": max(lv["tok_s"] for lv in levels), "log_dir": str(log_root)}


def _worker_tokenizer(args: argparse.Namespace) -> str | None:
    """The directory workers make text with (--text): --tokenizer, else the model's own."""
    if not args.text:
        return None
    if args.tokenizer:
        return args.tokenizer
    from baton.models.source import resolve_model
    return resolve_model(args.model).tokenizer_dir()


# -- one deployment per step interval ----------------------------------------------------------------
@dataclass
class Deployment:
    router: Child | None = None
    workers: list[Child] = field(default_factory=list)
    router_metrics: str = ""
    http_url: str = ""                  # the router's OpenAI API (--api openai)

    @property
    def children(self) -> list[Child]:
        return [*self.workers, self.router] if self.router else list(self.workers)


def run_level(args: argparse.Namespace, step_ms: float, tokenizer: str | None, log_dir: Path) -> dict:
    print(f"[bench] relay: {args.workers} synthetic worker(s) at one token per stream every {step_ms:g} ms, "
          f"one router; logs in {log_dir} ...", file=sys.stderr, flush=True)
    dep = Deployment()
    try:
        launch(args, step_ms, tokenizer, log_dir, dep)
        return {"step_ms": step_ms, "offered_tok_s": args.streams * 1e3 / step_ms, **measure(args, dep)}
    finally:
        stop_all(dep.children, grace=STOP_GRACE_S)


def launch(args: argparse.Namespace, step_ms: float, tokenizer: str | None, log_dir: Path, dep: Deployment) -> None:
    log_dir.mkdir(parents=True, exist_ok=True)
    host = "127.0.0.1"
    tok = ["--tokenizer", tokenizer] if tokenizer else []
    for i in range(args.workers):
        address = f"{host}:{free_port(host)}"
        # the stock colocated worker (its front is what is measured) over the synthetic core
        cmd = [sys.executable, "-m", "baton.decode_service", "--colocated", "--host", host,
               "--port", address.rpartition(":")[2], "--model", args.model, "--engine-core", SYNTHETIC_CORE,
               "--grace", "1", *tok]
        dep.workers.append(_start(f"worker-{i}", cmd, address, log_dir, {bench_env.SYNTHETIC_STEP_MS: f"{step_ms:g}"}))
    for w in dep.workers:
        wait_ready(w, log_dir)
    address, metrics_port = f"{host}:{free_port(host)}", free_port(host)
    dep.router_metrics = f"http://{host}:{metrics_port}/metrics"
    http_port = free_port(host) if args.api == "openai" else 0
    dep.http_url = f"http://{host}:{http_port}/v1" if http_port else ""
    # --max-inflight: every stream runs at once (the default 512 would queue the rest)
    cmd = [sys.executable, "-m", "baton.router", "--host", host, "--port", address.rpartition(":")[2],
           "--http-port", str(http_port), "--colocated", ",".join(w.address for w in dep.workers), "--model", args.model,
           "--max-inflight", str(args.streams), "--grace", "1", "--metrics-port", str(metrics_port),
           *(["--tokenizer", args.tokenizer] if args.tokenizer else []), *args.router_args.split()]
    dep.router = _start("router", cmd, address, log_dir)
    wait_ready(dep.router, log_dir)
    _wait_workers_healthy(dep.router.address, args.workers)


def _start(name: str, cmd: list[str], address: str, log_dir: Path, env: dict | None = None) -> Child:
    env = environment.for_children(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
    with open(log_dir / f"{name}.log", "ab") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return Child(name, address, proc)


def _wait_workers_healthy(address: str, n: int) -> None:
    """Until the router's registry has passed every worker's health check."""
    deadline = time.monotonic() + START_TIMEOUT_S
    with grpc.insecure_channel(address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        while time.monotonic() < deadline:
            with contextlib.suppress(grpc.RpcError):
                info = stub.GetServerInfo(router_pb2.GetServerInfoRequest(), timeout=2.0)
                if sum(w.healthy for w in info.workers) >= n:
                    return
            time.sleep(0.2)
    raise RuntimeError(f"the router at {address} did not see its {n} workers healthy in {START_TIMEOUT_S:.0f}s")


# -- the measured run ------------------------------------------------------------------------------
def measure(args: argparse.Namespace, dep: Deployment) -> dict:
    """Start the clients, wait until each has its connections up, release them at one instant and
    collect what they counted; CPU seconds of every server process over the same window."""
    shares = [args.streams // args.clients + (i < args.streams % args.clients) for i in range(args.clients)]
    clients = [_client(dep.http_url or dep.router.address, n, args) for n in shares]
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        for c in clients:
            _read_json(c, deadline)                         # {"ready": true}
        pids = _server_pids(dep)
        before = _router_histograms(dep)
        cpu0, start_at = _cpu(pids), time.monotonic() + 0.2
        for c in clients:
            c.stdin.write(f"{start_at}\n".encode())
            c.stdin.flush()
        deadline = start_at + args.timeout + 30.0
        results = [_read_json(c, deadline) for c in clients]
        cpu1 = _cpu(pids)
        after = _router_histograms(dep)
    finally:
        for c in clients:
            _end(c)
    level = summarize_level(args, results, {role: cpu1[role] - cpu0[role] for role in cpu0},
                            _peak_rss_mb(dep.router.proc.pid))
    for key, name in ROUTER_HISTOGRAMS.items():
        q = prometheus.quantiles_between(before[name], after[name])
        level[key] = {"count": q["count"], **{p: q[p] * 1e3 if q[p] is not None else None for p in ("p50", "p99")}}
    return level


def _router_histograms(dep: Deployment) -> dict[str, dict[float, float]]:
    """Where new streams wait: a client's TTFT well above the router's own is time before the
    router's handler ran (its gRPC server taking the call)."""
    return {name: prometheus.scrape([dep.router_metrics], name)[0] for name in ROUTER_HISTOGRAMS.values()}


def _client(address: str, streams: int, args: argparse.Namespace) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "baton.benchmarks.relay", address, str(streams), str(args.max_tokens),
           str(args.prompt_len), str(args.timeout), args.api]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def _read_json(proc: subprocess.Popen, deadline: float) -> dict:
    """The client's next line (bounded: a stuck client fails the run instead of hanging it)."""
    buf = b""
    fd = proc.stdout.fileno()
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"a relay client (pid {proc.pid}) did not answer in time")
        ready, _, _ = select.select([fd], [], [], min(left, 1.0))
        if ready:
            piece = os.read(fd, 1 << 16)
            if not piece:
                raise RuntimeError(f"a relay client (pid {proc.pid}) exited with code {proc.wait(5)}")
            buf += piece
    return json.loads(buf)


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def _server_pids(dep: Deployment) -> dict[str, list[int]]:
    fronts = [w.proc.pid for w in dep.workers]
    return {"router": [dep.router.proc.pid], "worker_fronts": fronts,
            "worker_cores": [c for pid in fronts for c in _children(pid)]}


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and (stat := _stat(int(d.name))) and int(stat[1]) == pid:
            out.append(int(d.name))
    return out


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state first)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None


def _cpu(pids: dict[str, list[int]]) -> dict[str, float]:
    """utime + stime in seconds, summed per role."""
    return {role: sum((int(s[11]) + int(s[12])) / CLK_TCK for p in ps if (s := _stat(p))) for role, ps in pids.items()}


def _peak_rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


# -- figures -----------------------------------------------------------------------------------------
def summarize_level(args: argparse.Namespace, results: list[dict], cpu: dict[str, float],
                    router_rss_mb: float | None) -> dict:
    tokens = sum(r["tokens"] for r in results)
    messages = sum(r["messages"] for r in results)
    complete = sum(r["complete"] for r in results)
    wall = max(r["last_finish"] for r in results) - min(r["first_send"] for r in results)
    errors = sum((Counter(r["errors"]) for r in results), Counter())
    router_cpu = cpu["router"]
    return {
        "api": args.api,
        "streams": args.streams, "max_tokens": args.max_tokens, "workers": args.workers, "clients": args.clients,
        "complete_streams": complete, "errors": dict(errors), "tokens": tokens, "messages": messages,
        "wall_s": wall, "tok_s": tokens / wall if wall > 0 else 0.0,
        "messages_per_s": messages / wall if wall > 0 else 0.0,
        "tokens_per_message": tokens / messages if messages else 0.0,
        "router_cpu_s": router_cpu, "router_cpu_utilization": router_cpu / wall if wall > 0 else 0.0,
        # tokens per CPU second of the router (all its threads): its ceiling at this coalescing
        "tok_per_router_cpu_s": tokens / router_cpu if router_cpu > 0 else None,
        "cpu_s": {**cpu, "clients": sum(r["cpu_s"] for r in results)},
        "router_peak_rss_mb": router_rss_mb,
        "tpot_ms": summarize(t * 1e3 for r in results for t in r["tpots"]),
        "ttft_ms": summarize(t * 1e3 for r in results for t in r["ttfts"]),
        "host_cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
    }


def summary_line(lv: dict) -> str:
    tpot = lv["tpot_ms"]
    return (f"[bench] relay: {lv['tok_s']:,.0f} tok/s through one router process "
            f"({lv['api']}, {lv['router_cpu_utilization']:.0%} of one core), {lv['tokens_per_message']:.2f} tokens/message; "
            f"offered {lv['offered_tok_s']:,.0f} tok/s ({lv['streams']} streams x {lv['max_tokens']} tokens, "
            f"one per {lv['step_ms']:g} ms step); {lv['complete_streams']}/{lv['streams']} streams complete; "
            f"TPOT p50 {_ms(tpot['p50'])} p99 {_ms(tpot['p99'])} ms; TTFT p50 {_ms(lv['ttft_ms']['p50'])} ms "
            f"(inside the router {_ms(lv['router_ttft_ms']['p50'])} ms); "
            f"router {lv['tok_per_router_cpu_s'] or 0:,.0f} tok per CPU second")


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


# -- a client process: python -m baton.benchmarks.relay ADDR STREAMS MAX_TOKENS PROMPT_LEN TIMEOUT API ----
def client_main(argv: list[str]) -> None:
    """Opens its streams' connections, says {"ready": true}, reads the start instant (monotonic
    clock, shared by the host's processes) from stdin, runs the streams, prints its counts."""
    address, streams, max_tokens, prompt_len, timeout, api = argv
    run = _client_run if api == "grpc" else _client_run_openai
    out = asyncio.run(run(address, int(streams), int(max_tokens), int(prompt_len), float(timeout)))
    _say(out)


def _say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _client_run(address: str, n: int, max_tokens: int, prompt_len: int, timeout: float) -> dict:
    channels = [grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS)
                for _ in range(math.ceil(n / STREAMS_PER_CHANNEL))]
    try:
        await asyncio.wait_for(asyncio.gather(*(ch.channel_ready() for ch in channels)), timeout)
        stubs = [router_pb2_grpc.RouterStub(ch) for ch in channels]
        request = router_pb2.GenerateRequest(
            tokens=router_pb2.TokenIds(ids=list(range(1, prompt_len + 1))),
            sampling=router_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
        _say({"ready": True})
        start_at = float(await asyncio.to_thread(sys.stdin.readline))
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        cpu0 = time.process_time()
        runs = await asyncio.gather(*(_stream(stubs[i % len(stubs)], request, timeout) for i in range(n)))
        cpu = time.process_time() - cpu0
    finally:
        await asyncio.gather(*(ch.close() for ch in channels))
    return _client_counts(runs, max_tokens, cpu)


async def _client_run_openai(url: str, n: int, max_tokens: int, prompt_len: int, timeout: float) -> dict:
    """As _client_run, through the router's OpenAI API (benchmarks/loadgen.py's client: streamed
    /v1/completions, a connection a stream)."""
    from baton.benchmarks.datasets import ServeRequest
    from baton.benchmarks.loadgen import OpenAIClient
    http = OpenAIClient(url)
    try:
        request = ServeRequest(max_tokens, list(range(1, prompt_len + 1)))
        sampling = {"temperature": 0.0, "ignore_eos": True}
        await asyncio.wait_for(http.send_one(-1, ServeRequest(1, [1]), sampling, timeout, 0.0), timeout)  # (model name)
        _say({"ready": True})
        start_at = float(await asyncio.to_thread(sys.stdin.readline))
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        cpu0 = time.process_time()
        runs = await asyncio.gather(*(_stream_openai(http, request, sampling, timeout) for _ in range(n)))
        cpu = time.process_time() - cpu0
    finally:
        await http.close()
    return _client_counts(runs, max_tokens, cpu)


async def _stream_openai(http, request, sampling: dict, timeout: float) -> tuple:
    """_stream's tuple for one streamed completion (its token-bearing events are its messages)."""
    sent = time.monotonic()
    res = await http.send_one(0, request, sampling, timeout, 0.0)
    if res.ttft is None:
        return sent, None, time.monotonic(), 0, 0, False, res.status if res.status != "OK" else "NO_TOKENS"
    first = sent + res.ttft
    error = None if res.status == "OK" else res.status
    return (sent, first, first + sum(res.itls), res.output_tokens or 0, len(res.itls) + 1,
            res.finish_reason is not None, error)


async def _stream(stub, request, timeout: float) -> tuple:
    """(sent, first token, last message, tokens, messages, finished, error) of one stream."""
    sent = time.monotonic()
    first = last = None
    tokens = messages = 0
    finished, error = False, None
    try:
        async for resp in stub.Generate(request, timeout=timeout):
            last = time.monotonic()
            messages += 1
            if resp.token_ids:
                first = first or last
                tokens += len(resp.token_ids)
            finished = finished or resp.finish_reason != router_pb2.FINISH_REASON_UNSPECIFIED
    except grpc.aio.AioRpcError as exc:
        error = exc.code().name
    return sent, first, last or time.monotonic(), tokens, messages, finished, error


def _client_counts(runs: list[tuple], max_tokens: int, cpu_s: float) -> dict:
    tpots = [(last - first) / (tokens - 1) for _, first, last, tokens, _, _, _ in runs if first and tokens > 1]
    return {"streams": len(runs), "tokens": sum(r[3] for r in runs), "messages": sum(r[4] for r in runs),
            "complete": sum(r[5] and r[6] is None and r[3] == max_tokens for r in runs),
            "errors": dict(Counter(r[6] for r in runs if r[6])),
            "first_send": min(r[0] for r in runs), "last_finish": max(r[2] for r in runs),
            "tpots": tpots, "ttfts": [first - sent for sent, first, *_ in runs if first], "cpu_s": cpu_s}


if __name__ == "__main__":
    client_main(sys.argv[1:])
