"""Host time the detokenizer costs per decode step: N sequences each get one token a step.

    python -m baton.benchmarks.detokenize [--sequences 256] [--steps 200]

Runs the Rust streaming path (`tokenizers.decoders.DecodeStream`) and the two-decodes-a-token
Python path on the same token streams (the embedded model's tokenizer, text with multi-byte
characters) and prints µs per token and ms per step for each.
"""
from __future__ import annotations

import argparse
import json
import time

from baton.engine.requests.detokenizer import PythonDetokenizer, make_detokenizer
from baton.engine.requests.tokenizer import load_tokenizer
from baton.models.source import resolve_model

TEXT = ("The river ran past the old mill; Zürich → 東京 is 9,600 km. def f(x): return x ** 2  # ünïcödé 🙂\n"
        * 40)


def one(make, tokenizer, streams: list[list[int]], steps: int) -> float:
    """Seconds per step for `len(streams)` sequences."""
    detoks = [make(tokenizer, s[:5]) for s in streams]
    t0 = time.perf_counter()
    for i in range(steps):
        for d, s in zip(detoks, streams, strict=True):
            d.add(s[5 + i])
    return (time.perf_counter() - t0) / steps


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sequences", type=int, default=256)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args(argv)
    tok = load_tokenizer(resolve_model("smollm2-135m-instruct"))
    ids = tok(TEXT)["input_ids"]
    streams = [ids[i % 50:] for i in range(args.sequences)]
    assert all(len(s) >= args.steps + 5 for s in streams), "TEXT too short for --steps"
    out = {}
    for name, make in (("python (two decodes a token)", PythonDetokenizer), ("DecodeStream (Rust)", make_detokenizer)):
        per_step = one(make, tok, streams, args.steps)
        out[name] = {"ms_per_step": round(per_step * 1e3, 3), "us_per_token": round(per_step / args.sequences * 1e6, 2)}
    print(json.dumps({"sequences": args.sequences, "steps": args.steps, **out}, indent=2))


if __name__ == "__main__":
    main()
