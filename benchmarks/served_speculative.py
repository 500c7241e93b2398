"""Speculative decoding through the router: what n-gram guessing is worth to an OpenAI client.

    python -m baton.benchmarks.served_speculative --devices cuda:0 --concurrency 1,16 --output served-spec.json

Launches one deployment (default 1p1d: a prefill and a decode worker and the router, separate processes;
the decode worker with --speculative-method ngram), then sends benchmarks/speculative.py's edit requests
(repeat a passage with one word changed: the answer copies the prompt) to the router's
/v1/chat/completions, greedy, `concurrency` in flight and each finished one replaced by the next
(concurrency x --requests-per-slot requests a round). Each round runs the requests twice in turns, once
as they are and once opted out of speculation per request (`"speculative": false`, the same workers), and
alternates which goes first; the medians of output tok/s (completion tokens over the round's wall time)
are compared. --offline then runs the offline engines on the same requests and device
(benchmarks/speculative.py's interleaved rounds), for served / offline.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from baton.benchmarks import deployment
from baton.benchmarks.speculative import ask

REQUEST_TIMEOUT_S = 120


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{url} answered {exc.code}: {exc.read().decode(errors='replace')[:500]}") from exc


def served_round(http_url: str, model: str, concurrency: int, n: int, max_tokens: int,
                 speculative: bool) -> tuple[float, list[str]]:
    """Output tok/s of n requests, `concurrency` in flight; the answers' texts, in request order."""
    def one(i: int) -> tuple[int, str]:
        body = {"model": model, "messages": [{"role": "user", "content": ask(i)}], "max_tokens": max_tokens,
                "temperature": 0}
        if not speculative:
            body["speculative"] = False
        out = _post(f"{http_url}/chat/completions", body)
        return out["usage"]["completion_tokens"], out["choices"][0]["message"]["content"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(one, range(n)))
    wall = time.perf_counter() - t0
    return sum(t for t, _ in results) / wall, [text for _, text in results]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--devices", default="cuda:0", help="the device pool (deployment.py: handed out in order)")
    p.add_argument("--topology", default="1p1d", help="XpYd or Ncolocated")
    p.add_argument("--worker-args", default="--speculative-method ngram --num-kv-blocks 8192",
                   help="the workers' flags (one string); speculation is on unless a request opts out (a KV cache "
                        "of its own size: two workers may share one GPU)")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--requests-per-slot", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--offline", action="store_true",
                   help="also the offline engines on the same requests (benchmarks/speculative.py, "
                        "--interleave-ms 250, the same rounds), for served / offline")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    log_dir = Path(tempfile.mkdtemp(prefix="baton-served-spec-"))
    dep = deployment.launch(args.topology, args.model, args.devices.split(","), args.worker_args.split(), log_dir)
    rows = []
    try:
        with urllib.request.urlopen(f"{dep.http_url}/models", timeout=30) as resp:
            model = json.load(resp)["data"][0]["id"]
        served_round(dep.http_url, model, 1, 1, 8, True)                 # warm both paths
        served_round(dep.http_url, model, 1, 1, 8, False)
        for c in concurrency:
            n = c * args.requests_per_slot
            tok_s, texts = {True: [], False: []}, {}
            for r in range(args.rounds):
                for spec in ((False, True) if r % 2 == 0 else (True, False)):
                    t, out = served_round(dep.http_url, model, c, n, args.max_tokens, spec)
                    tok_s[spec].append(t)
                    texts.setdefault(spec, out)
            plain, guessed = statistics.median(tok_s[False]), statistics.median(tok_s[True])
            rows.append({"concurrency": c, "requests": n, "plain_tok_s": round(plain, 1), "ngram_tok_s": round(guessed, 1),
                         "speedup": round(guessed / plain, 3),
                         "speedup_per_round": [round(g / q, 3) for q, g in zip(tok_s[False], tok_s[True], strict=True)],
                         "same_text": texts[False] == texts[True]})
            print(f"[served-spec] concurrency {c}: plain {plain:.0f} tok/s, ngram {guessed:.0f} tok/s "
                  f"({guessed / plain:.2f}x; rounds {rows[-1]['speedup_per_round']})", file=sys.stderr, flush=True)
    finally:
        dep.stop()
    record = {"model": args.model, "topology": args.topology, "devices": args.devices, "worker_args": args.worker_args,
              "max_tokens": args.max_tokens, "rounds": args.rounds, "served": rows}
    if args.offline:
        from baton.benchmarks import speculative
        off = Path(log_dir) / "offline.json"
        speculative.main(["--device", args.devices.split(",")[-1], "--batches", args.concurrency,
                          "--workloads", "stop-at-eos", "--rounds", str(args.rounds), "--interleave-ms", "250",
                          "--requests-per-slot", str(args.requests_per_slot), "--max-tokens", str(args.max_tokens),
                          "--output", str(off)])
        record["offline"] = json.loads(off.read_text())["rows"]
        for row, o in zip(rows, record["offline"], strict=True):
            row["served_over_offline"] = {"plain": round(row["plain_tok_s"] / o["plain_tok_s"], 3),
                                          "ngram": round(row["ngram_tok_s"] / o["ngram_tok_s"], 3)}
            print(f"[served-spec] concurrency {row['concurrency']}: served / offline {row['served_over_offline']}",
                  file=sys.stderr, flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
