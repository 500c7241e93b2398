"""Parsers of the flags several benchmarks share (bench serve, baton plan): comma lists, SLO
targets in milliseconds, length ranges given for every dataset or per dataset by name."""
from __future__ import annotations

import math

from baton.benchmarks import datasets
from baton.serving.options import flag


def split(spec: str) -> list[str]:
    """"a, b,,c" -> ["a", "b", "c"]."""
    return [s.strip() for s in (spec or "").split(",") if s.strip()]


def parse_slos(spec: str, flag: str = "--slo-tpot-ms") -> list[float]:
    try:
        slos = [float(s) for s in str(spec).split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"bad {flag} {spec!r}: use milliseconds, e.g. 25 or 10,15,25,50") from None
    if not slos or any(not s > 0 or math.isinf(s) for s in slos):
        raise ValueError(f"bad {flag} {spec!r}: every SLO must be a finite number of ms > 0")
    return slos


def parse_lengths(spec: str | None, dataset: str, flag: str) -> tuple[int, int] | None:
    """'128:1024' (every dataset) or 'mixed=32:4096,decode-heavy=32:128' (by name) -> this
    dataset's range, None where the spec leaves it to the default."""
    if not spec:
        return None
    if "=" not in spec:
        return datasets.parse_range(spec)
    by_name = {}
    for item in split(spec):
        name, eq, rng = item.partition("=")
        if not eq:
            raise ValueError(f"bad {flag} {spec!r}: use MIN:MAX, or NAME=MIN:MAX,NAME=MIN:MAX")
        by_name[name.strip()] = datasets.parse_range(rng.strip())
    return by_name.get(dataset)


def tokenizer(parser, presets: bool = True) -> None:
    """`--tokenizer` (and its BATON_TOKENIZER twin) as every benchmark that loads a model takes it."""
    flag(parser, "--tokenizer", help="tokenizer directory (unset: the model's"
                                     + ("; presets: the embedded model's)" if presets else ")"))
