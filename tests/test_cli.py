from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvllm.cli import app
from kvllm.testing import save_tiny_model

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_generate_prints_text_and_stats(tiny: Path) -> None:
    args = ["generate", "--model", str(tiny), "--window", "32", "--buffer", "8", "--period", "4"]
    result = runner.invoke(app, [*args, "--max-new-tokens", "80", "let v1 = 5 then compute"])
    assert result.exit_code == 0, result.output
    assert "cache statistics (kara, retention 0.2)" in result.output
    assert "tokens/s" in result.output


def test_generate_grades_held_out_tasks(tiny: Path) -> None:
    args = ["generate", "--model", str(tiny), "--task", "trace", "--n-tasks", "2", "--steps", "3"]
    result = runner.invoke(app, [*args, "--max-new-tokens", "20", "--method", "none"])
    assert result.exit_code == 0, result.output
    # A random model answers nothing: both are graded, and wrong.
    assert result.output.count("answer None (expected ") == 2
    assert result.output.count(": wrong") == 2
    missing = runner.invoke(app, ["generate", "--model", str(tiny)])
    assert missing.exit_code != 0 and "give PROMPTS or --task" in missing.output


def test_generate_rejects_bad_config(tiny: Path) -> None:
    result = runner.invoke(app, ["generate", "--model", str(tiny), "--retention", "0", "a prompt here"])
    assert result.exit_code != 0
    assert "retention=0.0" in result.output and "(0, 1]" in result.output


def test_bench_selection_runs_on_a_small_shape() -> None:
    args = ["bench", "selection", "--method", "kara", "--method", "snapkv", "--layers", "2", "--heads", "4"]
    result = runner.invoke(app, [*args, "--kv-heads", "2", "--head-dim", "16", "--repeats", "2"])
    assert result.exit_code == 0, result.output
    assert "kara" in result.output and "snapkv" in result.output
