"""One request's figures for the router's metrics, from arrival to its last token: queue time,
TTFT, inter-token latency, E2E, token counts, outcome, and its time stage by stage (STAGES)."""
from __future__ import annotations

import time

from baton.serving.metrics import observe_many
from baton.v1 import router_pb2


class RequestClock:
    """One request's figures for the router's metrics: queue time, TTFT, ITL, E2E, tokens, status."""

    def __init__(self, metrics, prompt_tokens: int):
        self.m, self.model = metrics, metrics.model
        self.prompt_tokens = prompt_tokens
        self.t0 = self.last = time.perf_counter()
        self.tokens = 0
        self.cached_tokens = 0                  # of the prompt, found in a prefix cache (the last chunk says)
        self.status = "unavailable"             # until it ends otherwise
        self.running = False
        self.itl = None
        self.marks: dict[str, float] = {}       # the attempt's boundaries, set by the route (STAGES)
        self.m.router_waiting.labels(self.model).inc()

    def admitted(self) -> None:
        now = time.perf_counter()
        self.marks["admitted"] = now
        self.m.queue_seconds.labels(self.model).observe(now - self.t0)
        self.m.router_waiting.labels(self.model).dec()
        self.m.router_running.labels(self.model).inc()
        self.running = True

    def sent(self, resp) -> None:
        now = time.perf_counter()
        n = len(resp.token_ids)
        if n:
            if self.tokens == 0:
                self.m.ttft.labels(self.model).observe(now - self.t0)
                self.marks["first"] = now
                self.itl = self.m.itl.labels(self.model)     # per message from here on: looked up once
                gaps = n - 1                    # tokens arriving together: zero-length intervals
                gap = 0.0
            else:
                gaps, gap = n, (now - self.last) / n
            observe_many(self.itl, gap, gaps)
            self.tokens += n
            self.last = now
        if resp.finish_reason:
            self.status = router_pb2.FinishReason.Name(resp.finish_reason).removeprefix("FINISH_REASON_").lower()
            self.cached_tokens = resp.usage.cached_prompt_tokens

    def done(self) -> None:
        m, model = self.m, self.model
        if self.running:
            m.router_running.labels(model).dec()
        else:
            m.router_waiting.labels(model).dec()
        m.requests.labels(model, self.status).inc()
        m.finished(self.prompt_tokens, self.tokens, self.cached_tokens)
        if self.status in ("stop", "length"):
            end = time.perf_counter()
            m.e2e.labels(model).observe(end - self.t0)
            for stage, seconds in stages(self.t0, self.marks, end):
                m.stage_seconds.labels(model, stage).observe(seconds)


# A finished request's time, stage by stage, on the router's clock: each stage ends where the next
# begins, so a request's stages add up to its E2E. `admit`: the decode worker's admission (and any
# attempt that failed before it); `prefill`: the prefill worker's queue, compute and KV push, until
# its answer (colocated: until the first token); `handover`: from then until the decode worker's
# first token reaches the router (the KV joined and its first step); `decode`: the rest.
STAGES = (("queue", "admitted"), ("admit", "prefill_sent"), ("prefill", "prefill_done"), ("handover", "first"),
          ("decode", None))


def stages(t0: float, marks: dict[str, float], end: float) -> list[tuple[str, float]]:
    """(stage, seconds) of the stages a request went through. The colocated path has no handover
    (its prefill ends at the first token); a boundary met late (the first token before the
    prefill's answer) is clamped so that the stages stay in order and add up to `end - t0`."""
    marks = dict(marks)
    first = marks.setdefault("first", end)
    colocated = "prefill_sent" in marks and "prefill_done" not in marks
    if colocated:
        marks["prefill_done"] = first
    out, start = [], t0
    for stage, boundary in STAGES:
        if boundary is None:
            t = end
        elif boundary not in marks:
            continue
        else:
            t = min(max(marks[boundary], start), end if boundary == "first" else first)
        if not (colocated and stage == "handover"):
            out.append((stage, t - start))
        start = t
    return out
