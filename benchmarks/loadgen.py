"""The load generator: streams requests to a baton.v1.Router at Poisson arrival times and
times every token as the client sees it, through the gRPC API (grpc.aio) or the same router's
OpenAI API (streamed /v1/completions over aiohttp). One event loop per client process; with
several (`processes`), the requests are dealt out among them on one shared clock, so the
client is never what limits a fast deployment (one Python process reads some 20-30k
messages a second)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import multiprocessing
import os
import random
import sys
import time
from dataclasses import dataclass, field

import grpc

from baton.benchmarks.datasets import ServeRequest
from baton.benchmarks.stats import tpot
from baton.v1 import router_pb2, router_pb2_grpc

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
STREAMS_PER_CHANNEL = 64
PROCESS_START_S = 3.0                # the client processes' shared clock starts this long after they are asked
FINISH_NAMES = {router_pb2.FINISH_REASON_UNSPECIFIED: None, router_pb2.FINISH_REASON_STOP: "stop",
                router_pb2.FINISH_REASON_LENGTH: "length", router_pb2.FINISH_REASON_ABORT: "abort"}


@dataclass(slots=True)
class RequestResult:
    index: int
    sent_at: float                  # seconds after the rate's first arrival
    status: str = "OK"              # "OK" or the gRPC status code name
    error: str | None = None
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)    # gaps between token-carrying chunks
    e2e: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "OK"

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.e2e is None or self.ttft is None:
            return None
        return tpot(self.e2e, self.ttft, self.output_tokens)

    def to_json(self) -> dict:
        return {"index": self.index, "sent_at": self.sent_at, "status": self.status, "error": self.error,
                "ttft": self.ttft, "tpot": self.tpot, "e2e": self.e2e, "itls": self.itls,
                "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                "cached_tokens": self.cached_tokens, "finish_reason": self.finish_reason}


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Poisson arrivals: exponential gaps of mean 1/rate, the first at 0; all at 0 for inf."""
    if rate <= 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


def segment_arrivals(counts: list[int], rate: float, seed: int) -> list[float]:
    """Poisson arrivals conditioned on each segment's count: segment i holds counts[i] arrival
    times uniform over counts[i] / rate seconds (what a Poisson process looks like given its
    count), segments back to back, the first arrival at 0. Each segment's realized rate is then
    exactly `rate`: a goodput probe compares rates, not the luck of one draw (plain exponential
    gaps put the realized rate of 500 arrivals 4.5 % off the nominal one, one standard deviation)."""
    if not rate > 0 or math.isinf(rate):
        raise ValueError(f"a probe's rate must be finite and > 0, got {rate}")
    rng = random.Random(seed)
    out, t0 = [], 0.0
    for n in counts:
        span = n / rate
        out += sorted(t0 + rng.uniform(0, span) for _ in range(n))
        t0 += span
    return [t - out[0] for t in out] if out else []


def generate_request(req: ServeRequest, sampling: dict) -> router_pb2.GenerateRequest:
    params = router_pb2.SamplingParams(max_tokens=req.max_tokens, **sampling)
    if req.prompt_ids is not None:
        return router_pb2.GenerateRequest(tokens=router_pb2.TokenIds(ids=req.prompt_ids), sampling=params)
    return router_pb2.GenerateRequest(text=req.text, sampling=params)


async def send_one(stub: router_pb2_grpc.RouterStub, index: int, req: ServeRequest, sampling: dict,
                   timeout: float, t_zero: float) -> RequestResult:
    start = time.perf_counter()
    res = RequestResult(index, start - t_zero)
    last = None
    try:
        async for resp in stub.Generate(generate_request(req, sampling), timeout=timeout):
            now = time.perf_counter()
            if resp.token_ids:
                if res.ttft is None:
                    res.ttft = now - start
                else:
                    res.itls.append(now - last)
                last = now
                res.output_tokens += len(resp.token_ids)
            if resp.HasField("usage"):
                res.prompt_tokens = resp.usage.prompt_tokens
                res.cached_tokens = resp.usage.cached_prompt_tokens
            if resp.finish_reason:
                res.finish_reason = FINISH_NAMES.get(resp.finish_reason, str(resp.finish_reason))
    except grpc.aio.AioRpcError as exc:
        res.status, res.error = exc.code().name, exc.details()
    res.e2e = time.perf_counter() - start
    return res


