"""B2's PNG plots (matplotlib, Agg): TTFT p99 and TPOT p99 against request rate with the
SLOs drawn, and SLO attainment against rate; one line per topology. The `inf` rate sits
one step right of the highest finite rate, labelled ∞. Goodput searches (--goodput): per
workload, attainment against rate for each SLO pair, each topology's probes and its knee."""
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


def plot_goodput(by_workload: dict[str, dict], slos: list, stem: Path) -> list[Path]:
    """One PNG per workload, a panel per SLO pair: every probe's attainment against its rate
    (log scale), one line per topology, failed probes hollow, the knee (goodput) a star on a
    dotted line, the 90 % target drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    for ds, topos in by_workload.items():
        measured = {n: t for n, t in topos.items() if t.get("probes")}
        if not measured:
            continue
        fig, axes = plt.subplots(1, len(slos), figsize=(5.2 * len(slos), 4.2), squeeze=False)
        for ax, slo in zip(axes[0], slos, strict=True):
            for i, (name, t) in enumerate(measured.items()):
                _knee_panel(ax, f"C{i % 10}", name, t, slo.key)
            ax.axhline(100 * GOODPUT_ATTAINMENT, color="red", linestyle="--", linewidth=1,
                       label=f"target {100 * GOODPUT_ATTAINMENT:g} %")
            _rate_axis(ax, [p["rate"] for t in measured.values() for p in t["probes"]])
            ax.set_ylim(0, 105)
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel("% of requests within both SLOs")
            ax.set_title(f"{ds}: TTFT <= {slo.ttft_s * 1e3:g} ms, TPOT <= {slo.tpot_s * 1e3:g} ms", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        path = stem.with_name(f"{stem.name}-goodput-{_file_part(ds)}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def _rate_axis(ax, rates: list[float]) -> None:
    """Log scale where the probes span a decade or more (the bracketing steps), plain numbers on it."""
    from matplotlib.ticker import NullFormatter, ScalarFormatter
    if max(rates) >= 10 * min(rates):
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())


def _knee_panel(ax, color: str, name: str, t: dict, key: str) -> None:
    probes = sorted(t["probes"], key=lambda p: p["rate"])
    xs = [p["rate"] for p in probes]
    ys = [100 * p["attainment"][key] for p in probes]
    ax.plot(xs, ys, color=color, linewidth=1, label=name)
    for x, y, p in zip(xs, ys, probes, strict=True):
        ax.plot([x], [y], marker="o", color=color, markerfacecolor=color if p["passes"][key] else "none")
    knee = t["searches"][key]["goodput_req_s"]
    if knee is not None:
        ax.axvline(knee, color=color, linestyle=":", linewidth=1)
        y = next((100 * p["attainment"][key] for p in probes if p["rate"] == knee), 100 * GOODPUT_ATTAINMENT)
        ax.plot([knee], [y], marker="*", markersize=13, color=color)
        ax.annotate(f"{knee:g}", (knee, y), textcoords="offset points", xytext=(4, -12), fontsize=7, color=color)


def _file_part(name: str) -> str:
    """A dataset name (or a .jsonl path) as part of a file name."""
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in Path(name).stem)
