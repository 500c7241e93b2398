"""What a dropped offline `LLM` gives back: make an LLM, generate, drop it, several times over in one
process, and print the device's (or the process's) memory after each. Before the fix in
`engine/llm.py` (`LLM.__del__`) every dropped LLM kept its weights, KV cache and graphs for the
process's life: `gc.freeze()` at start-up put the engine's reference cycles out of the collector's
reach.

    python -m baton.benchmarks.llm_release --model qwen3-0.6b --device cuda:0 --rounds 3
    python -m baton.benchmarks.llm_release --rounds 3                  # CPU, the embedded model
"""
from __future__ import annotations

import argparse
import json
import time

from baton.benchmarks import flags


def used_gib(device: str) -> dict:
    """The device's memory in use (free / total as the driver says, and torch's own count), or the
    process's anonymous resident memory on the CPU."""
    import torch
    if device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info(torch.device(device))
        return {"device_used_gib": round((total - free) / 2**30, 3),
                "torch_allocated_gib": round(torch.cuda.memory_allocated(device) / 2**30, 3)}
    with open("/proc/self/status") as f:
        anon = next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))
    return {"rss_anon_gib": round(anon / 2**20, 3)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m baton.benchmarks.llm_release", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--device", default="cpu")
    flags.tokenizer(p)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output", default=None, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    from baton import LLM, SamplingParams
    rows = [{"when": "start", **used_gib(args.device)}]
    for i in range(args.rounds):
        t0 = time.perf_counter()
        llm = LLM(args.model, device=args.device, tokenizer=args.tokenizer)
        llm.generate(["Hello there"] * 4, SamplingParams(max_tokens=16, ignore_eos=True))
        rows.append({"when": f"round {i}: made, generated", "seconds": round(time.perf_counter() - t0, 2),
                     **used_gib(args.device)})
        t0 = time.perf_counter()
        del llm
        rows.append({"when": f"round {i}: dropped", "seconds": round(time.perf_counter() - t0, 2),
                     **used_gib(args.device)})
    for row in rows:
        print(json.dumps(row), flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
