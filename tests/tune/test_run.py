"""kvllm tune's runs: the search, resume and the report, with a fake engine; then a small
real run on a tiny model inside vLLM."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from typer.testing import CliRunner

from kvllm.cli import app
from kvllm.config import CompressionConfig
from kvllm.tune import Tune, TunePrompt, run_tune
from kvllm.tune.report import markdown, verdict

PROMPTS = tuple(TunePrompt(str(i), f"prompt {i}") for i in range(16))


def fake_engine(calls: list[str], passing_from: float) -> Any:
    """Full KV answers "<think>..</think>\\nA"; a run at retention >= ``passing_from``
    agrees, below it every other prompt's answer differs and its chains run long."""

    def serve(tune: Tune, config: CompressionConfig | None) -> dict[str, Any]:
        calls.append("full" if config is None else f"{config.method}@{config.retention:g}")
        good = config is None or config.retention >= passing_from
        outs = []
        for i in range(len(tune.prompts)):
            wrong = not good and i % 2
            n = 10 if not wrong else 14
            text = "<think>chain</think>\n" + ("B" if wrong else "A")
            physical = 5 + (n if config is None else round(n * config.retention))
            stats = None if config is None else {"kvllm": {"method": config.method, "physical_length": physical}}
            outs.append(
                SimpleNamespace(
                    outputs=[SimpleNamespace(text=text, token_ids=list(range(n)), finish_reason="stop")],
                    prompt_token_ids=[0] * 5,
                    kv_transfer_params=stats,
                )
            )
        return {"seconds": 1.0, "outputs": outs}

    return serve


def test_search_bisects_and_resumes(tmp_path: Path) -> None:
    calls: list[str] = []
    tune = Tune(model="m", out=tmp_path, prompts=PROMPTS, methods=("kara",), retentions=(0.5, 0.2), bisect=2)
    result = run_tune(tune, runner=fake_engine(calls, passing_from=0.3))
    # The grid, then 0.35 (passes) and 0.275 (fails) between 0.5 and 0.2.
    assert calls == ["full", "kara@0.5", "kara@0.2", "kara@0.35", "kara@0.275"]
    assert result["recommended"]["key"] == "kara@0.35/128/32/16"
    assert "--kv-compression kara --kv-retention 0.35" in verdict(result)
    assert "| `kara@0.2/128/32/16` |" in markdown(result)
    # A rerun serves nothing: every run is stored, Full KV's texts included.
    again: list[str] = []
    assert run_tune(tune, runner=fake_engine(again, passing_from=0.3)) == result
    assert again == []
    # Runs made in another pool, or with another cap, cannot be compared: refused, naming what changed.
    with pytest.raises(ValueError, match="another cap, concurrency"):
        run_tune(dataclasses.replace(tune, cap=64, concurrency=4), runner=fake_engine(again, passing_from=0.3))


def test_no_passing_setting_is_said_plainly(tmp_path: Path) -> None:
    tune = Tune(model="m", out=tmp_path, prompts=PROMPTS, methods=("kara",), retentions=(0.5, 0.2))
    result = run_tune(tune, runner=fake_engine([], passing_from=0.9))
    # Both lose the same answers: the one of less memory is the best tried.
    assert result["recommended"] is None and result["best_failing"]["key"] == "kara@0.2/128/32/16"
    assert verdict(result).startswith("No setting keeps the tolerances on this model")
    # It says what the best one misses: half its answers, and chains 1.2x as long.
    assert "misses: answers' 95% bound" in verdict(result) and "length's 95% interval" in verdict(result)


def test_a_small_real_run_inside_vllm(tmp_path: Path) -> None:
    """16 prompts on a tiny random model, Full KV and Kara at two retentions, through the
    command line: a stored run, a report and a figure, and JSON on request."""
    from kvllm.testing import save_tiny_model

    model = save_tiny_model(tmp_path / "model", seed=1, hidden_size=128, layers=2, heads=4, kv_heads=2, head_dim=32)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"let v{i} = {i} and compute the sum"}) + "\n" for i in range(16)))
    out = tmp_path / "tune"
    args = ["tune", str(model), "--prompts", str(prompts), "--method", "kara", "--retention", "0.5,0.2"]
    args += ["--window", "32", "--buffer", "8", "--period", "4", "--cap", "64", "--bisect", "0", "--out", str(out)]
    args += ["--enforce-eager"]  # compiling three engines would take longer than their runs
    # A pool of 128 blocks, not a share of the machine, which vLLM zeroes at each engine start.
    args += ["--num-gpu-blocks-override", "128"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads((out / "result.json").read_text())
    assert '"recommended"' in result.output  # --json printed it too
    assert data["prompts"] == 16 and data["grader"] == "agreement"
    assert [c["key"] for c in data["candidates"]] == ["kara@0.5/32/8/4", "kara@0.2/32/8/4"]
    held = [c["summary"]["kv_held"] for c in data["candidates"]]
    assert 0 < held[1] < held[0] < 1
    assert (out / "report.md").exists() and (out / "tune.png").stat().st_size > 0
    assert len((out / "runs.jsonl").read_text().splitlines()) == 3


def test_too_few_prompts_fail_before_any_engine(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n' * 3)
    result = CliRunner().invoke(app, ["tune", "kara-reasoner-tiny", "--prompts", str(prompts)])
    assert result.exit_code != 0 and "at least 16 are needed" in result.output
