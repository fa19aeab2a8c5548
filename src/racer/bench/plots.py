"""``racer bench --plots``: PNG figures from bench records."""

from __future__ import annotations

import os
from pathlib import Path

from racer.bench.report import BenchResult, summarize


def write_plots(result: BenchResult, folder: str | os.PathLike) -> list[Path]:
    """PNGs: speedup per method per dataset, accepted-length histogram per method, and
    MAT against capacity when several capacities of one method were run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    methods = result.settings["methods"]
    rows = summarize(result.records, result.settings["baseline"])
    datasets = sorted({r.dataset for r in rows})
    written = []

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(methods) * len(datasets) / 2), 4))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        values = [next((r.speedup for r in rows if r.method == method and r.dataset == d), 0) for d in datasets]
        ax.bar(np.arange(len(datasets)) + i * width, values, width, label=method)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(np.arange(len(datasets)) + 0.4 - width / 2, datasets)
    ax.set_ylabel(f"speedup vs {result.settings['baseline']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(folder / "speedup.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in methods:
        accepted = [a + 1 for r in result.records if r.method == method and r.accepted for a in r.accepted]
        if accepted:
            ax.hist(accepted, bins=np.arange(1, max(accepted) + 2) - 0.5, histtype="step", label=method, density=True)
    ax.set_xlabel("tokens emitted per verification step (1 + accepted)")
    ax.set_ylabel("share of steps")
    ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(folder / "accepted_hist.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    by_capacity: dict[str, list[tuple[int, float, str]]] = {}
    for r in rows:
        options = next(rec.options for rec in result.records if rec.method == r.method)
        if "capacity" in options and r.mat is not None and isinstance(options["capacity"], int):
            by_capacity.setdefault(options["method"], []).append((options["capacity"], r.mat, r.dataset))
    for name, points in by_capacity.items():
        if len({c for c, _, _ in points}) < 2:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for dataset in sorted({d for _, _, d in points}):
            xs = sorted((c, m) for c, m, d in points if d == dataset)
            ax.plot([c for c, _ in xs], [m for _, m in xs], marker="o", label=dataset)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("capacity (draft nodes)")
        ax.set_ylabel("MAT")
        ax.set_title(name)
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(folder / f"mat_vs_capacity_{name}.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written
