"""A short profile of one device through Baton's engine, for the planner: prefill time against
prompt length and batch, decode step time against batch and context, and mixed steps (a decode
batch plus a prompt chunk, what colocated workers run), each measurement the wall time of the
engine's own steps with the shapes its scheduler made, fitted into a StepCost. Saved as JSON
so one GPU run profiles once and every later plan reads it.
"""
from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from baton.benchmarks import record
from baton.benchmarks.model_shape import DTYPE_BYTES, shape_of
from baton.benchmarks.roofline import StepShape
from baton.benchmarks.step_cost import StepCost, features

SCHEMA = "baton.profile/v1"


@dataclass(frozen=True, slots=True)
class Grid:
    """What to measure: prefill (prompt length, batch), decode (batch, context), mixed (decode
    batch, context, prompt tokens added each step); decode and mixed points time `steps` steps."""
    prefill: tuple[tuple[int, int], ...]
    decode: tuple[tuple[int, int], ...]
    mixed: tuple[tuple[int, int, int], ...]
    steps: int


# an accelerator: a minute or so of measurement after the engine is up
ACCEL_GRID = Grid(prefill=((128, 16), (512, 4), (1024, 2), (2048, 2), (4096, 1), (8192, 1)),
                  decode=tuple((b, c) for c in (512, 2048) for b in (1, 16, 64, 128, 256)),
                  mixed=((16, 512, 512), (64, 1024, 2048), (128, 512, 1024)), steps=16)
# the CPU: seconds on the embedded model, enough for a line through each kind of step
CPU_GRID = Grid(prefill=((16, 4), (64, 2), (192, 1), (256, 2)), decode=((1, 32), (4, 32), (8, 128), (16, 64)),
                mixed=((4, 32, 48), (8, 64, 96)), steps=4)


@dataclass(slots=True)
class Profile:
    model: str
    device: str
    engine: dict                        # the engine settings measured under, and its KV capacity
    shape: dict                         # the model's (ModelShape.to_json)
    kv_bytes_per_token: int
    weight_bytes: int
    rows: list[dict] = field(default_factory=list)    # {"kind", "point", "features", "seconds"}
    cost: StepCost | None = None
    seconds: float = 0.0                # how long profiling took, engine start included
    device_name: str | None = None
    cached: bool = False                # read from a file, not measured in this run

    def fit(self) -> StepCost:
        self.cost = StepCost.fit([(r["features"], r["seconds"]) for r in self.rows])
        return self.cost

    def to_json(self) -> dict:
        errs = self.cost.relative_errors([(r["features"], r["seconds"]) for r in self.rows]) if self.cost else []
        return {"schema": SCHEMA, "model": self.model, "device": self.device, "device_name": self.device_name,
                "engine": self.engine, "shape": self.shape, "kv_bytes_per_token": self.kv_bytes_per_token,
                "weight_bytes": self.weight_bytes, "seconds": self.seconds, "created_at": record.now_iso(),
                "git": record.git_info(), "cost": self.cost.to_json() if self.cost else None,
                "fit_error": {"median": sorted(errs)[len(errs) // 2] if errs else None,
                              "max": max(errs) if errs else None},
                "rows": self.rows}

    @classmethod
    def from_json(cls, d: dict) -> Profile:
        if d.get("schema") != SCHEMA:
            raise ValueError(f"not a Baton device profile (schema {d.get('schema')!r}, want {SCHEMA!r}): "
                             "write one with `baton plan --profile FILE`")
        return cls(d["model"], d["device"], d["engine"], d["shape"], d["kv_bytes_per_token"], d["weight_bytes"],
                   d["rows"], StepCost.from_json(d["cost"]), d.get("seconds", 0.0), d.get("device_name"), cached=True)

    def matches(self, model: str, device: str, engine: dict) -> bool:
        """Was this profile measured for this model, device kind and engine settings?"""
        kind = device.split(":")[0]
        return self.model == model and self.device.split(":")[0] == kind and \
            all(self.engine.get(k) == v for k, v in engine.items())


def default_path(model: str, device: str, cache_dir: str | None = None) -> Path:
    """Where a profile of `model` on this kind of device is kept: <cache dir>/profiles/."""
    from baton.models.cache import cache_root
    return cache_root(cache_dir) / "profiles" / f"{Path(str(model)).name}-{device.split(':')[0]}.json"


def load_or_measure(path: str | None, model: str, device: str, engine: dict, grid: Grid | None = None,
                    refresh: bool = False) -> Profile:
    """The cached profile at `path` when it matches, else a new one (written there)."""
    if path and Path(path).is_file() and not refresh:
        prof = Profile.from_json(json.loads(Path(path).read_text()))
        if prof.matches(model, device, engine):
            print(f"[plan] profile of {prof.model} on {prof.device} from {path}", file=sys.stderr, flush=True)
            return prof
        print(f"[plan] {path} was measured for {prof.model} on {prof.device} with {prof.engine}: measuring again",
              file=sys.stderr, flush=True)
    prof = measure(model, device, engine, grid)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(prof.to_json(), indent=1) + "\n")
    return prof


