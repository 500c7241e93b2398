"""Single-stream and 16-stream generation speed on the CPU: Baton vs transformers.generate,
same weights, same machine, one run (the foundation's CPU speed check).

    python -m baton.benchmarks.cpu_decode [--model smollm2-135m-instruct] [--new-tokens 64] [--threads 2]

Prompts: random token ids of --prompt-len tokens (equal lengths, so transformers needs no
padding); greedy; ignore EOS. Reported: new tokens / wall time, median of --repeats runs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from baton.engine import LLM, SamplingParams


def baton_rate(llm: LLM, prompts: list[list[int]], n: int) -> float:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


def hf_rate(model, prompts: list[list[int]], n: int) -> float:
    x = torch.tensor(prompts)
    t0 = time.perf_counter()
    with torch.no_grad():
        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
    return (y.shape[1] - x.shape[1]) * len(prompts) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM
    llm = LLM(args.model)
    hf = AutoModelForCausalLM.from_pretrained(llm.engine.source.weights_path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    result = {"model": args.model, "threads": args.threads, "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens}
    for streams in (1, 16):
        prompts = [torch.randint(100, 40000, (args.prompt_len,), generator=g).tolist() for _ in range(streams)]
        baton_rate(llm, prompts, 4)                       # warm-up
        hf_rate(hf, prompts, 4)
        result[f"baton_{streams}_tok_s"] = statistics.median(
            baton_rate(llm, prompts, args.new_tokens) for _ in range(args.repeats))
        result[f"transformers_{streams}_tok_s"] = statistics.median(
            hf_rate(hf, prompts, args.new_tokens) for _ in range(args.repeats))
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
