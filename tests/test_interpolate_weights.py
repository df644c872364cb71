"""tools/interpolate_weights.py: a weighted mean of two checkpoints of one shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tools.interpolate_weights import WEIGHTS, interpolate


def _checkpoint(folder: Path, value: float, shape: tuple[int, ...] = (2, 3)) -> Path:
    folder.mkdir()
    save_file({"w": torch.full(shape, value)}, folder / WEIGHTS)
    (folder / "config.json").write_text(json.dumps({"value": value}))
    (folder / "training.json").write_text(json.dumps({"args": {"op": "shift"}}))
    return folder


def test_the_mix_is_weighted_and_keeps_the_tuned_files(tmp_path: Path) -> None:
    base, tuned = _checkpoint(tmp_path / "base", 1.0), _checkpoint(tmp_path / "tuned", 3.0)
    interpolate(base, tuned, 0.25, tmp_path / "out")
    assert torch.equal(load_file(tmp_path / "out" / WEIGHTS)["w"], torch.full((2, 3), 1.5))
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == {"value": 3.0}
    summary = json.loads((tmp_path / "out" / "training.json").read_text())
    assert summary["args"]["op"] == "shift" and summary["interpolation"]["alpha"] == 0.25


def test_other_shapes_and_a_bad_alpha_are_refused(tmp_path: Path) -> None:
    base, other = _checkpoint(tmp_path / "base", 1.0), _checkpoint(tmp_path / "other", 1.0, (3, 2))
    with pytest.raises(ValueError, match="other names or shapes"):
        interpolate(base, other, 0.5, tmp_path / "out")
    with pytest.raises(ValueError, match=r"ALPHA 1.5 is invalid: must be in \[0, 1\]"):
        interpolate(base, base, 1.5, tmp_path / "out")
