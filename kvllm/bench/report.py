"""Throughput report: CSV/JSON tables, within-repeat ratios, and the plots."""

from __future__ import annotations

import csv
import json
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: files only
import matplotlib.pyplot as plt
from rich.table import Table

from kvllm.bench.throughput import SYSTEMS, UNCOMPRESSED
from kvllm.plots import save_figure

# Ratios are to vLLM at its defaults when that ran, else to the constrained vanilla.
BASELINES = ("vanilla-default", "vanilla")
# One colour per system in every plot, so panels and files compare at a glance.
COLORS = {s: f"C{i}" for i, s in enumerate(SYSTEMS)}
SCALARS = (
    "system",
    "pool",
    "pool_blocks",
    "concurrency",
    "repeat",
    "requests",
    "output_tokens",
    "seconds",
    "tok_s",
    "mean_tpot_ms",
    "mean_ttft_s",
    "peak_running",
    "mean_running",
    "mean_step_ms",
    "preemptions",
    "rounds",
    "compress_seconds",
    "compress_share",
    "peak_pool_usage",
    "mean_pool_usage",
    "engine_steps",
    "startup_seconds",
)


def baseline_of(rows: Sequence[dict[str, Any]]) -> str:
    """The system ratios are taken to (:data:`BASELINES`, the first that ran)."""
    ran = {r["system"] for r in rows}
    return next((b for b in BASELINES if b in ran), BASELINES[-1])


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per pool and concurrency: each system's tok/s (mean, min, max) and its ratio to
    the baseline, taken within each repeat and then averaged over repeats (with the
    min and max of those ratios).

    ``limit``: each compressing system in the smallest pool over the baseline in the
    largest one (the ceiling, when that pool is unpressured), within repeats.
    """
    if not rows:
        raise ValueError("no benchmark rows to summarize")
    base = baseline_of(rows)
    by = {(r["system"], r["pool_blocks"], r["concurrency"], r["repeat"]): r for r in rows}
    labels = {r["pool_blocks"]: str(r.get("pool", r["pool_blocks"])) for r in rows}
    pools = sorted(labels)
    cells: list[dict[str, Any]] = []
    for pool in pools:
        for c in sorted({r["concurrency"] for r in rows}):
            for system in [s for s in SYSTEMS if any(k[0] == s for k in by)]:
                mine = [v for k, v in by.items() if k[:3] == (system, pool, c)]
                if not mine:
                    continue
                tok = [r["tok_s"] for r in mine]
                ratios = _ratios(by, mine, (base, pool, c))
                cells.append(
                    {
                        "system": system,
                        "pool": labels[pool],
                        "pool_blocks": pool,
                        "concurrency": c,
                        "repeats": len(mine),
                        "tok_s_mean": round(statistics.fmean(tok), 1),
                        "tok_s_min": min(tok),
                        "tok_s_max": max(tok),
                        "ratio": round(statistics.fmean(ratios), 4) if ratios else None,
                        "ratio_min": round(min(ratios), 4) if ratios else None,
                        "ratio_max": round(max(ratios), 4) if ratios else None,
                        "mean_tpot_ms": round(statistics.fmean(r["mean_tpot_ms"] for r in mine), 2),
                        "mean_step_ms": round(statistics.fmean(r.get("mean_step_ms", 0.0) for r in mine), 2),
                        "peak_running": max(r["peak_running"] for r in mine),
                        "mean_running": round(statistics.fmean(r.get("mean_running", 0.0) for r in mine), 1),
                        "preemptions": round(statistics.fmean(r["preemptions"] for r in mine), 1),
                        "rounds": round(statistics.fmean(r["rounds"] for r in mine), 1),
                        "compress_share": round(statistics.fmean(r["compress_share"] for r in mine), 4),
                    }
                )
    averages: dict[str, dict[str, float]] = defaultdict(dict)
    for system in dict.fromkeys(c["system"] for c in cells):  # in SYSTEMS order: stable files
        for pool in pools:
            ratios = [c["ratio"] for c in cells if (c["system"], c["pool_blocks"]) == (system, pool) and c["ratio"]]
            if ratios:
                averages[system][labels[pool]] = round(statistics.fmean(ratios), 4)
    limit = []
    if len(pools) > 1:
        for cell in cells:
            if cell["pool_blocks"] != pools[0] or cell["system"] in UNCOMPRESSED:
                continue
            mine = [v for k, v in by.items() if k[:3] == (cell["system"], pools[0], cell["concurrency"])]
            ratios = _ratios(by, mine, (base, pools[-1], cell["concurrency"]))
            if ratios:
                limit.append(
                    {
                        "system": cell["system"],
                        "concurrency": cell["concurrency"],
                        "ratio": round(statistics.fmean(ratios), 4),
                        "ratio_min": round(min(ratios), 4),
                        "ratio_max": round(max(ratios), 4),
                    }
                )
    return {
        "baseline": base,
        "tight_pool": labels[pools[0]],
        "ceiling_pool": labels[pools[-1]],
        "cells": cells,
        "mean_ratio": dict(averages),
        "limit": limit,
    }


def _ratios(by: dict[tuple, dict[str, Any]], mine: list[dict[str, Any]], to: tuple[str, int, int]) -> list[float]:
    """tok/s of each of ``mine`` over ``to``'s (system, pool, concurrency) in the same repeat."""
    return [r["tok_s"] / by[(*to, r["repeat"])]["tok_s"] for r in mine if (*to, r["repeat"]) in by]


