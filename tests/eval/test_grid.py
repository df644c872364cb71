"""Smoke test of `kvllm eval` on a tiny grid, and of resuming."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvllm.cli import app
from kvllm.eval.grid import FULL, MODEL_FILE, cells, load_results, run_accuracy_cell
from kvllm.eval.problems import Problem
from kvllm.testing import save_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_cells_share_full_kv() -> None:
    grid = cells(["kara", "snapkv"], [0.2, 1.0], ["trace"])
    assert grid == [(FULL, 1.0, "trace", "free"), ("kara", 0.2, "trace", "free"), ("snapkv", 0.2, "trace", "free")]
    forced = cells(["kara"], [0.2], ["trace"], "teacher-forced")
    # Teacher-forced cells force the free Full-KV cell's completions: it always runs.
    assert forced == [(FULL, 1.0, "trace", "free"), ("kara", 0.2, "trace", "teacher-forced")]
    # Reference-forced cells force the tasks' own chains: no free cell, Full KV only when asked.
    assert cells(["kara"], [0.2], ["reason"], "reference-forced") == [("kara", 0.2, "reason", "reference-forced")]
    assert cells(["kara"], [0.2, 1.0], ["reason"], "reference-forced") == [
        (FULL, 1.0, "reason", "reference-forced"),
        ("kara", 0.2, "reason", "reference-forced"),
    ]
    with pytest.raises(ValueError, match="mode='forced' is invalid"):
        cells(["kara"], [0.2], ["trace"], "forced")


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
        (FULL, 1.0, "trace", "free", 32, 8),
        *((m, 0.25, "trace", "free", 32, 8) for m in ("kara", "snapkv")),
    }
    # Another model's weights (the same shape and name, retrained in place, say) do not
    # resume this model's cells: the folder records which weights ran them.
    recorded = json.loads((out / MODEL_FILE).read_text())
    assert recorded["model"] == str(tiny) and len(recorded["sha256"]) == 64
    other = save_tiny_model(tmp_path / "other", seed=1)
    swapped = CliRunner().invoke(app, [*args[:2], str(other), *args[3:]])
    assert swapped.exit_code != 0
    assert "holds cells of another model" in " ".join(swapped.output.replace("│", " ").split())
    assert (out / "results.jsonl").read_text().splitlines() == lines
    # Nor do other tasks of the same family (here deeper programs): the folder records them too.
    assert set(recorded["tasks"]) == {"trace"}
    steps = args.index("--steps") + 1
    deeper = CliRunner().invoke(app, [*args[:steps], "7", *args[steps + 1 :]])
    assert deeper.exit_code != 0
    assert "holds trace cells of other tasks" in " ".join(deeper.output.replace("│", " ").split())
    assert (out / "results.jsonl").read_text().splitlines() == lines


def test_eval_rejects_bad_grid(tiny: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["eval", "--model", str(tiny), "--out", str(tmp_path), "--retention", "0"])
    assert result.exit_code != 0
    assert "--retention 0.0 is invalid" in " ".join(result.output.split())


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


def test_eval_teacher_forced_with_the_oracle_and_the_bound(tmp_path: Path) -> None:
    """On the shipped model (a random one writes no chain of thought to grade)."""
    out = tmp_path / "tf"
    args = ["eval", "--out", str(out), "--method", "kara,oracle,bound", "--retention", "0.25,1.0"]
    args += ["--family", "trace", "--n", "3", "--steps", "6", "--constants", "4", "--window", "32", "--buffer", "8"]
    result = CliRunner().invoke(app, [*args, "--period", "4", "--batch-size", "3", "--teacher-forced"])
    assert result.exit_code == 0, result.output
    cells = load_results(out / "results.jsonl")
    assert {(k[0], k[3]) for k in cells} == {
        (FULL, "free"),
        (FULL, "teacher-forced"),
        ("kara", "teacher-forced"),
        ("oracle", "teacher-forced"),
        ("bound", "teacher-forced"),
    }
    full_free = cells[(FULL, 1.0, "trace", "free", 32, 8)]
    full_tf = cells[(FULL, 1.0, "trace", "teacher-forced", 32, 8)]
    # Teacher-forced at retention 1.0 is Full KV, read for read.
    assert full_tf.fidelity_generated == full_free.fidelity_generated > 0.9
    assert [p["right"] for p in full_tf.problems] == [p["right"] for p in full_free.problems]
    kara = cells[("kara", 0.25, "trace", "teacher-forced", 32, 8)]
    assert kara.held_mean < 1.0 and kara.problems[0]["reads"] == full_free.problems[0]["reads"]
    # The bound runs under Kara's policy and rounds: the same memory, other keys.
    bound = cells[("bound", 0.25, "trace", "teacher-forced", 32, 8)]
    assert bound.held_mean == kara.held_mean and bound.params == {}
    # The floor is the forced text's: every teacher-forced cell grades the same non-modal reads.
    floor = [(p["modal_reads"], p["results"], p["modal_results"]) for p in full_free.problems]
    for cell in (full_tf, kara, bound):
        assert [(p["modal_reads"], p["results"], p["modal_results"]) for p in cell.problems] == floor
        total = sum(p["reads"]["generated"] - p["modal_reads"] for p in cell.problems)
        right = sum(p["right"]["generated"] - p["modal_right"] for p in cell.problems)
        assert cell.fidelity_nonmodal == right / total
        assert cell.floor == sum(f[0] for f in floor) / sum(p["reads"]["generated"] for p in cell.problems)
    assert full_tf.modal_result_share == sum(f[2] for f in floor) / sum(f[1] for f in floor)
    assert (out / "lookup.md").read_text().count("teacher-forced") >= 1
    assert (out / "frontier.png").stat().st_size > 0


def test_eval_free_running_with_the_bound(tmp_path: Path) -> None:
    """On the shipped model: the bound writes its own chains, under Kara's policy and rounds."""
    out = tmp_path / "free"
    args = ["eval", "--out", str(out), "--method", "kara,bound", "--retention", "0.25,1.0", "--n", "3"]
    args += ["--family", "trace", "--steps", "6", "--constants", "4", "--window", "32", "--buffer", "8"]
    result = CliRunner().invoke(app, [*args, "--period", "4", "--batch-size", "3"])
    assert result.exit_code == 0, result.output
    cells = load_results(out / "results.jsonl")
    assert {(k[0], k[3]) for k in cells} == {(FULL, "free"), ("kara", "free"), ("bound", "free")}
    bound = cells[("bound", 0.25, "trace", "free", 32, 8)]
    assert bound.params == {} and bound.statements is not None and bound.held_mean < 1.0
    assert len(bound.problems) == 3


