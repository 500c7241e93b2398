"""The mixed soak (issue 48): `baton serve` on the embedded model under a steady mix for minutes,
as real users load it: 12 clients, short and long prompts, gRPC and HTTP streams, a fifth of the
requests cancelled mid-stream, one in twenty invalid. Pass: every request ends with the status its
kind expects (OK; CANCELLED for a cancel; 400 / INVALID_ARGUMENT for bad input), no KV block is
held once it is over, and no worker was restarted or called hung.

    python -m baton.benchmarks.soak --duration 600        # starts baton serve itself; JSON to --out

Figures go to docs/reliability.md. Not a test: minutes long by design (tests/test_long_prompts.py
holds the lean checks).
"""
from __future__ import annotations

import argparse
import collections
import json
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc

from baton import environment
from baton.serving.processes import free_port
from baton.v1 import router_pb2, router_pb2_grpc

SENTENCE = "The harbour master counted the boats, the tide turned and the gulls argued over the nets. "
KINDS = ("grpc", "http_stream", "http")


class Stack:
    """`baton serve` on free ports, its log in a file."""

    def __init__(self, log_path: Path, extra: list[str]):
        self.port, self.http_port = free_port(), free_port()
        self.log_path = log_path
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "baton", "serve", "--port", str(self.port), "--http-port", str(self.http_port),
             *extra], stdout=subprocess.PIPE, stderr=open(log_path, "wb"), env=environment.for_children(PYTHONUNBUFFERED="1"))
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and self.popen.poll() is None:
            if "serving on" in self.popen.stdout.readline().decode():
                return
        raise SystemExit(f"baton serve did not start; see {log_path}")

    def stop(self) -> int:
        self.popen.send_signal(signal.SIGINT)
        return self.popen.wait(120)


