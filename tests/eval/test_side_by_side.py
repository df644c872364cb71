"""The side-by-side tables on crafted cells: columns, differences, claim (a)'s target."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from kvllm.eval.grid import FULL, CellResult
from kvllm.eval.side_by_side import columns, difference_table, equal_memory_table, markdown, target_table

MODE = "reference-forced"


def _cell(method: str, retention: float, family: str, right: list[int], recall: list[bool] | None, held: float):
    problems = [
        {"uid": str(i), "right": {"generated": r, "prompt": 0}, "reads": {"generated": 10, "prompt": 0},
         "recall": None if recall is None else recall[i]}
        for i, r in enumerate(right)
    ]  # fmt: skip
    return CellResult(
        method=method, retention=retention, family=family, n=len(right), correct=0, accuracy=0.0,
        mean_new_tokens=0.0, mean_kept=0.0, seconds=0.0, per_problem=[], mode=MODE,
        fidelity_generated=sum(right) / (10 * len(right)), recall=None if recall is None else sum(recall) / len(recall),
        held_mean=held, held_end=held, problems=problems,
    )  # fmt: skip


def _folder(path: Path, cells: list[CellResult]) -> Path:
    path.mkdir(parents=True)
    (path / "results.jsonl").write_text("".join(json.dumps(asdict(c)) + "\n" for c in cells))
    return path


def test_a_column_per_model_and_family_and_kara_against_each_baseline(tmp_path: Path) -> None:
    full = [10] * 8
    recall = [True] * 8
    six = _folder(
        tmp_path / "6l",
        [
            _cell(FULL, 1.0, "reason", full, recall, 1.0),
            _cell("kara", 0.2, "reason", [10] * 8, recall, 0.25),  # Kara keeps every read
            _cell("snapkv", 0.2, "reason", [5] * 8, recall, 0.25),
            _cell(FULL, 1.0, "trace", full, None, 1.0),
            _cell("kara", 0.2, "trace", [8] * 8, None, 0.5),
            _cell("snapkv", 0.2, "trace", [8] * 8, None, 0.5),
        ],
    )
    cols = columns({"6l": six}, MODE)
    # The stress test first, then the realistic family.
    assert [c.label for c in cols] == ["6l / trace", "6l / reason"]
    diff = difference_table(cols, ["snapkv"], [0.1, 0.2])
    # r=0.1 ran nowhere: no row. On reason Kara is 0.5 above on every problem; on trace level.
    assert len(diff) == 3
    assert diff[2] == "| snapkv | 0.2 | +0.000 [+0.000, +0.000] | +0.500 [+0.500, +0.500] above |"
    target = target_table(cols)
    assert target[2] == "| 6l / trace | 0.800 [0.800-0.800] missed | - | - | 0.50 / 0.50 missed |"
    assert target[3] == "| 6l / reason | 1.000 [1.000-1.000] met | 1.000 [1.000-1.000] met | 1.000 | 0.25 / 0.25 met |"
    md = markdown(cols, ["kara", "snapkv"], ["snapkv"], [0.2])
    assert "| kara | 0.800 [0.800-0.800] (0.50) | 1.000 [1.000-1.000] (0.25) |" in md


def test_cells_of_another_mode_or_window_are_left_out(tmp_path: Path) -> None:
    free = _cell("kara", 0.2, "trace", [1] * 4, None, 0.5)
    free = CellResult(**{**asdict(free), "mode": "free"})
    wide = CellResult(**{**asdict(_cell("kara", 0.2, "trace", [1] * 4, None, 0.5)), "window": 256})
    folder = _folder(tmp_path / "tiny", [free, wide])
    assert columns({"tiny": folder}, MODE) == []


def test_equal_memory_interpolates_the_baselines_curve_at_karas_memory(tmp_path: Path) -> None:
    """PyramidKV holds more at each r: at Kara's r=0.2 memory (0.35) its curve lies between
    its r=0.1 cell (0.34, 6 of 10 reads) and its r=0.2 cell (0.51, 9 of 10): 1/17 of the
    way, 0.6 + 0.3/17. Nothing of it reaches Kara's r=0.05 (0.22), and no curve is
    extrapolated; SnapKV's cells sit at Kara's memories (within the slack)."""
    cells = [
        _cell(FULL, 1.0, "reason", [10] * 4, None, 1.0),
        _cell("kara", 0.05, "reason", [4] * 4, None, 0.22),
        _cell("kara", 0.2, "reason", [8] * 4, None, 0.35),
        _cell("pyramidkv", 0.05, "reason", [5] * 4, None, 0.25),
        _cell("pyramidkv", 0.1, "reason", [6] * 4, None, 0.34),
        _cell("pyramidkv", 0.2, "reason", [9] * 4, None, 0.51),
        _cell("snapkv", 0.05, "reason", [3] * 4, None, 0.225),  # within the slack of 0.22
        _cell("snapkv", 0.2, "reason", [7] * 4, None, 0.35),
    ]
    cols = columns({"6l": _folder(tmp_path / "6l", cells)}, MODE)
    table = equal_memory_table(cols, ["pyramidkv", "snapkv"], [0.05, 0.2])
    assert table[0] == "| kara minus | kara's r | 6l / reason |"
    assert table[2:] == [
        "| pyramidkv | 0.2 | +0.182 [+0.182, +0.182] above (r=0.1-0.2) |",
        "| snapkv | 0.05 | +0.100 [+0.100, +0.100] above (r=0.05) |",
        "| snapkv | 0.2 | +0.100 [+0.100, +0.100] above (r=0.2) |",
    ]
    # Against the same-r table, PyramidKV at r=0.2 would put Kara below.
    assert "below" in difference_table(cols, ["pyramidkv"], [0.2])[2]
