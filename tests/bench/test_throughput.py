"""`kvllm bench throughput` end to end on a tiny grid: real engines, in subprocesses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvllm.cli import app
from kvllm.testing import save_tiny_model


@pytest.mark.slow
def test_bench_throughput_writes_a_sane_report(tmp_path: Path) -> None:
    model = save_tiny_model(tmp_path / "model", seed=1, hidden_size=128, layers=2, heads=4, kv_heads=2, head_dim=32)
    out = tmp_path / "bench"
    args = ["bench", "throughput", "--model", str(model), "--system", "vanilla", "--system", "kara"]
    args += ["--concurrency", "4", "--pool", "16", "--repeats", "1", "--output-tokens", "96", "--requests", "4"]
    args += ["--window", "32", "--buffer", "8", "--period", "4", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = json.loads((out / "results.json").read_text())
    by = {r["system"]: r for r in rows}
    assert set(by) == {"vanilla", "kara"}
    for r in rows:
        assert r["output_tokens"] == 4 * 96  # EOS ignored: equal work
        assert r["tok_s"] > 0 and r["mean_tpot_ms"] > 0
        assert 1 <= r["peak_running"] <= 4
        assert 0 < r["peak_pool_usage"] <= 1
    assert by["vanilla"]["rounds"] == 0 and by["vanilla"]["compress_seconds"] == 0
    assert by["kara"]["rounds"] > 0 and by["kara"]["compress_seconds"] > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mean_ratio"]["kara"]["16"] > 0
    for name in ("results.csv", "throughput.png", "pool_usage.png"):
        assert (out / name).stat().st_size > 0
    # Rerunning resumes: every cell is already there, no engine starts.
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0, again.output
    assert json.loads((out / "results.json").read_text()) == rows


def test_bench_throughput_rejects_a_bad_grid(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["bench", "throughput", "--model", str(tmp_path), "--repeats", "0"])
    assert result.exit_code != 0
    assert "repeats=0" in result.output


def test_bench_throughput_rejects_a_bad_shape(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["bench", "throughput", "--shape", "qwen9-huge", "--out", str(tmp_path)])
    assert result.exit_code != 0
    assert "--shape 'qwen9-huge' is invalid: must be one of tiny-qwen3" in result.output
    both = CliRunner().invoke(app, ["bench", "throughput", "--shape", "tiny-qwen3", "--model", str(tmp_path)])
    assert both.exit_code != 0 and "give --model or --shape, not both" in both.output
