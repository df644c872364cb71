"""Accuracy-vs-retention plots (matplotlib, PNG)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: files only
import matplotlib.pyplot as plt
from rich.table import Table

from kvllm.eval.grid import FULL, CellResult


def accuracy_table(results: Sequence[CellResult]) -> dict[str, dict[str, dict[float, float]]]:
    """family (and "mean") -> method -> retention -> accuracy; Full KV joins each method at 1.0."""
    table: dict[str, dict[str, dict[float, float]]] = defaultdict(lambda: defaultdict(dict))
    full = {r.family: r.accuracy for r in results if r.method == FULL}
    for r in results:
        if r.method != FULL:
            table[r.family][r.method][r.retention] = r.accuracy
    for family, acc in full.items():
        if table[family]:
            for curve in table[family].values():
                curve[1.0] = acc
        else:  # a Full-KV-only grid still gets its point
            table[family][FULL] = {1.0: acc}
    families = sorted(table)
    if len(families) > 1:
        methods = set.intersection(*(set(table[f]) for f in families))
        for m in sorted(methods):
            points = set.intersection(*(set(table[f][m]) for f in families))
            table["mean"][m] = {p: sum(table[f][m][p] for f in families) / len(families) for p in sorted(points)}
    return table


def _families(table: dict[str, dict[str, dict[float, float]]]) -> list[str]:
    """The families of an :func:`accuracy_table` in report order: sorted, then the mean."""
    return sorted(f for f in table if f != "mean") + (["mean"] if "mean" in table else [])


def accuracy_markdown(results: Sequence[CellResult]) -> str:
    """Markdown tables of :func:`accuracy_table`: one per family (and the mean), a row per
    method, a column per retention, accuracy in percent."""
    table = accuracy_table(results)
    out = []
    for family in _families(table):
        points = sorted({p for curve in table[family].values() for p in curve})
        out += [f"**{family}**", "", "| method | " + " | ".join(f"r={p:g}" for p in points) + " |"]
        out.append("| --- |" + " ---: |" * len(points))
        for method, curve in sorted(table[family].items()):
            cells = [f"{100 * curve[p]:.1f}" if p in curve else "-" for p in points]
            out.append(f"| {method} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def plot_accuracy(results: Sequence[CellResult], path: Path, title: str = "") -> Path:
    """One panel per family (plus the mean): accuracy vs retention, a line per method."""
    table = accuracy_table(results)
    panels = _families(table)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False, sharey=True)
    for ax, family in zip(axes[0], panels, strict=True):
        for method, curve in sorted(table[family].items()):
            xs = sorted(curve)
            style = {"linewidth": 2.5, "color": "black"} if method == "kara" else {"linewidth": 1.2}
            ax.plot(xs, [100 * curve[x] for x in xs], marker="o", markersize=3, label=method, **style)
        ax.set_title(family)
        ax.set_xlabel("retention")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accuracy (%)")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def accuracy_rich(results: Sequence[CellResult]) -> Table:
    """The grid as one rich table: a row per (family, method), a column per retention."""
    table = accuracy_table(results)
    points = sorted({p for family in table.values() for curve in family.values() for p in curve})
    out = Table(title="accuracy (%)")
    out.add_column("family")
    out.add_column("method")
    for p in points:
        out.add_column(f"r={p:g}", justify="right")
    for family in _families(table):
        for method, curve in sorted(table[family].items()):
            out.add_row(family, method, *(f"{100 * curve[p]:.1f}" if p in curve else "-" for p in points))
    return out
