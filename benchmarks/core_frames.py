"""Host time of one engine step's frame to the worker's front (serving/worker/core_protocol.py):
N requests' TokenUpdates, built, pickled and unpickled, as the engine thread and the front do.

    python -m baton.benchmarks.core_frames [--updates 256] [--frames 2000]

Prints µs per frame for each part, and the same fields as bare tuples for reference (the wire
before it was typed): what the named records cost on top.
"""
from __future__ import annotations

import argparse
import json
import pickle
import time
import uuid
from collections.abc import Callable

from baton.serving.worker.core_protocol import CoreStats, TokenUpdate, Updates

STATS = CoreStats(256, 3, 10_000, 4_000)
METRICS = [("step_seconds", ("step",), 0.012)]
ROUNDS = 7                    # the best of these; both variants each round (a shared host's noise only adds)


def timed_us(fn: Callable[[], object], frames: int) -> float:
    t0 = time.perf_counter()
    for _ in range(frames):
        fn()
    return (time.perf_counter() - t0) / frames * 1e6


def parts(build: Callable[[], object]) -> dict[str, Callable[[], object]]:
    """What one frame costs: building its message, pickling it (the core), unpickling it (the front)."""
    message = build()
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return {"build_us": build, "pickle_us": lambda: pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL),
            "unpickle_us": lambda: pickle.loads(data)}


def measure(builds: dict[str, Callable[[], object]], frames: int) -> dict[str, dict[str, float]]:
    """µs per frame of each part of each variant, the best of ROUNDS rounds that time them all."""
    variants = {name: parts(build) for name, build in builds.items()}
    best = {name: dict.fromkeys(fns, float("inf")) for name, fns in variants.items()}
    for _ in range(ROUNDS):
        for name, fns in variants.items():
            for part, fn in fns.items():
                best[name][part] = min(best[name][part], timed_us(fn, frames))
    return {name: {**{k: round(v, 1) for k, v in b.items()},
                   "pickle_unpickle_us": round(b["pickle_us"] + b["unpickle_us"], 1),
                   "bytes": len(pickle.dumps(builds[name](), protocol=pickle.HIGHEST_PROTOCOL))}
            for name, b in best.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--updates", type=int, default=256, help="requests in the step")
    p.add_argument("--frames", type=int, default=2000, help="frames per timed run")
    args = p.parse_args(argv)
    rids = [f"cmpl-{uuid.uuid4().hex}" for _ in range(args.updates)]
    out = measure({"typed": lambda: Updates([TokenUpdate(r, [1234]) for r in rids], STATS, METRICS),
                   "bare_tuples": lambda: ("updates", [(r, [1234], None, 0, None, 0.0) for r in rids], STATS,
                                           METRICS)}, args.frames)
    ratio = round(out["typed"]["pickle_unpickle_us"] / out["bare_tuples"]["pickle_unpickle_us"], 2)
    print(json.dumps({"updates": args.updates, **out, "pickle_unpickle_ratio": ratio}, indent=2))


if __name__ == "__main__":
    main()