class OpenAIClient:
    """Streamed /v1/completions against the router's OpenAI API: the same request as the gRPC
    one (token ids or text, max_tokens, temperature, ignore_eos), timed the same way."""

    def __init__(self, base_url: str):
        import aiohttp
        self.url = base_url.rstrip("/")
        # no pool limit: a few hundred streams at once are the point
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self.model: str | None = None

    async def close(self) -> None:
        await self.session.close()

    async def send_one(self, index: int, req: ServeRequest, sampling: dict, timeout: float,
                       t_zero: float) -> RequestResult:
        import aiohttp
        if self.model is None:
            self.model = await openai_model(self.url)
        body = {"model": self.model, "prompt": req.prompt_ids if req.prompt_ids is not None else req.text,
                "max_tokens": req.max_tokens, "stream": True, "stream_options": {"include_usage": True}, **sampling}
        start = time.perf_counter()
        res = RequestResult(index, start - t_zero)
        last = None
        try:
            async with self.session.post(f"{self.url}/completions", json=body,
                                         timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                if r.status != 200:
                    res.status = f"HTTP_{r.status}"
                    res.error = (await r.text())[:500]
                else:
                    async for line in r.content:
                        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                            continue
                        chunk = json.loads(line[6:])
                        now = time.perf_counter()
                        choice = (chunk.get("choices") or [{}])[0]
                        if choice.get("text") is not None:          # a token-bearing event (its text may be "")
                            if res.ttft is None:
                                res.ttft = now - start
                            else:
                                res.itls.append(now - last)
                            last = now
                        if choice.get("finish_reason"):
                            res.finish_reason = choice["finish_reason"]
                        if chunk.get("usage"):
                            u = chunk["usage"]
                            res.prompt_tokens, res.output_tokens = u["prompt_tokens"], u["completion_tokens"]
                            res.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        except (TimeoutError, aiohttp.ClientError) as exc:
            res.status, res.error = type(exc).__name__, str(exc)
        res.e2e = time.perf_counter() - start
        return res


def default_processes(num_requests: int) -> int:
    """Client processes for a run: one on a small machine (the CPU suite), up to 4 where cores
    are plenty and the load is big enough to need them."""
    return max(1, min(4, (os.cpu_count() or 1) // 4, num_requests // 64))


CUT = "CUT"                          # a request ended by the run (`until_done`), not by the server
PROGRESS_EVERY_S = 10.0              # a run's "n/N requests done" line, this often


class _Finish:
    """Which parts of a run have seen all their `until_done` requests finish: in this process, or
    shared by several (a manager's counter)."""

    def __init__(self, parts: int, counter=None, lock=None):
        self.parts, self.counter, self.lock, self.local = parts, counter, lock, 0

    def part_done(self) -> None:
        if self.counter is None:
            self.local += 1
            return
        with self.lock:
            self.counter.value += 1

    def all_done(self) -> bool:
        return (self.local if self.counter is None else self.counter.value) >= self.parts


async def run_rate(address: str, requests: list[ServeRequest], rate: float, seed: int,
                   max_concurrency: int | None, sampling: dict, timeout: float | list[float],
                   http_url: str | None = None, processes: int = 1, arrivals: list[float] | None = None,
                   until_done: range | None = None) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival time, through gRPC at `address`, or the OpenAI API at
    `http_url` when given; (results in request order, wall seconds). `timeout`: seconds per
    request, or one per request. `arrivals`: the times (default: Poisson at `rate`, seeded).
    `until_done`: once these requests have all ended, the others are cut (status CUT): a probe's
    cool-down lasts only as long as its measured requests need it. `processes` > 1: dealt out
    among that many client processes (request i to process i % processes; the concurrency cap
    split likewise)."""
    arrivals = arrival_times(len(requests), rate, seed) if arrivals is None else arrivals
    timeouts = list(timeout) if isinstance(timeout, list) else [timeout] * len(requests)
    if len(timeouts) != len(requests):
        raise ValueError(f"{len(timeouts)} timeouts for {len(requests)} requests")
    until = set(until_done) if until_done is not None else None
    if processes <= 1:
        return await _run_part(address, requests, list(range(len(requests))), arrivals, max_concurrency, sampling,
                               timeouts, http_url, time.perf_counter(), rate, until, _Finish(1))
    t_zero = time.perf_counter() + PROCESS_START_S      # CLOCK_MONOTONIC: one clock for every process here
    parts = [list(range(p, len(requests), processes)) for p in range(processes)]
    caps = [None if max_concurrency is None else max(1, max_concurrency // processes + (p < max_concurrency % processes))
            for p in range(processes)]
    loop = asyncio.get_running_loop()
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager, concurrent.futures.ProcessPoolExecutor(processes, mp_context=ctx) as pool:
        finish = _Finish(processes, manager.Value("i", 0), manager.Lock())
        ended = manager.list([0] * processes)          # each part's requests ended so far, for the progress line
        futures = [loop.run_in_executor(pool, _part_in_process, address, [requests[i] for i in part], part,
                                        [arrivals[i] for i in part], caps[p], sampling, [timeouts[i] for i in part],
                                        http_url, t_zero, until, finish, (ended, p))
                   for p, part in enumerate(parts)]
        reporter = asyncio.ensure_future(_report_progress(lambda: sum(ended[:]), len(requests), rate))
        try:
            done = await asyncio.gather(*futures)
        finally:
            reporter.cancel()
    results = sorted((r for rs, _ in done for r in rs), key=lambda r: r.index)
    return results, max(wall for _, wall in done)


def _part_in_process(address, requests, indices, arrivals, max_concurrency, sampling, timeouts, http_url, t_zero,
                     until, finish, ended):
    return asyncio.run(_run_part(address, requests, indices, arrivals, max_concurrency, sampling, timeouts, http_url,
                                 t_zero, None, until, finish, ended))


async def _publish_ended(tasks: list[asyncio.Future], ended, every: float = 0.25) -> None:
    """A client process's count of ended requests, into its slot of the parent's list (a manager's)."""
    slots, part = ended
    while True:
        slots[part] = sum(t.done() for t in tasks)
        await asyncio.sleep(every)


async def _cut_when_done(tasks: list[asyncio.Future], mine: list[asyncio.Future], finish: _Finish,
                         cutting: list[bool]) -> None:
    """Once this part's `until_done` requests have ended and every other part's too, cut the rest."""
    if mine:
        await asyncio.wait(mine)
    await asyncio.to_thread(finish.part_done)
    while not await asyncio.to_thread(finish.all_done):
        await asyncio.sleep(0.05)
    cutting[0] = True
    for t in tasks:
        if not t.done():
            t.cancel()


async def _run_part(address: str, requests: list[ServeRequest], indices: list[int], arrivals: list[float],
                    max_concurrency: int | None, sampling: dict, timeouts: list[float], http_url: str | None,
                    t_zero: float, report: float | None, until: set[int] | None = None,
                    finish: _Finish | None = None, ended=None) -> tuple[list[RequestResult], float]:
    """One client process's share: request k is indices[k] of the whole run, due at t_zero + arrivals[k].
    `report`: the rate its progress line names (one process); `ended`: (a manager's list, this part's slot)
    where it publishes its count of ended requests for the parent's progress line (several)."""
    n_channels = max(1, min(8, math.ceil(min(len(requests), max_concurrency or len(requests)) / STREAMS_PER_CHANNEL)))
    http = OpenAIClient(http_url) if http_url else None
    channels = [] if http else [grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) for _ in range(n_channels)]
    stubs = [router_pb2_grpc.RouterStub(ch) for ch in channels]
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    def send(k: int):
        if http is not None:
            return http.send_one(indices[k], requests[k], sampling, timeouts[k], t_zero)
        return send_one(stubs[k % len(stubs)], indices[k], requests[k], sampling, timeouts[k], t_zero)

    cutting = [False]

    async def one(k: int) -> RequestResult:
        try:
            delay = t_zero + arrivals[k] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if limit is None:
                return await send(k)
            async with limit:
                return await send(k)
        except asyncio.CancelledError:
            if not cutting[0]:
                raise
            return RequestResult(indices[k], arrivals[k], CUT, "cut: the run's measured requests had all ended")

    tasks = [asyncio.ensure_future(one(k)) for k in range(len(requests))]
    reporter = (asyncio.ensure_future(_report_progress(lambda: sum(t.done() for t in tasks), len(tasks), report))
                if report is not None else
                asyncio.ensure_future(_publish_ended(tasks, ended)) if ended is not None else None)
    cutter = None if until is None else asyncio.ensure_future(
        _cut_when_done(tasks, [t for k, t in enumerate(tasks) if indices[k] in until], finish, cutting))
    try:
        results = await asyncio.gather(*tasks)
    finally:
        if cutter is not None:
            cutter.cancel()
        if reporter is not None:
            reporter.cancel()
        for t in tasks:
            t.cancel()
        for ch in channels:
            await ch.close()
        if http is not None:
            await http.close()
    return list(results), time.perf_counter() - t_zero


async def _report_progress(ended, total: int, rate: float) -> None:
    """Every PROGRESS_EVERY_S: how many of the run's `total` requests have ended (`ended()`)."""
    t0 = time.perf_counter()
    while True:
        await asyncio.sleep(PROGRESS_EVERY_S)
        print(f"[bench] rate {rate:g}: {ended()}/{total} requests done after {time.perf_counter() - t0:.0f}s",
              file=sys.stderr, flush=True)


async def openai_model(url: str, timeout: float = 30.0) -> str:
    """The model the OpenAI API at `url` serves; a RuntimeError naming the URL when none answers there."""
    import aiohttp
    try:
        async with aiohttp.ClientSession() as session, session.get(
                f"{url.rstrip('/')}/models", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            r.raise_for_status()
            return (await r.json())["data"][0]["id"]
    except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, IndexError) as exc:
        raise RuntimeError(f"no OpenAI API answers at {url} ({type(exc).__name__}: {exc}): pass --http-url "
                           "(the router's OpenAI API, on its --http-port; 0 turns it off), or use --api grpc") from None


async def model_info(address: str, timeout: float = 30.0) -> tuple[router_pb2.ModelInfo, router_pb2.ServerInfo]:
    """The router's model and workers; a RuntimeError naming the address when none answers there
    (the deployment not started, or another port), which `baton bench` prints as one line."""
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        try:
            info = await stub.GetModelInfo(router_pb2.GetModelInfoRequest(), timeout=timeout)
            server = await stub.GetServerInfo(router_pb2.GetServerInfoRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise RuntimeError(f"the router at {address} refused GetModelInfo: {exc.code().name}: "
                                   f"{exc.details()}") from None
            raise RuntimeError(f"no router answers at {address} ({exc.code().name}): start the deployment "
                               "(`baton serve`), give its --addr, or let the benchmark launch one "
                               "(--launch 1p1d, --topologies ..., --smoke)") from None
    return info, server
