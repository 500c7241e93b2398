"""B2's request sets: synthetic token-id prompts of chosen shapes, or a JSONL file.

random          input/output lengths uniform in --input-len / --output-len
prefill-heavy   long prompts, short outputs
decode-heavy    short prompts, long outputs
mixed           long-tailed: lognormal prompt and output lengths (MIXED_SHAPE), clipped to
                --input-len / --output-len: most requests short, a few very long ones
shared-prefix   groups of --group-size requests sharing a --prefix-len system prompt,
                each with its own suffix (--input-len) — what prefix caching should catch
long-8k         one long prompt's cost: 8,192-token prompts, 8 output tokens (TTFT and its stages
long-32k        are the figure: run them one at a time, --max-concurrency 1); 32,768 tokens;
long-128k       131,064 tokens, a 131,072-token context with the output (--max-model-len 131072 and a
                model that reaches it, e.g. qwen3-8b-yarn)
*.jsonl         one {"prompt": str, "max_tokens": int} per line (or "prompt_token_ids")

Synthetic prompts are random token ids (sent pre-tokenized), so lengths are exact.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

MAX_TOKEN_ID = 10000              # as nano-vllm: ordinary ids, away from special tokens at the top

# (input range, output range) per dataset; shared-prefix's input range is its unique suffix
LENGTHS = {
    "random": ((128, 1024), (64, 256)),
    "prefill-heavy": ((1024, 2048), (8, 32)),
    "decode-heavy": ((32, 128), (256, 1024)),
    "shared-prefix": ((32, 128), (64, 256)),
    "mixed": ((32, 4096), (8, 384)),
    "long-8k": ((8192, 8192), (8, 8)),
    "long-32k": ((32768, 32768), (8, 8)),
    "long-128k": ((131064, 131064), (8, 8)),
}
# mixed: (median, sigma of the log) of prompt and output lengths. Public chat and API traces show
# right-skewed lengths, near lognormal: most prompts and answers short, a tail of long ones that
# dominates the work. sigma 1.0 puts p90 at 3.6x and p99 at 10x the median prompt (the clip at
# 4096 holds under 2 %); sigma 0.8 puts p90 at 2.8x the median output, and under 5 % at the 384
# clip, which also bounds how long a request can run (and so how long a goodput probe must be).
MIXED_SHAPE = {"input": (512, 1.0), "output": (96, 0.8)}
SMOKE_LENGTHS = ((8, 32), (4, 8))
DEFAULT_PREFIX_LEN = 1024
SMOKE_PREFIX_LEN = 32


@dataclass(slots=True)
class ServeRequest:
    max_tokens: int
    prompt_ids: list[int] | None = None       # pre-tokenized (synthetic sets)
    text: str | None = None                   # raw text (JSONL), tokenized by the router
    group: int | None = None                  # shared-prefix group


def parse_range(spec: str) -> tuple[int, int]:
    """"128:1024" -> (128, 1024); "256" -> (256, 256)."""
    lo, _, hi = spec.partition(":")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"bad length range {spec!r}: use N or MIN:MAX") from None
    if not 1 <= a <= b:
        raise ValueError(f"bad length range {spec!r}: need 1 <= MIN <= MAX")
    return a, b


def build_requests(dataset: str, num: int, seed: int, input_len: tuple[int, int], output_len: tuple[int, int],
                   max_model_len: int, vocab_size: int, prefix_len: int = DEFAULT_PREFIX_LEN,
                   group_size: int = 8, salt: int = 0) -> list[ServeRequest]:
    """`num` requests of `dataset`, drawn from `seed`. `salt` > 0: the same lengths and groups with other token
    ids, for a second pass over a deployment that must not find the first pass's prompts in its prefix cache (a
    JSONL file's prompts are what they are: the same at any salt)."""
    if num < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num}")
    if dataset.endswith(".jsonl"):
        return _jsonl(Path(dataset), num)
    if dataset not in LENGTHS:
        raise ValueError(f"unknown dataset {dataset!r}: use {', '.join(LENGTHS)} or a .jsonl file")
    rng = random.Random(seed)
    salted = random.Random(f"{seed}/{salt}") if salt else None
    top = min(MAX_TOKEN_ID, vocab_size - 1)

    def token_ids(n: int) -> list[int]:
        ids = [rng.randint(0, top) for _ in range(n)]          # (drawn at any salt: the lengths stay the same)
        return [salted.randint(0, top) for _ in range(n)] if salted else ids

    prefix = prefix_len if dataset == "shared-prefix" else 0
    _check_fits(prefix, input_len, output_len, max_model_len)
    out, prefixes = [], {}
    for i in range(num):
        group = i // group_size if prefix else None
        if group is not None and group not in prefixes:
            prefixes[group] = token_ids(prefix)
        n_in, n_out = draw_lengths(dataset, rng, input_len, output_len)
        ids = prefixes.get(group, []) + token_ids(n_in)
        ids = ids[:max_model_len - 1]
        out.append(ServeRequest(max(1, min(n_out, max_model_len - len(ids))), ids, None, group))
    return out


