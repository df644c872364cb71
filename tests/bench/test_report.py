from __future__ import annotations

from pathlib import Path

import pytest

from kvllm.bench.report import markdown_table, summarize, write_report


def _row(system: str, repeat: int, c: int, tok_s: float) -> dict:
    return {
        "system": system,
        "pool_blocks": 64,
        "concurrency": c,
        "repeat": repeat,
        "tok_s": tok_s,
        "mean_tpot_ms": 10.0,
        "peak_running": c,
        "preemptions": 0,
        "rounds": 0,
        "compress_share": 0.0,
        "usage": [(0.0, 0.5, c), (1.0, 0.7, c)],
    }


def test_ratios_are_taken_within_a_repeat() -> None:
    # Repeat 1 is twice as fast for everyone: within-repeat ratios stay 1.5.
    rows = [_row("vanilla", 0, 8, 100), _row("kara", 0, 8, 150), _row("vanilla", 1, 8, 200), _row("kara", 1, 8, 300)]
    summary = summarize(rows)
    kara = next(c for c in summary["cells"] if c["system"] == "kara")
    assert kara["ratio_to_vanilla"] == pytest.approx(1.5)
    assert (kara["tok_s_mean"], kara["tok_s_min"], kara["tok_s_max"]) == (225, 150, 300)
    assert summary["mean_ratio_to_vanilla"]["kara"]["64"] == pytest.approx(1.5)


def test_report_files(tmp_path: Path) -> None:
    # Odd values: the rounded mean of one repeat may sit just below or above it.
    rows = [_row(s, 0, c, t) for s, t in (("vanilla", 100.04), ("kara", 130.06)) for c in (8, 16)]
    write_report(rows, tmp_path)
    for name in ("results.csv", "results.json", "summary.json", "summary.md", "throughput.png", "pool_usage.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    header = (tmp_path / "results.csv").read_text().splitlines()[0]
    assert "tok_s" in header.split(",") and "usage" not in header.split(",")


def test_markdown_table_has_a_row_per_cell() -> None:
    rows = [_row(s, 0, c, t * c) for s, t in (("vanilla", 100.0), ("kara", 150.0)) for c in (8, 16)]
    table = markdown_table(summarize(rows)).splitlines()
    assert table[0].startswith("| pool | C | vanilla | kara | kara / vanilla |")
    assert table[2] == "| 64 | 8 | 800 [800-800] | 1200 [1200-1200] | 1.50 | 0 | 0 | 0 |"
    assert len(table) == 4
