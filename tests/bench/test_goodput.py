"""`kvllm bench goodput`: systems, the report on crafted rows, resuming, and a small run end to end."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from kvllm.bench import goodput
from kvllm.bench.goodput import Goodput, parse_system
from kvllm.bench.goodput_report import iso_accuracy, keeps_accuracy, markdown, plot, summarize
from kvllm.config import CompressionConfig

BASE = CompressionConfig()


def test_system_strings_name_method_policy_retention_and_window() -> None:
    assert parse_system("vanilla-default", BASE) is None
    kara = parse_system("kara@0.5/256/64", BASE)
    assert (kara.method, kara.retention, kara.window, kara.buffer, kara.policy) == ("kara", 0.5, 256, 64, "periodic")
    assert kara.admission == "vllm"  # as kvllm serve runs it
    snap = parse_system("snapkv-threshold@0.2", BASE)
    assert (snap.method, snap.policy, snap.threshold_interval) == ("snapkv", "threshold", 64)
    assert parse_system("kara-topk", BASE).method == "kara-topk"  # a name with a dash, no policy
    assert parse_system("snapkv-periodic", BASE).retention == BASE.retention
    lazy = parse_system("kara+lazy2@0.2", BASE)
    assert (lazy.method, lazy.lazy, lazy.lazy_keep, lazy.retention) == ("kara", 2, BASE.lazy_keep, 0.2)
    assert parse_system("kara-topk+lazy3:0.9", BASE).lazy_keep == 0.9
    bad_cases = [
        ("nope@0.2", "unknown method 'nope'"),
        ("kara@1.5", "retention"),
        ("kara@", "must be"),
        ("kara+lazy0@0.2", "lazy"),
        ("kara-threshold+lazy2@0.2", "periodic policy"),
        ("snapkv+lazy2@0.2", "no single window score"),
    ]
    for bad, why in bad_cases:
        with pytest.raises(ValueError, match=why):
            parse_system(bad, BASE)
    # A calibrated method needs its file.
    with pytest.raises(ValueError, match="calibration"):
        parse_system("kara-retain@0.2", BASE)


def _records(rights: list[int], stopped: list[bool], tokens: list[int], answered: list[bool] | None = None) -> list:
    return [
        {"seed": i, "tokens": t, "cap_hit": t >= 3200, "right": r, "statements": 10, "extra": max(0, 10 - r) if not s
         else 0, "stopped": s, "answered": (answered or [False] * len(rights))[i], "answer_grade": False,
         "held_end": 1.0}
        for i, (r, s, t) in enumerate(zip(rights, stopped, tokens, strict=True))
    ]  # fmt: skip


def _row(system: str, repeat: int, seconds: float, records: list[dict[str, Any]]) -> dict[str, Any]:
    right = sum(r["right"] for r in records)
    return {
        "system": system, "pool": "8x", "concurrency": 4, "repeat": repeat, "pool_blocks": 100, "cap": 3200,
        "compression": {} if system.startswith("vanilla") else {"retention": 0.2, "window": 128, "buffer": 32},
        "seconds": seconds, "tok_s": sum(r["tokens"] for r in records) / seconds, "statements_right_s": right / seconds,
        "answers_right_s": sum(r["answered"] for r in records) / seconds, "preemptions": 0, "compress_share": 0.02,
        "records": records,
    }  # fmt: skip


def _rows() -> list[dict[str, Any]]:
    full = _records([10] * 4, [True] * 4, [100] * 4, [True, True, False, False])
    lossless = _records([10] * 4, [True] * 4, [101] * 4, [True, False, True, False])
    lossy = _records([5, 6, 10, 4], [False, False, True, False], [180, 170, 100, 190])
    rows = []
    for repeat in range(2):
        rows += [
            _row("vanilla-default", repeat, 10.0 + repeat, full),
            _row("vanilla-unlimited", repeat, 8.0, full),
            _row("kara@0.5", repeat, 5.0, lossless),
            _row("kara@0.2", repeat, 4.0, lossy),
        ]
    return rows


def test_the_report_grades_pairs_and_ratios_crafted_rows() -> None:
    summary = {e["system"]: e for e in summarize(_rows())}
    lossless, lossy = summary["kara@0.5"], summary["kara@0.2"]
    assert lossless["statements_ratio"][0] == 1.0 and lossless["stopped_ratio"] == 1.0
    assert keeps_accuracy(lossless) and not keeps_accuracy(lossy)
    # Statements right over the program's plus the extra lines: 25 of 40 + 15.
    assert lossy["statements_share"] == pytest.approx(25 / 55)
    assert lossy["stopped_right"] == 1 and lossy["length_ratio"] == pytest.approx(160 / 100)
    # Goodput ratios within each repeat: (40/5) / (40/10) and (40/5) / (40/11).
    ratio = lossless["statements_right_s_ratio"]
    assert ratio == pytest.approx(((2.0 + 2.2) / 2, 2.0, 2.2))
    assert lossless["wall_ratio"][0] == pytest.approx((0.5 + 5 / 11) / 2)
    # A system that writes nothing right in a repeat has goodput 0 there, not no ratio.
    zero = [{**r, "statements_right_s": 0.0} if r["system"] == "kara@0.2" and r["repeat"] == 1 else r for r in _rows()]
    lossy_zero = {e["system"]: e for e in summarize(zero)}["kara@0.2"]["statements_right_s_ratio"]
    assert lossy_zero[1] == 0.0 and lossy_zero[0] == pytest.approx((25 / 4) / (40 / 10) / 2)
    best = {row["method"]: row for row in iso_accuracy(summarize(_rows()))}
    assert best["kara"]["best"]["system"] == "kara@0.5"
    text = markdown(summarize(_rows()), command="kvllm bench goodput --x")
    assert "kvllm bench goodput --x" in text and "| 8x | 4 | kara | kara@0.5 |" in text
    assert "is 32.00x it" in text  # the cap against Full KV's longest chain, 100 tokens


def test_a_method_that_never_keeps_accuracy_is_reported_by_its_most_accurate_cell() -> None:
    rows = [r for r in _rows() if r["system"] != "kara@0.5"]
    (row,) = [r for r in iso_accuracy(summarize(rows)) if r["method"] == "kara"]
    assert row["best"] is None and row["closest"]["system"] == "kara@0.2"
    assert "kara@0.2 (none keeps it; the most accurate)" in markdown(summarize(rows))


def test_the_plot_is_drawn_from_stored_rows(tmp_path: Path) -> None:
    path = plot(summarize(_rows()), tmp_path / "goodput.png")
    assert path.stat().st_size > 0


def test_a_rerun_resumes_and_runs_only_the_missing_cells(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cells already in results.jsonl are never run again; completions are kept for repeat 0."""
    run = Goodput(model="m", out=tmp_path, systems=("vanilla-default", "kara@0.2"), repeats=2, seeds=(0, 2))
    monkeypatch.setattr(Goodput, "lengths", ([600, 610], [2000, 2100]))
    ran: list[tuple] = []

    def fake(cell: goodput.Cell) -> dict[str, Any]:
        ran.append(cell.key)
        records = _records([10, 10], [True, True], [100, 100])
        return {**_row(cell.system, cell.repeat, 10.0, records), "texts": ["a", "b"], "concurrency": cell.concurrency}

    monkeypatch.setattr(goodput, "_run_cell", fake)
    first = [c.key for c in run.cells()]
    assert [k[0] for k in first] == ["vanilla-default", "kara@0.2", "kara@0.2", "vanilla-default"]  # rotated
    ran.clear()
    rows = goodput.run_goodput(Goodput(model="m", out=tmp_path, systems=("vanilla-default",), repeats=1, seeds=(0, 2)))
    assert len(rows) == 1 and len(ran) == 1
    rows = goodput.run_goodput(run)
    assert len(rows) == 4 and len(ran) == 4  # the stored cell was not run again
    with gzip.open(goodput.completions_path(tmp_path, rows[0]), "rt") as f:
        assert [json.loads(line)["text"] for line in f] == ["a", "b"]