def measure(model: str, device: str, engine_settings: dict, grid: Grid | None = None) -> Profile:
    """Start the engine on `device` and time the grid's points."""
    from baton.engine import LLMEngine
    from baton.engine.config import EngineConfig

    t0 = time.perf_counter()
    grid = grid or (CPU_GRID if device == "cpu" else ACCEL_GRID)
    print(f"[plan] profiling {model} on {device}{' (the CPU: slow, small shapes)' if device == 'cpu' else ''} ...",
          file=sys.stderr, flush=True)
    engine = LLMEngine(EngineConfig(model=model, device=device, **engine_settings))
    shape = shape_of(model)
    dtype = str(engine.runner.dtype).removeprefix("torch.")
    prof = Profile(model, device, dict(engine_settings) | _capacity(engine), shape.to_json(),
                   shape.kv_bytes_per_token(DTYPE_BYTES.get(dtype, 2)), shape.params * DTYPE_BYTES.get(dtype, 2),
                   device_name=record.device_info([device])["name"])
    prof.engine["dtype"] = dtype
    session = _Session(engine, device)
    session.prefill(64, 1)                     # warm-up: every kernel on the prefill and decode paths
    session.decode(2, 64, 2)
    for length, batch in grid.prefill:
        if length < prof.engine["max_model_len"]:
            prof.rows.append(session.prefill(length, batch))
    for batch, context in grid.decode:
        if batch <= prof.engine["max_num_seqs"] and context < prof.engine["max_model_len"] - 4 * grid.steps:
            prof.rows.append(session.decode(batch, context, grid.steps))
    for batch, context, tokens in grid.mixed:
        if batch < prof.engine["max_num_seqs"] and tokens + batch <= prof.engine["max_num_batched_tokens"]:
            prof.rows.append(session.mixed(batch, context, tokens, grid.steps))
    prof.fit()
    prof.seconds = time.perf_counter() - t0
    errs = prof.cost.relative_errors([(r["features"], r["seconds"]) for r in prof.rows])
    print(f"[plan] profiled {len(prof.rows)} points in {prof.seconds:.0f}s; the step-cost line fits them to "
          f"{100 * sorted(errs)[len(errs) // 2]:.0f} % (median), {100 * max(errs):.0f} % (worst)",
          file=sys.stderr, flush=True)
    return prof


def _capacity(engine) -> dict:
    c = engine.config
    return {"max_num_seqs": c.max_num_seqs, "max_num_batched_tokens": c.max_num_batched_tokens,
            "block_size": c.block_size, "kv_blocks": engine.runner.num_blocks,
            "kv_capacity_tokens": engine.runner.num_blocks * c.block_size, "max_model_len": engine.max_model_len}


class _Session:
    """Times engine steps: every step the scheduler makes is recorded with its shape, and a
    measurement is the wall time of a run of steps, the device synchronized at both ends."""

    def __init__(self, engine, device: str):
        self.engine, self.device = engine, device
        self.rng = random.Random(0)
        self.shapes: list[StepShape] = []
        scheduler = engine.scheduler
        schedule = scheduler.schedule

        def recorded(*args, **kwargs):
            out = schedule(*args, **kwargs)
            if out is not None and not out.is_empty:
                self.shapes.append(StepShape([(s.seq.num_computed_tokens, s.num_new_tokens) for s in out.scheduled],
                                             sum(s.samples for s in out.scheduled)))
            return out
        scheduler.schedule = recorded

    def _prompt(self, n: int) -> list[int]:
        top = min(10_000, self.engine.vocab_size - 1)
        return [self.rng.randint(0, top) for _ in range(n)]

    def _params(self, max_tokens: int):
        from baton.engine import SamplingParams
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def _sync(self) -> None:
        if self.device != "cpu":
            import torch
            getattr(torch, self.device.split(":")[0]).synchronize(self.device)

    def _timed(self, run) -> tuple[list[float], float]:
        self._sync()
        self.shapes.clear()
        t0 = time.perf_counter()
        run()
        self._sync()
        seconds = time.perf_counter() - t0
        return [sum(col) for col in zip(*(features(s) for s in self.shapes), strict=True)], seconds

    def _drain(self) -> None:
        while self.engine.has_work:
            self.engine.step()

    def prefill(self, length: int, batch: int) -> dict:
        """`batch` prompts of `length` tokens, each done after its first token: pure prefill."""
        for _ in range(batch):
            self.engine.add_request(self._prompt(length), self._params(1))
        feats, seconds = self._timed(self._drain)
        return {"kind": "prefill", "point": {"prompt_len": length, "batch": batch}, "features": feats,
                "seconds": seconds, "steps": len(self.shapes)}

    def _start_batch(self, batch: int, context: int, max_tokens: int) -> list[str]:
        """`batch` sequences decoding at about `context` tokens; their shared prefix is prefilled
        once (the prefix cache), so a batch of long contexts costs little to set up."""
        prefix = self._prompt(max(0, context - 16))
        self.engine.add_request(prefix + self._prompt(1), self._params(1))
        self._drain()
        ids = [self.engine.add_request(prefix + self._prompt(context - len(prefix)), self._params(max_tokens))
               for _ in range(batch)]
        sched = self.engine.scheduler
        while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
            self.engine.step()
        for _ in range(2):
            self.engine.step()
        return ids

    def _stop(self, ids: list[str]) -> None:
        for rid in ids:
            self.engine.abort(rid)
        self._drain()

    def decode(self, batch: int, context: int, steps: int) -> dict:
        ids = self._start_batch(batch, context, 2 * steps + 8)
        feats, seconds = self._timed(lambda: [self.engine.step() for _ in range(steps)])
        self._stop(ids)
        return {"kind": "decode", "point": {"batch": batch, "context": context}, "features": feats,
                "seconds": seconds, "steps": len(self.shapes)}

    def mixed(self, batch: int, context: int, tokens: int, steps: int) -> dict:
        """The decode batch, and a fresh `tokens`-token prompt arriving before each step."""
        ids = self._start_batch(batch, context, 2 * steps + 8)

        def run() -> None:
            for _ in range(steps):
                self.engine.add_request(self._prompt(tokens), self._params(1))
                self.engine.step()
        feats, seconds = self._timed(run)
        self._stop(ids)
        return {"kind": "mixed", "point": {"batch": batch, "context": context, "prompt_tokens": tokens},
                "features": feats, "seconds": seconds, "steps": len(self.shapes)}