def write_results(rows: Sequence[dict[str, Any]], out: Path, columns: Sequence[str]) -> None:
    """``results.csv`` (``columns`` only) and ``results.json`` (every field) under ``out``."""
    with (out / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    (out / "results.json").write_text(json.dumps(list(rows), indent=1) + "\n")


def write_report(rows: Sequence[dict[str, Any]], out: Path, title: str = "") -> dict[str, Any]:
    """results.csv, results.json (with pool-usage traces), summary.json/md, and four PNGs."""
    out.mkdir(parents=True, exist_ok=True)
    rows = sorted(rows, key=lambda r: (r["pool_blocks"], r["concurrency"], r["system"], r["repeat"]))
    write_results(rows, out, SCALARS)
    summary = summarize(rows)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.md").write_text(markdown_table(summary))
    plot_throughput(summary, out / "throughput.png", title)
    plot_ratios(summary, out / "ratios.png", title)
    plot_compression(summary, out / "compression.png", title)
    plot_usage(rows, out / "pool_usage.png")
    return summary


def markdown_table(summary: dict[str, Any]) -> str:
    """The summary as Markdown: a row per pool and concurrency, a column per system;
    then the limit rows, when the run had a ceiling pool."""
    base = summary["baseline"]
    systems = [s for s in SYSTEMS if any(c["system"] == s for c in summary["cells"])]
    others = [s for s in systems if s != base]
    head = ["pool", "C", *systems, *(f"{s} / {base}" for s in others)]
    compressing = [s for s in systems if s not in UNCOMPRESSED]
    head += [f"preempt. ({s})" for s in systems] + [f"rounds ({s})" for s in compressing]
    head += [f"compress % ({s})" for s in compressing]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    keys = sorted({(c["pool_blocks"], c["concurrency"]) for c in summary["cells"]})
    for pool, conc in keys:
        by = {c["system"]: c for c in summary["cells"] if (c["pool_blocks"], c["concurrency"]) == (pool, conc)}
        label = next(iter(by.values()))["pool"]
        row = [label if label == str(pool) else f"{label} ({pool})", str(conc)]
        row += [_cell(by.get(s), "tok_s", "{:.0f}") for s in systems]
        row += [_cell(by.get(s), "ratio", "{:.2f}") for s in others]
        row += ["-" if s not in by else f"{by[s]['preemptions']:.0f}" for s in systems]
        row += ["-" if s not in by else f"{by[s]['rounds']:.0f}" for s in compressing]
        row += ["-" if s not in by else f"{100 * by[s]['compress_share']:.1f}" for s in compressing]
        lines.append("| " + " | ".join(row) + " |")
    if summary["limit"]:
        lines += [
            "",
            f"Limit: each system in pool {summary['tight_pool']} over {base} in pool {summary['ceiling_pool']}, "
            "within repeats, mean [min-max]:",
            "",
            "| system | C | ratio |",
            "| --- | --- | --- |",
        ]
        lines += [
            f"| {r['system']} | {r['concurrency']} | {r['ratio']:.2f} [{r['ratio_min']:.2f}-{r['ratio_max']:.2f}] |"
            for r in summary["limit"]
        ]
    return "\n".join(lines) + "\n"


def _cell(cell: dict[str, Any] | None, key: str, fmt: str) -> str:
    """``mean [min-max]`` of a summary cell's figure (tok_s or ratio), '-' when absent."""
    if cell is None or cell.get(f"{key}_mean" if key == "tok_s" else key) is None:
        return "-"
    mean = cell["tok_s_mean"] if key == "tok_s" else cell[key]
    lo, hi = cell[f"{key}_min"], cell[f"{key}_max"]
    if key == "ratio" and cell["repeats"] == 1:
        return fmt.format(mean)
    return f"{fmt.format(mean)} [{fmt.format(lo)}-{fmt.format(hi)}]"


def plot_throughput(summary: dict[str, Any], path: Path, title: str = "") -> Path:
    """Output tok/s vs concurrency, a line per system (min-max bars), a panel per pool."""
    fig, panels = _pool_panels(summary)
    for ax, pool in panels:
        for system in SYSTEMS:
            mine = _cells_of(summary, system, pool)
            if not mine:
                continue
            xs = [c["concurrency"] for c in mine]
            ys = [c["tok_s_mean"] for c in mine]
            err = [
                # The mean is rounded: clamp so a single repeat draws no negative bar.
                [max(0.0, y - c["tok_s_min"]) for y, c in zip(ys, mine, strict=True)],
                [max(0.0, c["tok_s_max"] - y) for y, c in zip(ys, mine, strict=True)],
            ]
            # Bold: Kara as `kvllm serve` runs it.
            style = {"linewidth": 2.5, "color": "black"} if system == "kara" else {"linewidth": 1.2}
            ax.errorbar(xs, ys, yerr=err, marker="o", markersize=3, capsize=3, label=system, **style)
        _concurrency_panel(ax, summary, pool, "output tokens/s", 8)
    return save_figure(fig, path, title)


def plot_ratios(summary: dict[str, Any], path: Path, title: str = "") -> Path:
    """Each system's tok/s over the baseline's vs concurrency (min-max bars), a panel per
    pool; the tight pool's panel also draws the limit rows (dashed: over the ceiling)."""
    fig, panels = _pool_panels(summary)
    for ax, pool in panels:
        for system in SYSTEMS:
            mine = [c for c in _cells_of(summary, system, pool) if c["ratio"]]
            if system == summary["baseline"] or not mine:
                continue
            _ratio_line(ax, mine, system, COLORS[system], "-")
            if pool == panels[0][1] and summary["limit"]:
                limit = sorted((r for r in summary["limit"] if r["system"] == system), key=lambda r: r["concurrency"])
                if limit:
                    _ratio_line(ax, limit, f"{system} / ceiling", COLORS[system], "--")
        ax.axhline(1.0, color="gray", linewidth=0.8)
        _concurrency_panel(ax, summary, pool, f"output tok/s / {summary['baseline']}", 7)
    return save_figure(fig, path, title)


def plot_compression(summary: dict[str, Any], path: Path, title: str = "") -> Path:
    """Compression rounds' share of engine time vs concurrency, a line per compressing
    system, a panel per pool: the mechanism of the concurrency-throughput inversion
    (docs/results/throughput.md), since a round stalls the whole batch's next step."""
    fig, panels = _pool_panels(summary)
    for ax, pool in panels:
        for system in SYSTEMS:
            mine = _cells_of(summary, system, pool)
            if system in UNCOMPRESSED or not mine:
                continue
            xs = [c["concurrency"] for c in mine]
            ys = [100 * c["compress_share"] for c in mine]
            ax.plot(xs, ys, marker="o", markersize=3, label=system, color=COLORS[system])
        ax.set_ylim(bottom=0)
        _concurrency_panel(ax, summary, pool, "compression rounds (% of engine time)", 7)
    return save_figure(fig, path, title)


def _pool_panels(summary: dict[str, Any]) -> tuple[Any, list[tuple[Any, int]]]:
    """A figure with one panel per pool (smallest first), and its (axes, pool) pairs."""
    pools = sorted({c["pool_blocks"] for c in summary["cells"]})
    fig, axes = plt.subplots(1, len(pools), figsize=(5 * len(pools), 4), squeeze=False)
    return fig, list(zip(axes[0], pools, strict=True))


def _cells_of(summary: dict[str, Any], system: str, pool: int) -> list[dict[str, Any]]:
    """``system``'s summary cells in ``pool``, by concurrency."""
    mine = (c for c in summary["cells"] if (c["system"], c["pool_blocks"]) == (system, pool))
    return sorted(mine, key=lambda c: c["concurrency"])


def _ratio_line(ax: Any, points: list[dict[str, Any]], label: str, color: str, style: str) -> None:
    xs = [p["concurrency"] for p in points]
    ys = [p["ratio"] for p in points]
    err = [[max(0.0, y - p["ratio_min"]) for y, p in zip(ys, points, strict=True)]]
    err.append([max(0.0, p["ratio_max"] - y) for y, p in zip(ys, points, strict=True)])
    ax.errorbar(xs, ys, yerr=err, marker="o", markersize=3, capsize=3, label=label, color=color, linestyle=style)


def _concurrency_panel(ax: Any, summary: dict[str, Any], pool: int, ylabel: str, legend_size: int) -> None:
    """One pool's panel against concurrency (log-2 axis, the run's concurrencies as ticks)."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({c["concurrency"] for c in summary["cells"]}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_title(f"KV pool {_label(summary, pool)}")
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)


def _label(summary: dict[str, Any], pool: int) -> str:
    label = next(c["pool"] for c in summary["cells"] if c["pool_blocks"] == pool)
    return f"{label} ({pool} blocks)" if label != str(pool) else f"{pool} blocks"


def plot_usage(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """KV pool usage over time at the highest concurrency of the smallest pool, repeat 0."""
    pool = min(r["pool_blocks"] for r in rows)
    c = max(r["concurrency"] for r in rows)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in rows:
        if (r["pool_blocks"], r["concurrency"], r["repeat"]) == (pool, c, 0) and r.get("usage"):
            t, used, _ = zip(*r["usage"], strict=True)
            ax.plot(t, [100 * u for u in used], label=r["system"], linewidth=2 if r["system"] == "kara" else 1)
    ax.set_title(f"KV pool usage, pool {pool} blocks, concurrency {c}")
    ax.set_xlabel("seconds")
    ax.set_ylabel("blocks in use (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def summary_rich(summary: dict[str, Any]) -> Table:
    """The summary's cells as one rich table (tok/s means, ratios within repeats)."""
    base = summary["baseline"]
    table = Table(title=f"output tok/s (mean of repeats) and ratio to {base} (within repeats)")
    for col in ("pool", "concurrency", "system", "tok/s", f"x {base}", "preempt", "rounds", "compress %"):
        table.add_column(col, justify="right")
    for c in summary["cells"]:
        ratio = "" if c["ratio"] is None else f"{c['ratio']:.2f}"
        table.add_row(
            c["pool"],
            str(c["concurrency"]),
            c["system"],
            f"{c['tok_s_mean']:.0f}",
            ratio,
            f"{c['preemptions']:.0f}",
            f"{c['rounds']:.0f}",
            f"{100 * c['compress_share']:.1f}",
        )
    return table
