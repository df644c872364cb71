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
    assert summary["baseline"] == "vanilla"
    assert kara["ratio"] == kara["ratio_min"] == kara["ratio_max"] == pytest.approx(1.5)
    assert (kara["tok_s_mean"], kara["tok_s_min"], kara["tok_s_max"]) == (225, 150, 300)
    assert summary["mean_ratio"]["kara"]["64"] == pytest.approx(1.5)
    assert summary["limit"] == []  # one pool: no ceiling to compare with


def test_vllm_at_its_defaults_is_the_baseline_and_the_limit_uses_the_largest_pool() -> None:
    rows = [_row("vanilla", 0, 8, 100), _row("vanilla-default", 0, 8, 125), _row("kara", 0, 8, 250)]
    rows += [{**_row("vanilla-default", 0, 8, 500), "pool_blocks": 999, "pool": "max"}]
    summary = summarize(rows)
    assert summary["baseline"] == "vanilla-default" and summary["ceiling_pool"] == "max"
    kara = next(c for c in summary["cells"] if c["system"] == "kara")
    assert kara["ratio"] == pytest.approx(2.0)
    assert summary["limit"] == [{"system": "kara", "concurrency": 8, "ratio": 0.5, "ratio_min": 0.5, "ratio_max": 0.5}]
    assert "| kara | 8 | 0.50 [0.50-0.50] |" in markdown_table(summary)


def test_report_files(tmp_path: Path) -> None:
    # Odd values: the rounded mean of one repeat may sit just below or above it.
    rows = [_row(s, 0, c, t) for s, t in (("vanilla", 100.04), ("kara", 130.06)) for c in (8, 16)]
    write_report(rows, tmp_path)
    names = ("results.csv", "results.json", "summary.json", "summary.md", "throughput.png", "ratios.png")
    for name in (*names, "compression.png", "pool_usage.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    header = (tmp_path / "results.csv").read_text().splitlines()[0]
    assert "tok_s" in header.split(",") and "usage" not in header.split(",")


def test_markdown_table_has_a_row_per_cell() -> None:
    rows = [_row(s, 0, c, t * c) for s, t in (("vanilla", 100.0), ("kara", 150.0)) for c in (8, 16)]
    rows = [{**r, "compress_share": 0.0234} if r["system"] == "kara" else r for r in rows]
    table = markdown_table(summarize(rows)).splitlines()
    assert table[0].startswith("| pool | C | vanilla | kara | kara / vanilla |")
    assert table[0].endswith("| rounds (kara) | compress % (kara) |")
    assert table[2] == "| 64 | 8 | 800 [800-800] | 1200 [1200-1200] | 1.50 | 0 | 0 | 0 | 2.3 |"
    assert len(table) == 4
