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

BASELINE = "vanilla"
SCALARS = (
    "system",
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
    "preemptions",
    "rounds",
    "compress_seconds",
    "compress_share",
    "peak_pool_usage",
    "mean_pool_usage",
    "engine_steps",
    "startup_seconds",
)


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per pool and concurrency: each system's tok/s (mean, min, max) and its ratio to
    vanilla, taken within each repeat and then averaged over repeats."""
    by = {(r["system"], r["pool_blocks"], r["concurrency"], r["repeat"]): r for r in rows}
    cells: list[dict[str, Any]] = []
    for pool in sorted({r["pool_blocks"] for r in rows}):
        for c in sorted({r["concurrency"] for r in rows}):
            for system in [s for s in SYSTEMS if any(k[0] == s for k in by)]:
                mine = [v for k, v in by.items() if k[:3] == (system, pool, c)]
                if not mine:
                    continue
                tok = [r["tok_s"] for r in mine]
                ratios = [
                    r["tok_s"] / by[(BASELINE, pool, c, r["repeat"])]["tok_s"]
                    for r in mine
                    if (BASELINE, pool, c, r["repeat"]) in by
                ]
                cells.append(
                    {
                        "system": system,
                        "pool_blocks": pool,
                        "concurrency": c,
                        "repeats": len(mine),
                        "tok_s_mean": round(statistics.fmean(tok), 1),
                        "tok_s_min": min(tok),
                        "tok_s_max": max(tok),
                        "ratio_to_vanilla": round(statistics.fmean(ratios), 4) if ratios else None,
                        "mean_tpot_ms": round(statistics.fmean(r["mean_tpot_ms"] for r in mine), 2),
                        "peak_running": max(r["peak_running"] for r in mine),
                        "preemptions": round(statistics.fmean(r["preemptions"] for r in mine), 1),
                        "rounds": round(statistics.fmean(r["rounds"] for r in mine), 1),
                        "compress_share": round(statistics.fmean(r["compress_share"] for r in mine), 4),
                    }
                )
    averages = defaultdict(dict)
    for system in {c["system"] for c in cells}:
        for pool in {c["pool_blocks"] for c in cells}:
            ratios = [
                c["ratio_to_vanilla"]
                for c in cells
                if c["system"] == system and c["pool_blocks"] == pool and c["ratio_to_vanilla"]
            ]
            if ratios:
                averages[system][str(pool)] = round(statistics.fmean(ratios), 4)
    return {"cells": cells, "mean_ratio_to_vanilla": dict(averages)}


def write_report(rows: Sequence[dict[str, Any]], out: Path, title: str = "") -> dict[str, Any]:
    """results.csv, results.json (with pool-usage traces), summary.json, and two PNGs."""
    out.mkdir(parents=True, exist_ok=True)
    rows = sorted(rows, key=lambda r: (r["pool_blocks"], r["concurrency"], r["system"], r["repeat"]))
    with (out / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=SCALARS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    (out / "results.json").write_text(json.dumps(list(rows), indent=1) + "\n")
    summary = summarize(rows)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.md").write_text(markdown_table(summary))
    plot_throughput(summary, out / "throughput.png", title)
    plot_usage(rows, out / "pool_usage.png")
    return summary


def markdown_table(summary: dict[str, Any]) -> str:
    """The summary as a Markdown table: a row per pool and concurrency, a column per system."""
    systems = [s for s in SYSTEMS if any(c["system"] == s for c in summary["cells"])]
    head = ["pool", "C", *systems, *(f"{s} / vanilla" for s in systems if s != BASELINE)]
    head += [f"preempt. ({s})" for s in systems] + [f"rounds ({s})" for s in systems if s not in UNCOMPRESSED]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    keys = sorted({(c["pool_blocks"], c["concurrency"]) for c in summary["cells"]})
    for pool, conc in keys:
        by = {c["system"]: c for c in summary["cells"] if (c["pool_blocks"], c["concurrency"]) == (pool, conc)}
        row = [str(pool), str(conc)]
        row += [f"{by[s]['tok_s_mean']:.0f} [{by[s]['tok_s_min']:.0f}-{by[s]['tok_s_max']:.0f}]" for s in systems]
        ratios = [by[s]["ratio_to_vanilla"] for s in systems if s != BASELINE]
        row += ["-" if r is None else f"{r:.2f}" for r in ratios]
        row += [f"{by[s]['preemptions']:.0f}" for s in systems]
        row += [f"{by[s]['rounds']:.0f}" for s in systems if s not in UNCOMPRESSED]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def plot_throughput(summary: dict[str, Any], path: Path, title: str = "") -> Path:
    """Output tok/s vs concurrency, a line per system (min-max bars), a panel per pool."""
    pools = sorted({c["pool_blocks"] for c in summary["cells"]})
    fig, axes = plt.subplots(1, len(pools), figsize=(5 * len(pools), 4), squeeze=False)
    for ax, pool in zip(axes[0], pools, strict=True):
        for system in SYSTEMS:
            mine = sorted(
                (c for c in summary["cells"] if c["system"] == system and c["pool_blocks"] == pool),
                key=lambda c: c["concurrency"],
            )
            if not mine:
                continue
            xs = [c["concurrency"] for c in mine]
            ys = [c["tok_s_mean"] for c in mine]
            err = [
                # The mean is rounded: clamp so a single repeat draws no negative bar.
                [max(0.0, y - c["tok_s_min"]) for y, c in zip(ys, mine, strict=True)],
                [max(0.0, c["tok_s_max"] - y) for y, c in zip(ys, mine, strict=True)],
            ]
            style = {"linewidth": 2.5, "color": "black"} if system == "kara" else {"linewidth": 1.2}
            ax.errorbar(xs, ys, yerr=err, marker="o", markersize=3, capsize=3, label=system, **style)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({c["concurrency"] for c in summary["cells"]}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_title(f"KV pool {pool} blocks")
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel("output tokens/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def summary_rich(summary: dict[str, Any]) -> Table:
    """The summary's cells as one rich table (tok/s means, ratios within repeats)."""
    table = Table(title="output tok/s (mean of repeats) and ratio to vanilla (within repeats)")
    for col in ("pool", "concurrency", "system", "tok/s", "x vanilla", "preempt", "rounds", "compress %"):
        table.add_column(col, justify="right")
    for c in summary["cells"]:
        ratio = "" if c["ratio_to_vanilla"] is None else f"{c['ratio_to_vanilla']:.2f}"
        table.add_row(
            str(c["pool_blocks"]),
            str(c["concurrency"]),
            c["system"],
            f"{c['tok_s_mean']:.0f}",
            ratio,
            f"{c['preemptions']:.0f}",
            f"{c['rounds']:.0f}",
            f"{100 * c['compress_share']:.1f}",
        )
    return table
