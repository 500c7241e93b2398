"""`bench serve --offline-baseline`: the same requests through the offline engine (B1's, `baton
bench offline --requests`), on the same device, in the same invocation, after the served runs
(they hold the device while they run). What a deployment delivers is then stated against what
its engine can do: served ÷ offline output throughput, and the served TPOT p50 ÷ the offline
decode step p50 (a token per step is the most a stream can get).

The offline run gets the served workers' engine settings (the ones `--worker-args` sets) and
at most as many sequences at once as the load had in flight (`--max-concurrency`); a deployment
of one tensor-parallel worker (`1colocated-tp2`) is compared with the engine across its devices.
"""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from baton.benchmarks.datasets import ServeRequest
from baton.engine.config import EngineConfig

# worker flags that mean the same to `baton bench offline` (a switch: no value)
ENGINE_FLAGS = {"--block-size": True, "--max-num-seqs": True, "--max-num-batched-tokens": True,
                "--max-model-len": True, "--num-kv-blocks": True, "--gpu-memory-utilization": True, "--dtype": True,
                "--tokenizer": True, "--enforce-eager": False, "--async-scheduling": False,
                "--no-async-scheduling": False, "--no-prefix-caching": False, "--deterministic": False,
                "--speculative-method": True, "--num-speculative-tokens": True, "--speculative-max-batch": True,
                "--quantization": True, "--kv-cache-dtype": True, "--prefill-graphs": False,
                "--no-prefill-graphs": False,
                # a tensor- or expert-parallel worker's engine runs offline across the same devices
                "--tp-size": True, "--tp-devices": True, "--all-reduce": True, "--enable-expert-parallel": False,
                "--expert-parallel-dispatch": True, "--ep-redundant-experts": True, "--ep-expert-load": True}
TIMEOUT_S = 1800


def engine_flags(worker_args: str, max_concurrency: int | None) -> list[str]:
    """The served workers' engine settings as offline flags, with the concurrency cap applied."""
    words, out, i = shlex.split(worker_args or ""), [], 0
    while i < len(words):
        takes_value = ENGINE_FLAGS.get(words[i])
        if takes_value is not None:
            out += words[i:i + 1 + takes_value]
        i += 1 + bool(takes_value)
    if max_concurrency:
        seqs = int(out[out.index("--max-num-seqs") + 1]) if "--max-num-seqs" in out else EngineConfig().max_num_seqs
        out = _without(out, "--max-num-seqs") + ["--max-num-seqs", str(min(seqs, max_concurrency))]
    return out


def _without(words: list[str], flag: str) -> list[str]:
    if flag not in words:
        return words
    at = words.index(flag)
    return words[:at] + words[at + 2:]


def run_offline(model: str, device: str, requests: list[ServeRequest], temperature: float, flags: list[str],
                log: Path) -> dict:
    """B1 on these requests (token-id prompts only); its results dict."""
    if any(r.prompt_ids is None for r in requests):
        raise ValueError("--offline-baseline needs token-id prompts (the random, prefill-heavy, decode-heavy and "
                         "shared-prefix datasets), not a text JSONL")
    with tempfile.TemporaryDirectory(prefix="baton-baseline-") as tmp:
        workload, out = Path(tmp) / "requests.json", Path(tmp) / "offline.json"
        workload.write_text(json.dumps({"prompts": [r.prompt_ids for r in requests],
                                        "output_lens": [r.max_tokens for r in requests]}))
        cmd = [sys.executable, "-m", "baton", "bench", "offline", "--model", model, "--device", device,
               "--requests", str(workload), "--temperature", str(temperature), *flags, "--output", str(out)]
        print(f"[bench] offline baseline: {shlex.join(cmd[2:])}", file=sys.stderr, flush=True)
        with open(log, "wb") as f:
            done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=TIMEOUT_S)
        if done.returncode:
            raise RuntimeError(f"the offline baseline failed (exit {done.returncode}); its log: {log}")
        return json.loads(out.read_text())["results"]


def compare(point: dict, offline: dict) -> dict:
    """Served against offline, for one rate's point (same requests). TPOT is compared twice: with
    the offline decode step (the most a stream can get; every prefill step a request waits through
    counts against it) and with the offline run's own TPOT, per request as a client would compute it
    (the same prefills in it: what serving adds, alone)."""
    step = offline["steps"]["decode_seconds"].get("p50")
    offline_tpot = (offline.get("tpot_s") or {}).get("p50")
    tpot = point["tpot_s"].get("p50")
    return {"output_tokens_per_s": offline["output_tokens_per_s"], "wall_seconds": offline["wall_seconds"],
            "decode_step_s": offline["steps"]["decode_seconds"], "tpot_s": offline.get("tpot_s"),
            "served_over_offline": point["output_throughput"] / offline["output_tokens_per_s"],
            "tpot_p50_over_decode_step_p50": tpot / step if tpot and step else None,
            "tpot_p50_over_offline_tpot_p50": tpot / offline_tpot if tpot and offline_tpot else None}