def test_bad_runs_fail_before_any_engine(tmp_path: Path) -> None:
    for kwargs, why in [
        ({"family": "nope"}, "--family 'nope'"),
        ({"pools": ("eight",)}, "--pool 'eight'"),
        ({"repeats": 0}, "--repeats 0"),
        ({"seeds": (5, 5)}, "--test-seeds 5:5"),
        ({"systems": ("kara@2",)}, "kara@2"),
    ]:
        with pytest.raises(ValueError, match=why):
            Goodput(model="m", out=tmp_path, **kwargs).cells()


@pytest.mark.slow
def test_a_small_run_end_to_end(tmp_path: Path) -> None:
    """The shipped kara-reasoner-6l on one held-out reason task: Full KV writes its chain
    right and stops at its own EOS, well under the cap; a cap below the chain's length is
    hit and charged; completions, summary and plot are written."""
    from typer.testing import CliRunner

    from kvllm.cli import app

    args = ["bench", "goodput", "--test-seeds", "0:1", "--concurrency", "1", "--repeats", "1", "--out", str(tmp_path)]
    result = CliRunner().invoke(app, [*args, "--system", "vanilla-default,kara@0.2", "--cap", "2400"])
    assert result.exit_code == 0, result.output
    rows = {r["system"]: r for r in goodput.load_rows(tmp_path)}
    (full,) = rows["vanilla-default"]["records"]
    assert full["stopped"] and not full["cap_hit"] and full["right"] == full["statements"] == 84
    assert full["tokens"] < 2400
    assert rows["kara@0.2"]["rounds"] > 0 and rows["kara@0.2"]["preemptions"] == 0
    assert (tmp_path / "summary.md").exists() and (tmp_path / "goodput.png").stat().st_size > 0
    assert len(list((tmp_path / "completions").glob("*.jsonl.gz"))) == 2
