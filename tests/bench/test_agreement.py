"""The vLLM-against-transformers agreement of the statement grade, on crafted folders."""

from __future__ import annotations

import gzip
import json
from dataclasses import asdict
from pathlib import Path

import pytest

from kvllm.bench.agreement import agreement, first_difference, markdown
from kvllm.bench.goodput import completions_path
from kvllm.eval import grid
from kvllm.eval.grid import CellResult

SEEDS = range(4)
CHAIN = "\n a = b : b = b01 : b01 = a02\n c = a : a = a02 : a02 = c03\n</think>\n c03"


def _write_gz(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def _goodput(out: Path, system: str, compression: dict, rights: list[list[int]], texts: list[str]) -> None:
    """One system's rows, a repeat per entry of ``rights`` (10 statements per task)."""
    out.mkdir(parents=True, exist_ok=True)
    with (out / "results.jsonl").open("a") as f:
        for repeat, right in enumerate(rights):
            records = [
                {"seed": s, "right": r, "statements": 10, "extra": 0, "stopped": r == 10}
                for s, r in zip(SEEDS, right, strict=True)
            ]
            row = {"system": system, "family": "reason", "pool": "8x", "concurrency": 4, "repeat": repeat,
                   "compression": compression, "records": records}  # fmt: skip
            f.write(json.dumps(row) + "\n")
            if repeat == 0:
                _write_gz(
                    completions_path(out, row), [{"seed": s, "text": t} for s, t in zip(SEEDS, texts, strict=True)]
                )


def _cell(out: Path, method: str, retention: float, right: list[int], texts: list[str]) -> None:
    problems = [
        {"uid": str(s), "statements": {"right": r, "total": 10, "stopped": r == 10, "answered": False}}
        for s, r in zip(SEEDS, right, strict=True)
    ]
    cell = CellResult(method=method, retention=retention, family="reason", n=len(right), correct=0, accuracy=0.0,
                      mean_new_tokens=100.0, mean_kept=1.0, seconds=1.0, per_problem=[False] * len(right),
                      statements=sum(right) / (10 * len(right)), problems=problems)  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    with (out / "results.jsonl").open("a") as f:
        f.write(json.dumps(asdict(cell)) + "\n")
    _write_gz(
        grid.completions_path(out, cell.key), [{"uid": str(s), "text": t} for s, t in zip(SEEDS, texts, strict=True)]
    )


KARA = {"method": "kara", "retention": 0.2, "window": 128, "buffer": 32}


def test_first_difference_is_the_first_differing_line() -> None:
    assert first_difference(CHAIN, CHAIN) is None
    assert first_difference(CHAIN, CHAIN.replace("c03", "c04", 1)) == 2
    assert first_difference(CHAIN, CHAIN + "\n more") is None  # the same chain under a longer cap
    assert first_difference(CHAIN + "\n less", CHAIN + "\n more") == 5


def test_matching_systems_are_paired_seed_by_seed(tmp_path: Path) -> None:
    gp, ev = tmp_path / "goodput", tmp_path / "eval"
    other = CHAIN.replace("a02", "a05")
    _goodput(gp, "vanilla-default", {}, [[10] * 4, [10] * 4], [CHAIN] * 4)
    _goodput(gp, "kara@0.2", KARA, [[10, 8, 6, 4], [10, 8, 6, 2]], [CHAIN, other, other, CHAIN + "\n more"])
    _goodput(gp, "snapkv-periodic@0.2", {**KARA, "method": "snapkv"}, [[1] * 4], [CHAIN] * 4)  # no eval cell
    threshold = {**KARA, "policy": "threshold"}
    _goodput(gp, "kara-threshold@0.2", threshold, [[1] * 4], [CHAIN] * 4)  # kvllm eval has no threshold cells
    retain = {**KARA, "method": "kara-retain", "params": {"calibration": "a.safetensors"}}
    _goodput(gp, "kara-retain@0.2", retain, [[1] * 4], [CHAIN] * 4)  # calibrated: never matched
    _cell(ev, "kara-retain", 0.2, [10] * 4, [CHAIN] * 4)
    _cell(ev, "full", 1.0, [10] * 4, [CHAIN] * 4)
    _cell(ev, "kara", 0.3, [0] * 4, [CHAIN] * 4)  # another retention: never matched
    _cell(ev, "kara", 0.2, [10, 10, 10, 10], [CHAIN] * 4)

    by = {e["system"]: e for e in agreement(gp, ev)}
    assert set(by) == {"vanilla-default", "kara@0.2"}
    full, kara = by["vanilla-default"], by["kara@0.2"]
    assert (full["identical"], full["compared"], full["difference"][0]) == (4, 4, 0.0)
    assert kara["cell"] == "kara r=0.2 W=128 b=32"
    assert (kara["identical"], kara["same_length"], kara["first_difference"]) == (2, 1, 1)
    assert kara["vllm"] == pytest.approx((0.7, 0.65, 0.7))  # repeat 0, then min-max over repeats
    assert kara["hf"] == 1.0
    d, lo, hi = kara["difference"]
    assert d == pytest.approx(-0.3) and lo <= d <= hi < 0  # vLLM reads worse on these seeds
    assert kara["stopped"] == (1, 4)
    table = markdown(list(by.values()))
    assert "`kara@0.2` | kara r=0.2 W=128 b=32 | 4 | 2/4 (1) | 1 |" in table


def test_no_rows_or_no_cells_give_no_rows(tmp_path: Path) -> None:
    assert agreement(tmp_path / "none", tmp_path / "none") == []
