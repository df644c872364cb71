"""Smoke test of `kvllm eval` on a tiny grid, and of resuming."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvllm.cli import app
from kvllm.eval.grid import FULL, cells, load_results
from kvllm.testing import save_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_cells_share_full_kv() -> None:
    grid = cells(["kara", "snapkv"], [0.2, 1.0], ["trace"])
    assert grid == [(FULL, 1.0, "trace"), ("kara", 0.2, "trace"), ("snapkv", 0.2, "trace")]


def test_eval_tiny_grid_writes_reports_and_resumes(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "eval"
    args = [
        "eval",
        "--model",
        str(tiny),
        "--out",
        str(out),
        "--method",
        "kara,snapkv",
        "--retention",
        "0.25,1.0",
        "--family",
        "trace",
        "--n",
        "4",
        "--steps",
        "6",
        "--constants",
        "4",
        "--window",
        "32",
        "--buffer",
        "8",
        "--period",
        "4",
        "--batch-size",
        "2",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    for name in ("results.jsonl", "results.csv", "results.json", "results.md", "accuracy.png"):
        assert (out / name).stat().st_size > 0
    rows = json.loads((out / "results.json").read_text())
    assert {(r["method"], r["retention"]) for r in rows} == {(FULL, 1.0), ("kara", 0.25), ("snapkv", 0.25)}
    for r in rows:
        assert r["n"] == 4 and 0 <= r["correct"] <= 4 and r["accuracy"] == r["correct"] / 4
        assert r["mean_new_tokens"] > 0 and 0 < r["mean_kept"] <= 1.0
    full = next(r for r in rows if r["method"] == FULL)
    assert full["mean_kept"] == 1.0
    lines = (out / "results.jsonl").read_text().splitlines()
    assert len(lines) == 3

    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0, again.output
    assert (out / "results.jsonl").read_text().splitlines() == lines  # resumed: nothing re-run
    assert set(load_results(out / "results.jsonl")) == {
        (FULL, 1.0, "trace"),
        *((m, 0.25, "trace") for m in ("kara", "snapkv")),
    }


def test_eval_rejects_bad_grid(tiny: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["eval", "--model", str(tiny), "--out", str(tmp_path), "--retention", "0"])
    assert result.exit_code != 0
    assert "retention=0.0" in result.output


def test_plot_of_a_full_kv_only_grid(tmp_path: Path) -> None:
    from kvllm.eval.grid import CellResult
    from kvllm.eval.report import accuracy_table, plot_accuracy

    results = [
        CellResult(FULL, 1.0, family, 2, 1, 0.5, 10.0, 1.0, 0.1, [True, False]) for family in ("trace", "gen-needle")
    ]
    assert accuracy_table(results)["trace"] == {FULL: {1.0: 0.5}}
    assert plot_accuracy(results, tmp_path / "a.png").stat().st_size > 0


def test_markdown_tables_put_full_kv_at_retention_one() -> None:
    from kvllm.eval.grid import CellResult
    from kvllm.eval.report import accuracy_markdown

    def cell(method: str, retention: float, family: str, accuracy: float) -> CellResult:
        return CellResult(method, retention, family, 4, round(4 * accuracy), accuracy, 10.0, 1.0, 0.1, [])

    results = [
        cell(FULL, 1.0, "trace", 1.0),
        cell("kara", 0.2, "trace", 0.75),
        cell(FULL, 1.0, "gen-needle", 0.5),
        cell("kara", 0.2, "gen-needle", 0.25),
    ]
    md = accuracy_markdown(results)
    assert "| kara | 75.0 | 100.0 |" in md
    assert "| kara | 25.0 | 50.0 |" in md
    # The mean over families: (75 + 25) / 2 and (100 + 50) / 2.
    assert md.split("**mean**")[1].count("| kara | 50.0 | 75.0 |") == 1
