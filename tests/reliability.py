"""What the reliability suite counts, and the report it writes from one run.

Every scenario sends real requests and classifies each outcome: completed with the known
greedy answer, completed with a wrong answer (corruption: must be 0), ended with a gRPC
status (which one), or lost (no terminal status within its deadline plus slack: must be 0).
Scenarios `record` these counts with their own figures (leaked blocks, peak memory, bad
inputs tried); at the end of the session the report goes to `.reliability/` (or
$BATON_RELIABILITY_DIR) as JSON and as the markdown table docs/reliability.md quotes.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import fcntl
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

LOST_SLACK_S = 10.0


@dataclass
class Outcomes:
    sent: int = 0
    completed: int = 0
    wrong: int = 0
    lost: int = 0
    statuses: collections.Counter = field(default_factory=collections.Counter)
    slowest_s: float = 0.0
    over_deadline: int = 0              # ended later than the deadline the client gave
    details: dict = field(default_factory=dict)     # status -> the first message seen with it

    def add(self, result, expected: list[int] | None, seconds: float, deadline: float) -> None:
        self.sent += 1
        self.slowest_s = max(self.slowest_s, seconds)
        if seconds > deadline + 2.0:
            self.over_deadline += 1
        if result is None:
            self.lost += 1
        elif isinstance(result, grpc.RpcError):
            self.statuses[result.code().name] += 1
            self.details.setdefault(result.code().name, result.details())
        else:
            self.completed += 1
            if expected is not None and result != expected:
                self.wrong += 1

    def merge(self, other: Outcomes) -> None:
        self.sent += other.sent
        self.completed += other.completed
        self.wrong += other.wrong
        self.lost += other.lost
        self.statuses.update(other.statuses)
        self.details = {**other.details, **self.details}
        self.slowest_s = max(self.slowest_s, other.slowest_s)
        self.over_deadline += other.over_deadline

    def summary(self) -> dict:
        return {"sent": self.sent, "completed": self.completed, "wrong": self.wrong, "lost": self.lost,
                "statuses": dict(self.statuses), "slowest_s": round(self.slowest_s, 2),
                "over_deadline": self.over_deadline}

    def assert_clean(self) -> None:
        """Nothing lost, nothing corrupted, nothing outlived its deadline."""
        assert self.lost == 0 and self.wrong == 0 and self.over_deadline == 0, self.summary()


def stream_ids(stub, req, timeout: float, metadata=None, progress: list | None = None) -> list[int]:
    """The stream's token ids; `progress` ([tokens so far, longest gap between chunks in s])
    is kept current for whoever watches."""
    ids: list[int] = []
    last = time.monotonic()
    for resp in stub.Generate(req, timeout=timeout, metadata=metadata):
        ids += resp.token_ids
        if progress is not None:
            now = time.monotonic()
            if ids[len(resp.token_ids):]:          # gaps between chunks, not the wait for the first
                progress[1] = max(progress[1], now - last)
            progress[0], last = len(ids), now
    return ids


class Load:
    """Requests in flight on a thread pool, each with its deadline; `wait` classifies them."""

    def __init__(self, stub, workers: int = 16):
        self.stub = stub
        self.pool = cf.ThreadPoolExecutor(workers)
        self.items: list[tuple[cf.Future, list[int] | None, float]] = []
        self.progress: list[list] = []          # per request: [tokens received, longest gap (s)]

    def submit(self, req, expected: list[int] | None, deadline: float) -> None:
        progress = [0, 0.0]
        self.progress.append(progress)

        def run():
            t0 = time.monotonic()
            try:
                result = stream_ids(self.stub, req, deadline, progress=progress)
            except grpc.RpcError as exc:
                result = exc
            return result, time.monotonic() - t0
        self.items.append((self.pool.submit(run), expected, deadline))

    def wait_streaming(self, min_tokens: int, timeout: float = 60.0) -> None:
        """Until every request has streamed at least `min_tokens` tokens (or ended)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(p[0] >= min_tokens or f.done() for p, (f, _, _) in zip(self.progress, self.items, strict=True)):
                return
            time.sleep(0.02)
        raise AssertionError(f"streams did not get going: {[p[0] for p in self.progress]}")

    @property
    def longest_gap_s(self) -> float:
        """The longest a stream waited between two chunks: a migration's stall, as the client sees it."""
        return max((p[1] for p in self.progress), default=0.0)

    def wait(self) -> Outcomes:
        out = Outcomes()
        for fut, expected, deadline in self.items:
            try:
                result, seconds = fut.result(timeout=deadline + LOST_SLACK_S)
            except cf.TimeoutError:
                result, seconds = None, deadline + LOST_SLACK_S
            out.add(result, expected, seconds, deadline)
        self.pool.shutdown(wait=False, cancel_futures=True)
        return out


class Report:
    def __init__(self):
        self.scenarios: dict[str, dict] = {}
        self.started = time.strftime("%Y-%m-%d %H:%M:%S")

    def record(self, scenario: str, outcomes: Outcomes | None = None, **figures) -> None:
        entry = self.scenarios.setdefault(scenario, {})
        if outcomes is not None:
            entry.update(outcomes.summary())
        entry.update(figures)

    def write(self) -> Path | None:
        """Under pytest-xdist every worker has its own Report: each merges what the run's other
        workers wrote already (same run id), under a lock, so the files hold the whole run."""
        if not self.scenarios:
            return None
        out = Path(os.environ.get("BATON_RELIABILITY_DIR", Path(__file__).resolve().parent.parent / ".reliability"))
        out.mkdir(parents=True, exist_ok=True)
        run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
        with open(out / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                earlier = json.loads((out / "report.json").read_text())
            except (OSError, ValueError):
                earlier = {}
            if run is not None and earlier.get("run") == run:
                self.scenarios = {**earlier["scenarios"], **self.scenarios}
                self.started = min(self.started, earlier["started"])
            (out / "report.json").write_text(json.dumps({"started": self.started, "run": run,
                                                         "scenarios": self.scenarios}, indent=2, sort_keys=True))
            (out / "report.md").write_text(self.markdown())
        return out

    def markdown(self) -> str:
        lines = [f"Run started {self.started}.", "",
                 "| scenario | sent | completed (correct) | ended with status | lost | leaked blocks | figures |",
                 "| --- | ---: | ---: | --- | ---: | ---: | --- |"]
        for name, e in self.scenarios.items():
            statuses = ", ".join(f"{k} {v}" for k, v in sorted(e.get("statuses", {}).items())) or "-"
            correct = e.get("completed", 0) - e.get("wrong", 0)
            skip = {"sent", "completed", "wrong", "lost", "statuses", "leaked_blocks"}
            figures = "; ".join(f"{k} {v}" for k, v in e.items() if k not in skip)
            lines.append(f"| {name} | {e.get('sent', '-')} | {e.get('completed', '-')} ({correct}) | {statuses} | "
                         f"{e.get('lost', '-')} | {e.get('leaked_blocks', '-')} | {figures} |")
        return "\n".join(lines) + "\n"
