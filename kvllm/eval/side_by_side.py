"""The side-by-side tables: model x family x method, from several ``kvllm eval`` folders.

Each folder holds one model's cells (``kvllm eval --model ... --out FOLDER``); each of its
families becomes a column, labelled ``model / family``. Four tables come out:

- every method's generated-read fidelity at one retention, with memory held;
- Kara minus each baseline on the same problems, at every retention (paired bootstrap);
- the same at equal memory: against the baseline's best cell that holds no more (claim (b));
- claim (a)'s target for Kara: its fidelity and recall as shares of Full KV's (paired
  bootstrap), and the memory it held.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvllm.eval.grid import FULL, CellResult, load_results
from kvllm.eval.stats import bootstrap_ratio, paired_difference, paired_ratio

#: Claim (a)'s target: at r=0.2, free or forced, Kara keeps this share of Full KV's
#: generated-read fidelity and of its recall, holding at most this share of the KV.
FIDELITY_SHARE, RECALL_SHARE, HELD = 0.98, 0.95, 0.30
#: Equal memory, for claim (b): a baseline cell holding at most this much more of the
#: generated KV (time-averaged) than Kara's counts as equal. Methods on the same periodic
#: policy and budget hold the same to within 0.005 in the stored grid.
MEMORY_SLACK = 0.01


@dataclass(frozen=True)
class Column:
    """One model on one family: its cells by (method, retention)."""

    label: str
    cells: dict[tuple[str, float], CellResult]

    def get(self, method: str, retention: float) -> CellResult | None:
        return self.cells.get((method, 1.0 if method == FULL else retention))


def columns(folders: Mapping[str, Path], mode: str, window: int = 128, buffer: int = 32) -> list[Column]:
    """A column per (folder, family) of the cells run in ``mode`` at W=``window``, b=``buffer``."""
    out = []
    for label, folder in folders.items():
        results = [
            r
            for r in load_results(Path(folder) / "results.jsonl").values()
            if (r.mode, r.window, r.buffer) == (mode, window, buffer) and r.problems
        ]
        for family in sorted({r.family for r in results}, key=_family_order):
            cells = {(r.method, r.retention): r for r in results if r.family == family}
            out.append(Column(f"{label} / {family}", cells))
    return out


def _family_order(family: str) -> tuple[bool, str]:
    return (family != "trace", family)  # the stress test first, then the realistic family


def _recalls(cell: CellResult) -> tuple[list[int], list[int]] | None:
    flags = [p["recall"] for p in cell.problems]
    if any(f is None for f in flags):
        return None
    return [int(f) for f in flags], [1] * len(flags)


def _paired(cell: CellResult, other: CellResult) -> bool:
    return [p["uid"] for p in cell.problems] == [p["uid"] for p in other.problems]


def _header(cols: Sequence[Column]) -> list[str]:
    return ["| method | " + " | ".join(c.label for c in cols) + " |", "| --- |" + " ---: |" * len(cols)]


def fidelity_table(cols: Sequence[Column], methods: Sequence[str], retention: float) -> list[str]:
    """Generated-read fidelity [95% CI] (time-averaged memory held), a row per method
    (Full KV first), a column per model and family; ``-`` where a cell was not run."""

    def text(cell: CellResult | None) -> str:
        if cell is None:
            return "-"
        lo, hi = bootstrap_ratio(*cell.read_counts())
        return f"{cell.fidelity_generated:.3f} [{lo:.3f}-{hi:.3f}] ({cell.held_mean:.2f})"

    out = _header(cols)
    for m in (FULL, *methods):
        out.append(f"| {m} | " + " | ".join(text(c.get(m, retention)) for c in cols) + " |")
    return out


def difference_table(
    cols: Sequence[Column], baselines: Sequence[str], retentions: Sequence[float], reference: str = "kara"
) -> list[str]:
    """``reference`` minus each baseline on the same problems [95% paired CI], a row per
    (baseline, retention); ``above``/``below`` where the interval excludes 0."""

    def text(col: Column, baseline: str, r: float) -> str:
        ours, theirs = col.get(reference, r), col.get(baseline, r)
        if ours is None or theirs is None or not _paired(ours, theirs):
            return "-"
        return _difference(ours, theirs)

    return _baseline_rows(cols, baselines, retentions, f"| {reference} minus | r |", text)


def equal_memory_table(
    cols: Sequence[Column],
    baselines: Sequence[str],
    retentions: Sequence[float],
    reference: str = "kara",
    slack: float = MEMORY_SLACK,
) -> list[str]:
    """``reference`` minus each baseline **at equal memory** [95% paired CI]: per
    ``reference`` cell, the baseline's accuracy-memory curve interpolated at the memory
    that cell holds (:func:`at_memory`: linear between the baseline's two cells around
    it, problem by problem), with the two cells' r in brackets. ``-`` where the
    baseline's cells do not reach that memory (within ``slack``): no extrapolation.

    An earlier rule took the baseline's best cell at or below the reference's memory,
    which compares against a cell holding less and inflates the margin."""

    def text(col: Column, baseline: str, r: float) -> str:
        ours = col.get(reference, r)
        if ours is None:
            return "-"
        curve = [c for (m, _), c in col.cells.items() if m == baseline and _paired(ours, c)]
        theirs = at_memory(curve, ours.held_mean, slack)
        if theirs is None:
            return "-"
        (right, total), (lo, hi) = theirs
        d, d_lo, d_hi = paired_difference(*ours.read_counts(), right, total)
        verdict = " above" if d_lo > 0 else " below" if d_hi < 0 else ""
        where = f"r={lo.retention:g}" if lo is hi else f"r={lo.retention:g}-{hi.retention:g}"
        return f"{d:+.3f} [{d_lo:+.3f}, {d_hi:+.3f}]{verdict} ({where})"

    return _baseline_rows(cols, baselines, retentions, f"| {reference} minus | {reference}'s r |", text)


def at_memory(
    curve: Sequence[CellResult], held: float, slack: float = MEMORY_SLACK
) -> tuple[tuple[list[float], list[float]], tuple[CellResult, CellResult]] | None:
    """A method's per-problem read counts (right, total) interpolated at memory ``held``
    along its cells ``curve`` (each at its time-averaged ``held_mean``), and the two cells
    it lies between; ``None`` outside the curve's range (beyond ``slack``)."""
    points = sorted(curve, key=lambda c: c.held_mean)
    if not points or held < points[0].held_mean - slack or held > points[-1].held_mean + slack:
        return None
    below = [c for c in points if c.held_mean <= held]
    above = [c for c in points if c.held_mean >= held]
    lo = below[-1] if below else points[0]
    hi = above[0] if above else points[-1]
    t = 0.0 if hi.held_mean == lo.held_mean else (held - lo.held_mean) / (hi.held_mean - lo.held_mean)
    t = min(max(t, 0.0), 1.0)
    (r_lo, n_lo), (r_hi, n_hi) = lo.read_counts(), hi.read_counts()
    right = [(1 - t) * a + t * b for a, b in zip(r_lo, r_hi, strict=True)]
    total = [(1 - t) * a + t * b for a, b in zip(n_lo, n_hi, strict=True)]
    return (right, total), (lo, hi)


