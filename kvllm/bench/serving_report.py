"""Serving-benchmark report: CSV/JSON, within-repeat ratios to vanilla, a table and a plot."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: files only
import matplotlib.pyplot as plt

from kvllm.bench.report import write_results
from kvllm.bench.serving import FIGURES, PERCENTILES, SYSTEMS, TURN_KEYS
from kvllm.plots import save_figure

BASELINE = "vanilla"
# Figures compared with vanilla within a repeat: higher is better for throughput, lower for latency.
COMPARED = ("output_throughput", "p99_ttft_ms", "p50_tpot_ms", "p99_itl_ms")
# Multi-turn rows also compare the later turns' TTFT, where the two prefix caches differ.
TURN_COMPARED = ("p50_ttft_later_ms",)


def _multi_turn(rows: Sequence[dict[str, Any]]) -> bool:
    return any(key in r for r in rows for key in TURN_KEYS)


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per system and load point: every figure's mean over repeats, tok/s min-max, and
    each of :data:`COMPARED` (and, for multi-turn rows, :data:`TURN_COMPARED`) over
    vanilla's in the same repeat (mean, min, max)."""
    turns = _multi_turn(rows)
    compared = COMPARED + (TURN_COMPARED if turns else ())
    by = {(r["system"], r["load"], r["value"], r["repeat"]): r for r in rows}
    points = sorted({(r["load"], r["value"]) for r in rows})
    cells = []
    for load, value in points:
        for system in [s for s in SYSTEMS if any(k[:3] == (s, load, value) for k in by)]:
            mine = [v for k, v in by.items() if k[:3] == (system, load, value)]
            cell: dict[str, Any] = {"system": system, "load": load, "value": value, "repeats": len(mine)}
            figures = ["output_throughput", "preemptions", "rounds"]
            figures += [f"p{p}_{f}_ms" for f in FIGURES for p in PERCENTILES]
            figures += [*TURN_KEYS, "prefix_hits"] if turns else []
            for key in figures:
                values = [r[key] for r in mine if r.get(key) is not None]
                cell[key] = round(statistics.fmean(values), 2) if values else None
            tok = [r["output_throughput"] for r in mine]
            cell["tok_s_min"], cell["tok_s_max"] = round(min(tok), 1), round(max(tok), 1)
            for key in compared:
                ratios = [
                    r[key] / by[(BASELINE, load, value, r["repeat"])][key]
                    for r in mine
                    if (BASELINE, load, value, r["repeat"]) in by
                    and r.get(key) is not None
                    and by[(BASELINE, load, value, r["repeat"])].get(key)
                ]
                if ratios and system != BASELINE:
                    cell[f"{key}_ratio"] = [round(x, 3) for x in (statistics.fmean(ratios), min(ratios), max(ratios))]
            cells.append(cell)
    return cells


def markdown_table(cells: Sequence[dict[str, Any]]) -> str:
    turns = _multi_turn(cells)
    compared = COMPARED + (TURN_COMPARED if turns else ())
    head = ["load", "system", "output tok/s [min-max]", "TTFT p50/p90/p99 ms", "TPOT p50/p90/p99 ms"]
    head += ["ITL p50/p90/p99 ms", "preempt.", "rounds"]
    head += ["TTFT p50 turn 1 / later ms", "prefix-cache hits"] if turns else []
    head += [f"{k} / {BASELINE}" for k in compared]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for c in cells:
        load = f"C={c['value']:g}" if c["load"] == "concurrency" else f"{c['value']:g} req/s"
        row = [load, c["system"], f"{c['output_throughput']:.0f} [{c['tok_s_min']:.0f}-{c['tok_s_max']:.0f}]"]
        for f in FIGURES:
            row.append("/".join("-" if c[f"p{p}_{f}_ms"] is None else f"{c[f'p{p}_{f}_ms']:.0f}" for p in PERCENTILES))
        row += [f"{c['preemptions']:.0f}", f"{c['rounds']:.0f}"]
        if turns:
            row.append("/".join("-" if c.get(k) is None else f"{c[k]:.0f}" for k in TURN_KEYS))
            row.append("-" if c.get("prefix_hits") is None else f"{c['prefix_hits']:.0f}")
        for key in compared:
            r = c.get(f"{key}_ratio")
            row.append("-" if r is None else f"{r[0]:.2f} [{r[1]:.2f}-{r[2]:.2f}]")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def plot(cells: Sequence[dict[str, Any]], path: Path, title: str = "") -> Path:
    """Output tok/s and p99 TTFT against the load, a line per system, a panel pair per load kind."""
    kinds = sorted({c["load"] for c in cells})
    fig, axes = plt.subplots(len(kinds), 2, figsize=(10, 3.8 * len(kinds)), squeeze=False)
    for row, kind in zip(axes, kinds, strict=True):
        for system in SYSTEMS:
            mine = sorted((c for c in cells if (c["system"], c["load"]) == (system, kind)), key=lambda c: c["value"])
            if not mine:
                continue
            xs = [c["value"] for c in mine]
            ys = [c["output_throughput"] for c in mine]
            # The mean and the extremes are rounded apart: clamp so no bar is negative.
            err = [[max(0.0, y - c["tok_s_min"]) for y, c in zip(ys, mine, strict=True)]]
            err.append([max(0.0, c["tok_s_max"] - y) for y, c in zip(ys, mine, strict=True)])
            row[0].errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=system)
            row[1].plot(xs, [c["p99_ttft_ms"] for c in mine], marker="o", label=system)
        for ax, ylabel in zip(row, ("output tokens/s", "TTFT p99 (ms)"), strict=True):
            ax.set_xlabel("concurrency" if kind == "concurrency" else "request rate (req/s)")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    return save_figure(fig, path, title)


def write_report(rows: Sequence[dict[str, Any]], out: Path, title: str = "") -> list[dict[str, Any]]:
    """results.csv, results.json, summary.json, summary.md and serving.png under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    rows = sorted(rows, key=lambda r: (r["load"], r["value"], r["system"], r["repeat"]))
    write_results(rows, out, list(rows[0]))
    cells = summarize(rows)
    (out / "summary.json").write_text(json.dumps(cells, indent=1) + "\n")
    (out / "summary.md").write_text(markdown_table(cells))
    plot(cells, out / "serving.png", title)
    return cells