class Soak:
    def __init__(self, stack: Stack, args: argparse.Namespace):
        self.stack, self.args = stack, args
        self.statuses: collections.Counter[tuple[str, str, str]] = collections.Counter()   # (kind, intent, status)
        self.unexpected: list[str] = []
        self.latencies: list[float] = []
        self.lock = threading.Lock()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{stack.port}")
        self.stub = router_pb2_grpc.RouterStub(self.channel)

    # -- one request -------------------------------------------------------------------------
    def one(self, rng: random.Random) -> None:
        kind = rng.choice(KINDS)
        roll = rng.random()
        intent = "invalid" if roll < self.args.invalid else "cancel" if roll < self.args.invalid + self.args.cancel \
            else "complete"
        long = rng.random() < self.args.long_fraction
        prompt = (SENTENCE * rng.randint(60, 150) if long else "") + f"Question {rng.randint(0, 10**6)}: " \
            "what is a good name for a small boat?"
        max_tokens = rng.randint(8, 64)
        t0 = time.monotonic()
        try:
            status = getattr(self, kind)(prompt, max_tokens, intent)
        except Exception as exc:                  # a client-side failure is a finding, not a crash
            status = f"client error {type(exc).__name__}: {exc}"
        expected = {"complete": {"OK", "200"}, "cancel": {"CANCELLED", "cancelled"},
                    "invalid": {"INVALID_ARGUMENT", "400"}}[intent]
        with self.lock:
            self.statuses[(kind, intent, status)] += 1
            if status not in expected:
                self.unexpected.append(f"{kind} {intent} long={long}: {status}")
            elif intent == "complete":
                self.latencies.append(time.monotonic() - t0)

    def grpc(self, prompt: str, max_tokens: int, intent: str) -> str:
        sampling = router_pb2.SamplingParams(max_tokens=max_tokens, temperature=-1.0 if intent == "invalid" else 0.7)
        req = router_pb2.GenerateRequest(chat=router_pb2.Chat(messages=[router_pb2.ChatMessage(
            role="user", content=prompt)]), sampling=sampling)
        call = self.stub.Generate(req, timeout=self.args.request_timeout)
        try:
            for i, _ in enumerate(call):
                if intent == "cancel" and i >= 1:
                    call.cancel()
                    return "cancelled"
        except grpc.RpcError as exc:
            return exc.code().name
        return "OK"

    def http(self, prompt: str, max_tokens: int, intent: str, stream: bool = False) -> str:
        body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens, "temperature": 0.7, "stream": stream or intent == "cancel"}
        if intent == "invalid":
            body["top_p"] = 0
        req = urllib.request.Request(f"http://127.0.0.1:{self.stack.http_port}/v1/chat/completions",
                                     json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.args.request_timeout) as r:
                if intent == "cancel":          # two events, then hang up: the router must abort it
                    r.readline(), r.readline(), r.readline()
                    return "cancelled"
                r.read()
                return str(r.status)
        except urllib.error.HTTPError as exc:
            return str(exc.code)

    def http_stream(self, prompt: str, max_tokens: int, intent: str) -> str:
        return self.http(prompt, max_tokens, intent, stream=True)

    # -- the run -----------------------------------------------------------------------------
    def client(self, seed: int, until: float) -> None:
        rng = random.Random(seed)
        while time.monotonic() < until:
            self.one(rng)
            time.sleep(rng.expovariate(1 / self.args.think_s))

    def run(self) -> dict:
        until = time.monotonic() + self.args.duration
        threads = [threading.Thread(target=self.client, args=(self.args.seed + i, until), daemon=True)
                   for i in range(self.args.clients)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            time.sleep(min(30.0, max(1.0, until - time.monotonic())))
            with self.lock:
                done = sum(self.statuses.values())
            print(f"[soak] {done} requests, {len(self.unexpected)} unexpected, "
                  f"{max(0.0, until - time.monotonic()):.0f}s left", file=sys.stderr, flush=True)
        return self.report()

    def held_blocks(self, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while True:
            workers = self.stub.GetServerInfo(router_pb2.GetServerInfoRequest(), timeout=10).workers
            held = sum(w.kv_blocks_total - w.kv_blocks_free for w in workers)
            if held == 0 or time.monotonic() > deadline:
                return held
            time.sleep(1)

    def report(self) -> dict:
        log = self.stack.log_path.read_text(errors="replace")
        lat = sorted(self.latencies)
        return {
            "duration_s": self.args.duration, "clients": self.args.clients, "requests": sum(self.statuses.values()),
            "by_status": {" / ".join(k): v for k, v in sorted(self.statuses.items())},
            "unexpected": len(self.unexpected), "unexpected_examples": self.unexpected[:20],
            "blocks_held_after": self.held_blocks(),
            "worker_restarts": log.count("restarting "), "hung_verdicts": log.count("hung"),
            "tracebacks": log.count("Traceback"),
            "completed_latency_p50_s": lat[len(lat) // 2] if lat else None,
            "completed_latency_p99_s": lat[int(0.99 * (len(lat) - 1))] if lat else None,
            "command": " ".join(sys.argv),
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m baton.benchmarks.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--clients", type=int, default=12)
    p.add_argument("--cancel", type=float, default=0.20, help="fraction cancelled mid-stream")
    p.add_argument("--invalid", type=float, default=0.05, help="fraction with an invalid parameter")
    p.add_argument("--long-fraction", type=float, default=0.15, help="fraction with a ~1-2k-token prompt")
    p.add_argument("--think-s", type=float, default=0.5, help="mean pause of a client between requests")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="soak.json")
    p.add_argument("--log", default="soak-serve.log", help="where baton serve's log goes")
    p.add_argument("serve_args", nargs="*", help="more flags for baton serve (after --)")
    args = p.parse_args(argv)
    stack = Stack(Path(args.log), args.serve_args)
    try:
        result = Soak(stack, args).run()
    finally:
        code = stack.stop()
    result["serve_exit_code"] = code
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    ok = not result["unexpected"] and not result["blocks_held_after"] and not result["worker_restarts"] \
        and not result["hung_verdicts"] and code == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
