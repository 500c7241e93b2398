"""What the router says about the deployment (HTTP /health, the `baton_degraded` gauge): ok,
degraded or unavailable, and why.

Degraded: requests are served, but not as the deployment was built to serve them. A
disaggregated pool (its prefill or its decode workers) has no healthy worker while colocated
workers carry the load, so no request is disaggregated and long prompts share steps with
decoding again: TTFT and TPOT lose the split's shelter without any request failing. The health
checks (every 0.5 s) keep it current, so the word changes within a second of the pool's loss."""
from __future__ import annotations

from dataclasses import dataclass

ROLE_ORDER = ("prefill", "decode", "colocated")     # the order a request meets them


@dataclass(frozen=True, slots=True)
class Health:
    status: str            # "ok", "degraded" or "unavailable"
    reason: str = ""


def role_counts(registry) -> dict[str, int]:
    """Workers per role, in the order a request meets them."""
    counts: dict[str, int] = {}
    for w in sorted(registry.workers, key=lambda w: ROLE_ORDER.index(w.role)):
        counts[w.role] = counts.get(w.role, 0) + 1
    return counts


def disaggregated(registry) -> bool:
    """A request can take the prefill -> decode path now."""
    return bool(registry.healthy("prefill") and registry.healthy("decode"))


def judge(registry, draining: bool = False) -> Health:
    if draining:
        return Health("unavailable", "draining")
    counts = role_counts(registry)
    if not (disaggregated(registry) or registry.healthy("colocated")):
        missing = [f"{role} (0 of {n} healthy)" for role, n in counts.items() if not registry.healthy(role)]
        return Health("unavailable", f"no healthy worker: {', '.join(missing) or 'none configured'}")
    if (counts.get("prefill") or counts.get("decode")) and not disaggregated(registry):
        down = [f"{role} (0 of {counts.get(role, 0)} healthy)" for role in ("prefill", "decode")
                if not registry.healthy(role)]
        return Health("degraded", f"not disaggregating: no healthy {' or '.join(down)}; requests run on the "
                      f"colocated workers")
    return Health("ok")