def test_selectors_refuse_what_they_cannot_read_before_any_pass() -> None:
    math = Problem("math", "0", "1 + 1 = ?", "2", 16, grader="math")  # no reference chain
    task = Problem("trace", "0", "trace: ...", "7", 16, reference=" a = 7\n")
    with pytest.raises(ValueError, match="the bound runs free only on generated tasks"):
        run_accuracy_cell(None, None, [math], None, batch_size=1, selector="bound")
    with pytest.raises(ValueError, match="the oracle runs teacher-forced only"):
        run_accuracy_cell(None, None, [task], None, batch_size=1, selector="oracle")


def test_eval_reference_forced_grades_the_tasks_own_chains(tmp_path: Path) -> None:
    """On the shipped model: the tasks' reference chains forced through each cache, no free cell."""
    from transformers import AutoTokenizer

    from kvllm.assets import model_path
    from kvllm.eval import lookup
    from kvllm.eval.tasks import Difficulty, make_task

    out = tmp_path / "rf"
    args = ["eval", "--out", str(out), "--method", "kara,oracle", "--retention", "0.25,1.0", "--n", "3"]
    args += ["--family", "trace,gen-needle", "--steps", "6", "--constants", "4", "--window", "32", "--buffer", "8"]
    result = CliRunner().invoke(app, [*args, "--period", "4", "--batch-size", "3", "--reference-forced"])
    assert result.exit_code == 0, result.output
    cells = load_results(out / "results.jsonl")
    assert {(k[0], k[2], k[3]) for k in cells} == {
        (m, f, "reference-forced") for m in (FULL, "kara", "oracle") for f in ("trace", "gen-needle")
    }
    tokenizer = AutoTokenizer.from_pretrained(model_path())
    for family in ("trace", "gen-needle"):
        full = cells[(FULL, 1.0, family, "reference-forced", 32, 8)]
        kara = cells[("kara", 0.25, family, "reference-forced", 32, 8)]
        assert kara.held_mean < 1.0 == full.held_mean
        for i, seed in enumerate(range(3)):
            task = make_task(family, seed, Difficulty(constants=4, steps=6))
            # The graded reads and the floor are the reference chain's, in every cell.
            reference = lookup.tally(task.prompt, task.target, 32)
            for cell in (full, kara):
                assert cell.problems[i]["reads"] == reference.reads
                assert cell.problems[i]["modal_reads"] == reference.modal_reads
                assert cell.problems[i]["new_tokens"] == len(tokenizer(task.target)["input_ids"])
        # The shipped model reads the reference chains back with Full KV (about 0.99, docs/results/accuracy.md).
        assert full.fidelity_generated > 0.9
        # Recall is graded on the argmax at the answer: defined for gen-needle only.
        assert (full.recall is None) == (family == "trace")


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--method", "oracle"], "--method oracle is invalid without --teacher-forced"),
        (["--method", "nope"], "CompressionConfig.method='nope'"),
        (["--family", "nope"], "--family 'nope' is invalid"),
        (["--op", "mul"], "Difficulty.op='mul' is invalid: must be one of add, shift"),
        (["--retention", "1.5"], "--retention 1.5 is invalid: must be in (0, 1]"),
        (["--dev-seeds", "0:10", "--test-seeds", "5:20"], "overlap"),
        (["--test-seeds", "20:10"], "--test-seeds '20:10' is invalid"),
        (["--split", "train"], "--split 'train' is invalid"),
        (["--n", "11", "--test-seeds", "0:10"], "--n 11 is invalid"),
        (["--method", "kara", "--param", "snapkv:obs_window=8"], "is invalid: 'snapkv' is not among"),
        (["--method", "kara", "--param", "kara:nope=1"], "nope"),
        (["--method", "kara,oracle", "--teacher-forced", "--param", "oracle:band=2"], "the oracle takes none"),
        (["--teacher-forced", "--reference-forced"], "--teacher-forced and --reference-forced are exclusive"),
        (["--reference-forced", "--math-jsonl", "x.jsonl"], "--reference-forced is invalid with --math-jsonl"),
    ],
)
def test_eval_rejects_bad_flags(tiny: Path, tmp_path: Path, extra: list[str], fragment: str) -> None:
    result = CliRunner().invoke(app, ["eval", "--model", str(tiny), "--out", str(tmp_path), *extra])
    assert result.exit_code != 0
    assert fragment in " ".join(result.output.split()), result.output


