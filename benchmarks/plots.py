"""B2's PNG plots (matplotlib, Agg): TTFT p99 and TPOT p99 against request rate with the
SLOs drawn, and SLO attainment against rate; one line per topology. The `inf` rate sits
one step right of the highest finite rate, labelled ∞."""
from __future__ import annotations

import math
from pathlib import Path

from baton.benchmarks.stats import GOODPUT_ATTAINMENT


def _x_positions(rates: list[float]) -> tuple[dict[float, float], list[float], list[str]]:
    finite = sorted({r for r in rates if not math.isinf(r)})
    pos = {r: r for r in finite}
    if any(math.isinf(r) for r in rates):
        step = (finite[-1] - finite[0]) / max(1, len(finite) - 1) if len(finite) > 1 else (finite[0] if finite else 1)
        pos[math.inf] = (finite[-1] if finite else 0) + step
    ticks = sorted(pos.values())
    labels = ["∞" if math.isinf(r) else f"{r:g}" for r in sorted(pos, key=pos.get)]
    return pos, ticks, labels


def plot_sweep(topologies: dict[str, list[dict]], slo_ttft_s: float | None, slo_tpot_s: float | None,
               stem: Path) -> list[Path]:
    """`topologies`: name -> per-rate summaries (request_rate, ttft_s, tpot_s, slo_attainment)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [p["request_rate"] for points in topologies.values() for p in points]
    pos, ticks, labels = _x_positions(rates)
    stem.parent.mkdir(parents=True, exist_ok=True)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, slo, title in ((axes[0], "ttft_s", slo_ttft_s, "TTFT p99"), (axes[1], "tpot_s", slo_tpot_s,
                                                                                   "TPOT p99")):
        for name, points in topologies.items():
            xy = [(pos[p["request_rate"]], p[key]["p99"] * 1e3) for p in points if p[key]["p99"] is not None]
            if xy:
                ax.plot(*zip(*xy, strict=True), marker="o", label=name)
        if slo is not None:
            ax.axhline(slo * 1e3, color="red", linestyle="--", linewidth=1, label=f"SLO {slo * 1e3:g} ms")
        _axes(ax, ticks, labels, title, "ms")
    latency = stem.with_name(stem.name + "-latency.png")
    fig.tight_layout()
    fig.savefig(latency, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4.2))
    for name, points in topologies.items():
        xy = [(pos[p["request_rate"]], 100 * p["slo_attainment"]) for p in points if p["slo_attainment"] is not None]
        if xy:
            ax.plot(*zip(*xy, strict=True), marker="o", label=name)
    ax.axhline(100 * GOODPUT_ATTAINMENT, color="red", linestyle="--", linewidth=1,
               label=f"goodput target {100 * GOODPUT_ATTAINMENT:g} %")
    ax.set_ylim(0, 105)
    _axes(ax, ticks, labels, "SLO attainment (TTFT and TPOT)", "% of requests")
    attainment = stem.with_name(stem.name + "-slo.png")
    fig.tight_layout()
    fig.savefig(attainment, dpi=120)
    plt.close(fig)
    return [latency, attainment]


def _axes(ax, ticks: list[float], labels: list[str], title: str, unit: str) -> None:
    ax.set_xticks(ticks, labels)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel(unit)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