def _check_fits(prefix: int, input_len: tuple[int, int], output_len: tuple[int, int], max_model_len: int) -> None:
    if prefix + input_len[0] + output_len[0] > max_model_len:
        raise ValueError(f"the shortest request ({prefix + input_len[0]} prompt + {output_len[0]} output tokens) "
                         f"does not fit max_model_len {max_model_len}: shorten --input-len/--output-len")


def draw_lengths(dataset: str, rng: random.Random, input_len: tuple[int, int],
                 output_len: tuple[int, int]) -> tuple[int, int]:
    """One request's (prompt tokens, output tokens) as the dataset draws them (the suffix, for
    shared-prefix)."""
    if dataset == "mixed":
        return (_lognormal(rng, *MIXED_SHAPE["input"], input_len),
                _lognormal(rng, *MIXED_SHAPE["output"], output_len))
    return rng.randint(*input_len), rng.randint(*output_len)


def _lognormal(rng: random.Random, median: float, sigma: float, bounds: tuple[int, int]) -> int:
    """A lognormal draw clipped to bounds; a median outside them (smoke ranges) moves to the
    bounds' geometric middle, so the shape survives a shorter range."""
    lo, hi = bounds
    if not lo <= median <= hi:
        median = math.sqrt(lo * hi)
    return max(lo, min(hi, round(rng.lognormvariate(math.log(median), sigma))))


def sample_lengths(dataset: str, num: int, seed: int, input_len: tuple[int, int], output_len: tuple[int, int],
                   max_model_len: int, prefix_len: int = DEFAULT_PREFIX_LEN) -> list[tuple[int, int]]:
    """(prompt, output) lengths of `num` requests of a dataset, without building prompts: what the
    planner models. A JSONL file gives its rows' lengths (rows need "prompt_token_ids"), cycled."""
    if dataset.endswith(".jsonl"):
        return _jsonl_lengths(Path(dataset), num)
    if dataset not in LENGTHS:
        raise ValueError(f"unknown dataset {dataset!r}: use {', '.join(LENGTHS)} or a .jsonl file")
    prefix = prefix_len if dataset == "shared-prefix" else 0
    _check_fits(prefix, input_len, output_len, max_model_len)
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        n_in, n_out = draw_lengths(dataset, rng, input_len, output_len)
        n_in = min(prefix + n_in, max_model_len - 1)
        out.append((n_in, max(1, min(n_out, max_model_len - n_in))))
    return out


def _jsonl_lengths(path: Path, num: int) -> list[tuple[int, int]]:
    rows = []
    for r in _jsonl(path, num):
        if r.prompt_ids is None:
            raise ValueError(f"{path}: the planner needs token counts: give each row \"prompt_token_ids\" "
                             "(or use a synthetic dataset)")
        rows.append((len(r.prompt_ids), r.max_tokens))
    return rows


def _jsonl(path: Path, num: int) -> list[ServeRequest]:
    if not path.is_file():
        raise ValueError(f"dataset file {path} does not exist")
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            max_tokens = int(row.get("max_tokens", 256))
            if "prompt_token_ids" in row:
                rows.append(ServeRequest(max_tokens, [int(t) for t in row["prompt_token_ids"]]))
            else:
                rows.append(ServeRequest(max_tokens, text=str(row["prompt"])))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{lineno}: want {{\"prompt\": str, \"max_tokens\": int}}: {exc}") from None
    if not rows:
        raise ValueError(f"{path} holds no requests")
    return [rows[i % len(rows)] for i in range(num)]        # cycled to --num-prompts


def describe(requests: list[ServeRequest]) -> dict:
    ins = [len(r.prompt_ids) for r in requests if r.prompt_ids is not None]
    outs = [r.max_tokens for r in requests]
    return {"num_requests": len(requests), "prompt_tokens": sum(ins) if ins else None,
            "prompt_len_range": [min(ins), max(ins)] if ins else None,
            "requested_output_tokens": sum(outs), "output_len_range": [min(outs), max(outs)]}
