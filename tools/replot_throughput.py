"""Redraw ``docs/results/data/throughput/``'s summaries and figures from its stored rows: no benchmark runs.

Each folder's per-repeat rows (``results.jsonl`` where stored, else ``results.csv``:
:func:`tools.render_results.stored_rows`) go through the package's own report code
(:mod:`kvllm.bench.report`): ``summary.json`` and ``summary.md`` are rewritten, and each
figure the folder stores is redrawn. The pool-usage plot needs the rows' usage traces,
which ``results.csv`` does not keep, so it is left as it is where only the CSV is stored.

The headline folder's ``throughput.png`` and ``ratios.png`` are drawn from its rows with
SnapKV-threshold's taken from ``docs/results/data/throughput/matched/`` (the rerun at the budget
matched to Kara's memory, beside the same vanilla-default rows) instead of the headline
run's own, at the old 192-slot budget; that rerun had no ceiling pool, so SnapKV-threshold
has no limit line there. ``summary.json``/``.md`` keep the run's own rows.

    python -m tools.replot_throughput
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvllm.bench import report
from tools.render_results import DATA, stored_rows

# Folder under docs/results/data/ -> its plots' title, as `kvllm bench throughput` wrote it.
TITLES = {
    "throughput": "tiny-qwen3, 2048 output tokens/request",
    "throughput/c128": "tiny-qwen3, 2048 output tokens/request",
    "throughput/inversion": "qwen3-0.6b-4l, 1024 output tokens/request, no pressure",
    "throughput/long3800": "tiny-qwen3, 3800 output tokens/request",
    "throughput/matched": "tiny-qwen3, 2048 output tokens/request",
    "throughput/mix": "tiny-qwen3, 1024-3584 output tokens/request",
    "throughput/nopress512": "tiny-qwen3, 512 output tokens/request",
    "throughput/pool16": "tiny-qwen3, 2048 output tokens/request",
    "throughput/qwen3-0.6b-4l": "qwen3-0.6b-4l, 2048 output tokens/request",
}
PLOTS = {
    "throughput.png": report.plot_throughput,
    "ratios.png": report.plot_ratios,
    "compression.png": report.plot_compression,
}
HEADLINE, MATCHED = "throughput", "throughput/matched"
MATCHED_SYSTEM = "snapkv-threshold"


def _sorted(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """In :func:`kvllm.bench.report.write_report`'s order (the pool-usage legend's)."""
    return sorted(rows, key=lambda r: (r["pool_blocks"], r["concurrency"], r["system"], r["repeat"]))


def replot(folder: str) -> list[Path]:
    """Rewrite ``folder``'s summaries and redraw its stored figures; returns what it wrote."""
    out = DATA / folder
    rows = _sorted(stored_rows(out))
    summary = report.summarize(rows)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.md").write_text(report.markdown_table(summary))
    written = [out / "summary.json", out / "summary.md"]
    for name, plot in PLOTS.items():
        if (out / name).exists():
            written.append(plot(summary, out / name, TITLES[folder]))
    if (out / "pool_usage.png").exists() and all(r.get("usage") for r in rows):
        written.append(report.plot_usage(rows, out / "pool_usage.png"))
    return written


def replot_headline() -> list[Path]:
    """The headline's throughput and ratio figures, SnapKV-threshold at the matched budget."""
    vanilla = {(r["pool_blocks"], r["concurrency"], r["repeat"], r["tok_s"]) for r in stored_rows(DATA / HEADLINE)}
    matched = stored_rows(DATA / MATCHED)
    # Its ratios pair with the headline's own vanilla-default rows, so those must be the same.
    assert all(
        (r["pool_blocks"], r["concurrency"], r["repeat"], r["tok_s"]) in vanilla
        for r in matched
        if r["system"] == report.baseline_of(matched)
    ), f"{DATA / MATCHED} no longer holds the headline's vanilla rows"
    rows = [r for r in stored_rows(DATA / HEADLINE) if r["system"] != MATCHED_SYSTEM]
    rows += [r for r in matched if r["system"] == MATCHED_SYSTEM]
    summary = report.summarize(_sorted(rows))
    summary["limit"] = [r for r in summary["limit"] if r["system"] != MATCHED_SYSTEM]
    title = f"{TITLES[HEADLINE]}; {MATCHED_SYSTEM} at the matched budget (matched/)"
    out = DATA / HEADLINE
    return [
        report.plot_throughput(summary, out / "throughput.png", title),
        report.plot_ratios(summary, out / "ratios.png", title),
    ]


def main() -> None:
    for folder in TITLES:
        for path in replot(folder):
            print(path.relative_to(DATA))
    for path in replot_headline():
        print(path.relative_to(DATA), "(snapkv-threshold from matched/)")


if __name__ == "__main__":
    main()
