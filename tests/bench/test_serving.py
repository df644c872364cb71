"""`kvllm bench serve` end to end on a tiny grid: two real servers, vLLM's own client."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvllm.bench.serving import ServeBench, client_args
from kvllm.bench.serving_report import markdown_table, summarize
from kvllm.cli import app
from kvllm.testing import save_tiny_model


@pytest.mark.slow
def test_bench_serve_compares_the_two_servers(tmp_path: Path) -> None:
    model = save_tiny_model(tmp_path / "model", seed=1, hidden_size=128, layers=2, heads=4, kv_heads=2, head_dim=32)
    out = tmp_path / "bench"
    args = ["bench", "serve", "--model", str(model), "--concurrency", "2", "--prompts", "4", "--input-len", "16"]
    args += ["--output-len", "96", "--pool", "16", "--max-num-seqs", "4", "--repeats", "1"]
    args += ["--window", "32", "--buffer", "8", "--period", "4", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = {r["system"]: r for r in json.loads((out / "results.json").read_text())}
    assert set(rows) == {"vanilla", "kara"}
    for r in rows.values():
        assert r["completed"] == 4 and r["output_throughput"] > 0
        assert 0 < r["p50_ttft_ms"] <= r["p99_ttft_ms"] and 0 < r["p50_itl_ms"] <= r["p99_itl_ms"]
    # The counters come from each server's /metrics: only kvllm serve compresses.
    assert rows["vanilla"]["rounds"] == 0 and rows["kara"]["rounds"] >= 4
    kara = next(c for c in json.loads((out / "summary.json").read_text()) if c["system"] == "kara")
    assert kara["output_throughput_ratio"][0] > 0
    assert (out / "serving.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pool_blocks": 4}, "--pool 4 is invalid: one request"),
        ({"systems": ("fast",)}, "--system"),
        ({"concurrency": (), "rates": ()}, "give at least one load point"),
        ({"concurrency": (500,)}, "--max-num-seqs"),
        ({"rates": (0.0,)}, "--rate"),
    ],
)
def test_bad_serving_benchmarks_fail_before_any_server(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ServeBench(model="m", out=tmp_path, **kwargs)


def test_ratios_to_vanilla_are_taken_within_a_repeat() -> None:
    def row(system: str, repeat: int, tok: float, ttft: float) -> dict:
        base = {"system": system, "repeat": repeat, "load": "concurrency", "value": 8.0, "preemptions": 0, "rounds": 0}
        figures = {f"p{p}_{f}_ms": ttft for f in ("ttft", "tpot", "itl") for p in (50, 90, 99)}
        return {**base, **figures, "output_throughput": tok}

    rows = [row("vanilla", 0, 100, 10), row("kara", 0, 150, 5), row("vanilla", 1, 200, 20), row("kara", 1, 400, 20)]
    kara = next(c for c in summarize(rows) if c["system"] == "kara")
    assert kara["output_throughput_ratio"] == [1.75, 1.5, 2.0]
    assert kara["p99_ttft_ms_ratio"] == [0.75, 0.5, 1.0]
    assert "| C=8 | kara | 275 [150-400] |" in markdown_table(summarize(rows))


def test_a_shared_prefix_reaches_vllms_client_and_the_limits(tmp_path: Path) -> None:
    bench = ServeBench(model="m", out=tmp_path, prefix_len=1000, input_len=150, output_len=512, pool_blocks=60)
    args = client_args(bench, "http://127.0.0.1:1", "concurrency", 4.0, tmp_path)
    assert (args.random_prefix_len, args.random_input_len) == (1000, 150)
    flags = bench.server_flags()
    assert flags[flags.index("--max-model-len") + 1] == str(1000 + 150 + 512 + 64)
    # One request of prefix + prompt + output needs 52 blocks of 32, plus one.
    with pytest.raises(ValueError, match="--prefix-len 1000 \\+ --input-len 150"):
        ServeBench(model="m", out=tmp_path, prefix_len=1000, input_len=150, output_len=512, pool_blocks=52)
    with pytest.raises(ValueError, match="--prefix-len -1 is invalid"):
        ServeBench(model="m", out=tmp_path, prefix_len=-1)
