"""The accuracy reports: the frontier's Pareto points and the headline tables."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvllm.eval.grid import FULL, CellResult
from kvllm.eval.report import headline_markdown, lookup_rows, pareto, plot_frontier


def _cell(
    method: str, retention: float, right: list[int], held: float, mode: str = "teacher-forced", modal: int | None = None
) -> CellResult:
    """Ten generated reads per problem, ``right[i]`` of them right; with ``modal``, the
    first four reads are of the chain's modal value and the first ``modal`` of those right."""
    problems = [
        {"uid": str(i), "right": {"generated": k, "prompt": 1}, "reads": {"generated": 10, "prompt": 1}, "recall": None}
        for i, k in enumerate(right)
    ]
    nonmodal = floor = None
    if modal is not None:
        for p in problems:
            p.update(modal_reads=4, modal_right=modal, results=5, modal_results=3)
        nonmodal, floor = (sum(right) - modal * len(right)) / (6 * len(right)), 0.4
    share = None if modal is None else 0.6
    fidelity = sum(right) / (10 * len(right))
    return CellResult(
        method, retention, "trace", len(right), 0, 0.0, 100.0, held, 1.0, [False] * len(right), mode=mode,
        fidelity_generated=fidelity, fidelity_prompt=1.0, held_mean=held, held_end=held, problems=problems,
        fidelity_nonmodal=nonmodal, floor=floor, modal_result_share=share,
    )  # fmt: skip


def test_pareto_keeps_the_points_nothing_beats() -> None:
    points = [(0.5, 0.7), (0.4, 0.6), (0.6, 0.65), (0.4, 0.55), (0.7, 0.9)]
    assert [points[i] for i in pareto(points)] == [(0.4, 0.6), (0.5, 0.7), (0.7, 0.9)]


def test_headline_tables_hold_every_cell_and_the_paired_differences(tmp_path: Path) -> None:
    results = [
        _cell(FULL, 1.0, [10, 10, 10, 10], 1.0),
        _cell("kara", 0.1, [6, 7, 8, 7], 0.4),
        _cell("kara", 0.2, [8, 8, 9, 7], 0.5),
        _cell("snapkv", 0.2, [6, 6, 7, 5], 0.5),
    ]
    md = headline_markdown(lookup_rows(results))
    assert "| kara | 0.700 [" in md and "(0.40) | 0.800 [" in md
    assert "| snapkv | - | 0.600 [" in md
    # kara - snapkv at 0.2 = 0.8 - 0.6 on the same four problems; no snapkv cell at 0.1.
    assert "| snapkv | - | +0.200 [" in md
    assert "Full KV: 1.000" in md
    assert plot_frontier(lookup_rows(results), tmp_path / "f.png").stat().st_size > 0


def test_non_modal_tables_grade_the_reads_off_the_floor_and_pair_them() -> None:
    from kvllm.eval.report import lookup_markdown

    results = [
        _cell(FULL, 1.0, [10, 10, 10, 10], 1.0, modal=4),
        # kara: 8 of 10 right, 4 of them on the floor: 4 of 6 off it.
        _cell("kara", 0.2, [8, 8, 8, 8], 0.5, modal=4),
        # snapkv: the same 8 of 10 overall, but only 2 on the floor: 6 of 6 off it.
        _cell("snapkv", 0.2, [8, 8, 8, 8], 0.5, modal=2),
    ]
    rows = lookup_rows(results)
    md = headline_markdown(rows)
    # Every cell shares the floor (as teacher-forced cells do): it is said once.
    assert "non-modal generated-read fidelity [95% CI] (floor 0.40 in every cell)" in md
    assert "| kara | 0.667 [0.667-0.667] |" in md
    assert "| snapkv | 1.000 [1.000-1.000] |" in md
    # Equal on all reads; kara - snapkv = 0.667 - 1.000 off the floor.
    assert "| snapkv | +0.000 [" in md and "| snapkv | -0.333 [-0.333, -0.333] |" in md
    assert "Full KV: non-modal 1.000 [1.000-1.000], floor 0.40, modal result share 0.600" in md
    assert "| kara | 0.2 | 0.800 [0.800-0.800] | 0.667 [0.667-0.667] | 0.40 |" in lookup_markdown([], rows)
    # Free cells grade each method's own chains: each cell shows its floor.
    free = [_cell(FULL, 1.0, [10, 10], 1.0, "free", modal=4), _cell("kara", 0.2, [8, 8], 0.5, "free", modal=4)]
    free[1] = dataclasses.replace(free[1], floor=0.3)
    assert "| kara | 0.667 [0.667-0.667] (0.30) |" in headline_markdown(lookup_rows(free))
    # A cell of that table recorded before the floor was counted is a dash, as a missing one.
    free.append(_cell("kara", 0.1, [7, 7], 0.4, "free"))
    assert "| kara | - | 0.667 [0.667-0.667] (0.30) |" in headline_markdown(lookup_rows(free))
    # Cells recorded before the floor was counted still report, with dashes.
    old = lookup_rows([_cell(FULL, 1.0, [10, 10], 1.0), _cell("kara", 0.2, [8, 8], 0.5)])
    assert "non-modal" not in headline_markdown(old)
    assert "| kara | 0.2 | 0.800 [0.800-0.800] | - | - |" in lookup_markdown([], old)


def test_frontier_table_takes_each_method_best_cell_under_each_memory_level() -> None:
    from kvllm.eval.report import frontier_markdown

    results = [
        _cell("kara", 0.1, [6, 6, 6, 6], 0.4),
        _cell("kara", 0.2, [8, 8, 8, 8], 0.5),
        _cell("kara", 0.3, [7, 7, 7, 7], 0.45),
    ]
    md = frontier_markdown(lookup_rows(results), levels=(0.3, 0.42, 0.46, 0.6))
    assert "| kara | - | 0.600 (128/32/0.1) | 0.700 (128/32/0.3) | 0.800 (128/32/0.2) |" in md