def test_method_params_scope_to_their_method() -> None:
    from kvllm.cli.evaluate import method_params

    got = method_params({"obs_window": 16, "snapkv:pool_kernel": 3, "chunkkv:chunk_size": 5}, ["snapkv", "chunkkv"])
    assert got == {"snapkv": {"obs_window": 16, "pool_kernel": 3}, "chunkkv": {"obs_window": 16, "chunk_size": 5}}


def test_per_method_params_are_applied_and_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import asdict

    from kvllm import CompressionConfig
    from kvllm.cli.options import load_model
    from kvllm.eval.grid import run_grid
    from kvllm.eval.problems import task_problems
    from kvllm.eval.tasks import Difficulty
    from kvllm.methods import Method, Selection, Window
    from kvllm.methods.kara import Kara
    from kvllm.methods.snapkv import SnapKV

    # What each method's select ran with, round by round: the override must reach the
    # method, not only the record.
    ran: dict[str, list[dict]] = {"kara": [], "snapkv": []}
    for cls in (Kara, SnapKV):

        def spy(self: Method, window: Window, budget: int, original=cls.select) -> Selection:
            ran[self.name].append(asdict(self.params))
            return original(self, window, budget)

        monkeypatch.setattr(cls, "select", spy)
    tok, lm = load_model(None)
    problems = {"trace": task_problems("trace", 2, Difficulty(constants=4, steps=6), tok)}
    base = CompressionConfig(window=32, buffer=8, period=4)
    got = run_grid(lm, tok, problems, ["kara", "snapkv"], [0.25], base, tmp_path, params={"snapkv": {"obs_window": 8}})
    params = {c.method: c.params for c in got}
    # Resolved: the defaults and the override, as the cell ran.
    assert params == {"kara": {"rho": 0.5, "beta": 1.0, "max_gap": 16}, "snapkv": {"obs_window": 8, "pool_kernel": 7}}
    # ...and as the methods ran: rounds ran in both cells, each with its cell's params.
    assert ran["kara"] and ran["snapkv"]
    for method, seen in ran.items():
        assert all(p == params[method] for p in seen), (method, seen)
    with pytest.raises(ValueError, match="nope"):
        run_grid(lm, tok, problems, ["kara", "snapkv"], [0.25], base, tmp_path / "bad", params={"snapkv": {"nope": 1}})
    # Resuming with other params would mix two settings under one key.
    with pytest.raises(ValueError, match="run with params"):
        run_grid(lm, tok, problems, ["snapkv"], [0.25], base, tmp_path, params={"snapkv": {"obs_window": 16}})