def _difference(ours: CellResult, theirs: CellResult) -> str:
    """``ours`` minus ``theirs`` on the same problems [95% paired CI], ``above``/``below``
    where the interval excludes 0."""
    d, lo, hi = paired_difference(*ours.read_counts(), *theirs.read_counts())
    verdict = " above" if lo > 0 else " below" if hi < 0 else ""
    return f"{d:+.3f} [{lo:+.3f}, {hi:+.3f}]{verdict}"


def _baseline_rows(
    cols: Sequence[Column],
    baselines: Sequence[str],
    retentions: Sequence[float],
    first: str,
    text: Callable[[Column, str, float], str],
) -> list[str]:
    """A table with ``first``'s two leading columns and a row per (baseline, retention) of
    ``text(column, baseline, r)``; a row no column has a cell for is left out."""
    out = [_header(cols)[0].replace("| method |", first, 1), "| --- | ---: |" + " ---: |" * len(cols)]
    for b in baselines:
        for r in retentions:
            texts = [text(c, b, r) for c in cols]
            if any(t != "-" for t in texts):  # a retention no column ran is no row
                out.append(f"| {b} | {r:g} | " + " | ".join(texts) + " |")
    return out


def target_table(cols: Sequence[Column], method: str = "kara", retention: float = 0.2) -> list[str]:
    """Target (a) per column: ``method``'s generated-read fidelity and recall as shares of
    Full KV's on the same problems [95% paired CI], the memory it held (time-averaged and
    at the end), and whether each bar is met by the point estimate."""
    out = [
        "| model / family | fidelity share of Full KV's (>= 0.98) | recall share (>= 0.95) "
        "| Full KV recall | held, mean / end (<= 0.30) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for col in cols:
        ours, full = col.get(method, retention), col.get(FULL, 1.0)
        if ours is None or full is None or not _paired(ours, full):
            continue
        share, lo, hi = paired_ratio(*ours.read_counts(), *full.read_counts())
        fidelity = f"{share:.3f} [{lo:.3f}-{hi:.3f}] {_met(share >= FIDELITY_SHARE)}"
        recall, full_recall = "-", "-"
        ours_r, full_r = _recalls(ours), _recalls(full)
        if ours_r is not None and full_r is not None and sum(full_r[0]):
            share, lo, hi = paired_ratio(*ours_r, *full_r)
            recall = f"{share:.3f} [{lo:.3f}-{hi:.3f}] {_met(share >= RECALL_SHARE)}"
            full_recall = f"{full.recall:.3f}"
        held = f"{ours.held_mean:.2f} / {ours.held_end:.2f} {_met(ours.held_mean <= HELD)}"
        out.append(f"| {col.label} | {fidelity} | {recall} | {full_recall} | {held} |")
    return out


def _met(ok: bool) -> str:
    return "met" if ok else "missed"


def markdown(
    cols: Sequence[Column],
    methods: Sequence[str],
    baselines: Sequence[str],
    retentions: Sequence[float],
    retention: float = 0.2,
) -> str:
    """The four tables with their titles."""
    n = sorted({len(c.get(FULL, 1.0).problems) for c in cols if c.get(FULL, 1.0) is not None})
    problems = "/".join(str(k) for k in n)
    out = [f"**Generated-read fidelity at r={retention:g} [95% CI] (memory held), {problems} problems a cell**", ""]
    out += fidelity_table(cols, methods, retention)
    out += ["", "**Kara minus each baseline, same problems [95% paired CI]**", ""]
    out += difference_table(cols, baselines, retentions)
    out += ["", "**Kara minus each baseline at equal memory: its best cell holding no more [95% paired CI]**", ""]
    out += equal_memory_table(cols, baselines, retentions)
    out += ["", f"**Target (a) at r={retention:g}: Kara as a share of Full KV [95% paired CI]**", ""]
    out += target_table(cols, retention=retention)
    return "\n".join(out) + "\n"
