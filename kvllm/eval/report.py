"""Accuracy-vs-retention plots (matplotlib, PNG)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from operator import itemgetter
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: files only
import matplotlib.pyplot as plt
from rich.table import Table

from kvllm.eval.grid import BOUND, FULL, ORACLE, CellResult
from kvllm.plots import save_figure


def accuracy_table(results: Sequence[CellResult]) -> dict[str, dict[str, dict[float, float]]]:
    """family (and "mean") -> method -> retention -> accuracy; Full KV joins each method at 1.0."""
    table: dict[str, dict[str, dict[float, float]]] = defaultdict(lambda: defaultdict(dict))
    results = [r for r in results if r.mode == "free"]  # exact match is a free-running grade
    full = {r.family: r.accuracy for r in results if r.method == FULL}
    for r in results:
        if r.method != FULL:
            table[r.family][r.method][r.retention] = r.accuracy
    for family, acc in full.items():
        if table[family]:
            for curve in table[family].values():
                curve[1.0] = acc
        else:  # a Full-KV-only grid still gets its point
            table[family][FULL] = {1.0: acc}
    families = sorted(table)
    if len(families) > 1:
        methods = set.intersection(*(set(table[f]) for f in families))
        for m in sorted(methods):
            points = set.intersection(*(set(table[f][m]) for f in families))
            table["mean"][m] = {p: sum(table[f][m][p] for f in families) / len(families) for p in sorted(points)}
    return table


def _families(table: dict[str, dict[str, dict[float, float]]]) -> list[str]:
    """The families of an :func:`accuracy_table` in report order: sorted, then the mean."""
    return sorted(f for f in table if f != "mean") + (["mean"] if "mean" in table else [])


def accuracy_markdown(results: Sequence[CellResult]) -> str:
    """Markdown tables of :func:`accuracy_table`: one per family (and the mean), a row per
    method, a column per retention, accuracy in percent."""
    table = accuracy_table(results)
    out = []
    for family in _families(table):
        points = sorted({p for curve in table[family].values() for p in curve})
        out += [f"**{family}**", "", "| method | " + " | ".join(f"r={p:g}" for p in points) + " |"]
        out.append("| --- |" + " ---: |" * len(points))
        for method, curve in sorted(table[family].items()):
            cells = [f"{100 * curve[p]:.1f}" if p in curve else "-" for p in points]
            out.append(f"| {method} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def plot_accuracy(results: Sequence[CellResult], path: Path, title: str = "") -> Path:
    """One panel per family (plus the mean): accuracy vs retention, a line per method."""
    table = accuracy_table(results)
    panels = _families(table)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False, sharey=True)
    for ax, family in zip(axes[0], panels, strict=True):
        for method, curve in sorted(table[family].items()):
            xs = sorted(curve)
            style = {"linewidth": 2.5, "color": "black"} if method == "kara" else {"linewidth": 1.2}
            ax.plot(xs, [100 * curve[x] for x in xs], marker="o", markersize=3, label=method, **style)
        ax.set_title(family)
        ax.set_xlabel("retention")
        ax.grid(alpha=0.3)
    return _save(fig, axes, "accuracy (%)", title, path)


def _save(fig, axes, ylabel: str, title: str, path: Path) -> Path:
    """Label, title and write a row of panels, then free the figure."""
    axes[0][0].set_ylabel(ylabel)
    axes[0][-1].legend(fontsize=7, loc="lower right")
    return save_figure(fig, path, title)


def accuracy_rich(results: Sequence[CellResult]) -> Table:
    """The grid as one rich table: a row per (family, method), a column per retention."""
    table = accuracy_table(results)
    points = sorted({p for family in table.values() for curve in family.values() for p in curve})
    out = Table(title="accuracy (%)")
    out.add_column("family")
    out.add_column("method")
    for p in points:
        out.add_column(f"r={p:g}", justify="right")
    for family in _families(table):
        for method, curve in sorted(table[family].items()):
            out.add_row(family, method, *(f"{100 * curve[p]:.1f}" if p in curve else "-" for p in points))
    return out


def _nonmodal_reads(cell: CellResult) -> tuple[list[int], list[int]] | None:
    """Per problem, right and all generated reads off the chain's modal value; ``None`` for
    cells recorded before the floor was counted."""
    if not all("modal_reads" in p for p in cell.problems):
        return None
    right, total = cell.read_counts()
    return (
        [r - p["modal_right"] for r, p in zip(right, cell.problems, strict=True)],
        [t - p["modal_reads"] for t, p in zip(total, cell.problems, strict=True)],
    )


def lookup_rows(results: Sequence[CellResult], reference: str = "kara") -> list[dict]:
    """Per cell with lookup records: fidelity of generated and prompt reads with 95%
    bootstrap intervals, the non-modal fidelity with its interval and the floor, memory
    held, self-recall and exact match with Wilson intervals, and ``reference`` minus this
    method on the same problems (paired bootstrap), on all generated reads and on the
    non-modal ones."""
    from kvllm.eval.stats import bootstrap_ratio, paired_difference, wilson

    by_key = {r.key: r for r in results}
    rows = []
    for cell in sorted((r for r in results if r.problems), key=lambda r: r.key):
        right, total = cell.read_counts()
        if not sum(total):
            continue
        row = {
            "method": cell.method,
            "retention": cell.retention,
            "family": cell.family,
            "mode": cell.mode,
            "window": cell.window,
            "buffer": cell.buffer,
            "n": cell.n,
            "reads": sum(total),
            "fidelity": cell.fidelity_generated,
            "fidelity_ci": bootstrap_ratio(right, total),
            "fidelity_prompt": cell.fidelity_prompt,
            "held_mean": cell.held_mean,
            "held_end": cell.held_end,
            "accuracy": cell.accuracy,
            "accuracy_ci": wilson(cell.correct, cell.n),
            "recall": cell.recall,
            "recall_ci": None,
            "nonmodal": cell.fidelity_nonmodal,
            "nonmodal_ci": None,
            "floor": cell.floor,
            "modal_result_share": cell.modal_result_share,
            "reference": reference,
            "vs_reference": None,
            "vs_reference_nonmodal": None,
        }
        nonmodal = _nonmodal_reads(cell)
        if nonmodal is not None and sum(nonmodal[1]):
            row["nonmodal_ci"] = bootstrap_ratio(*nonmodal)
        recalls = [p["recall"] for p in cell.problems if p["recall"] is not None]
        if recalls:
            row["recall_ci"] = wilson(sum(recalls), len(recalls))
        ref = by_key.get((reference, *cell.key[1:]))
        if (
            ref is not None
            and ref is not cell
            and [p["uid"] for p in ref.problems] == [p["uid"] for p in cell.problems]
        ):
            row["vs_reference"] = paired_difference(*ref.read_counts(), right, total)
            ref_nonmodal = _nonmodal_reads(ref)
            if nonmodal is not None and ref_nonmodal is not None and sum(nonmodal[1]):
                row["vs_reference_nonmodal"] = paired_difference(*ref_nonmodal, *nonmodal)
        rows.append(row)
    return rows


def _ci(value: float | None, ci: tuple[float, float] | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if ci is None else f"{value:.3f} [{ci[0]:.3f}-{ci[1]:.3f}]"


def _by_setting(rows: Sequence[dict]) -> list[tuple[tuple, list[dict]]]:
    """:func:`lookup_rows` grouped by (family, mode, W, b), in that order."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        groups[(row["family"], row["mode"], row["window"], row["buffer"])].append(row)
    return sorted(groups.items())


def _diff(d: tuple[float, float, float] | None) -> str:
    return "-" if d is None else f"{d[0]:+.3f} [{d[1]:+.3f}, {d[2]:+.3f}]"


def _floor(row: dict) -> str:
    return "-" if row["floor"] is None else f"{row['floor']:.2f}"


def lookup_markdown(results: Sequence[CellResult], rows: Sequence[dict]) -> str:
    """Markdown: per (family, mode, W, b), a row per (method, retention) of ``rows``
    (:func:`lookup_rows` of ``results``) with generated-read fidelity [95% CI], the
    non-modal fidelity [95% CI] and the floor, prompt-read fidelity, memory held (mean,
    end), the paired differences to the rows' reference, exact match and self-recall
    [Wilson 95%]; then fidelity by distance."""
    out: list[str] = []
    for (family, mode, window, buffer), group in _by_setting(rows):
        reference = group[0]["reference"]
        out += [f"**{family}, {mode}, W={window}, b={buffer}** ({group[0]['n']} problems)", ""]
        out.append(
            f"| method | r | generated-read fidelity [95% CI] | non-modal [95% CI] | floor | prompt reads "
            f"| held (mean) | held (end) | {reference} - method [95% CI] | {reference} - method, non-modal "
            "| exact match [95% CI] | self-recall [95% CI] |"
        )
        out.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for row in sorted(group, key=lambda r: (r["method"] != FULL, r["method"], r["retention"])):
            # Teacher-forced text is Full KV's: its answers say nothing about the method.
            answers = "- | -"
            if mode == "free":
                answers = f"{_ci(row['accuracy'], row['accuracy_ci'])} | {_ci(row['recall'], row['recall_ci'])}"
            out.append(
                f"| {row['method']} | {row['retention']:g} | {_ci(row['fidelity'], row['fidelity_ci'])} "
                f"| {_ci(row['nonmodal'], row['nonmodal_ci'])} | {_floor(row)} "
                f"| {_ci(row['fidelity_prompt'], None)} | {row['held_mean']:.3f} | {row['held_end']:.3f} "
                f"| {_diff(row['vs_reference'])} | {_diff(row['vs_reference_nonmodal'])} | {answers} |"
            )
        out.append("")
    out += _distance_markdown(results)
    return "\n".join(out)


def headline_markdown(rows: Sequence[dict]) -> str:
    """The headline tables of :func:`lookup_rows`, per (family, mode, W, b): a row per
    method and a column per retention, each cell generated-read fidelity [95% bootstrap
    CI] (time-averaged memory held); then the rows' reference minus each method on the
    same problems [95% paired CI]."""
    out: list[str] = []
    for (family, mode, window, buffer), group in _by_setting(rows):
        reference = group[0]["reference"]
        points = sorted({r["retention"] for r in group if r["method"] != FULL})
        methods = sorted({r["method"] for r in group if r["method"] != FULL}, key=_method_order(group, reference))
        at = {(r["method"], r["retention"]): r for r in group}
        header = "| method | " + " | ".join(f"r={p:g}" for p in points) + " |"
        rule = "| --- |" + " ---: |" * len(points)
        title = f"{family}, {mode}, W={window}, b={buffer}, {group[0]['n']} problems"
        out += [f"**{title}: generated-read lookup fidelity [95% CI] (memory held)**", ""]
        if methods:
            out += [header, rule]
        for m in methods:
            cells = [at.get((m, p)) for p in points]
            texts = [
                "-" if c is None else f"{_ci(c['fidelity'], c['fidelity_ci'])} ({c['held_mean']:.2f})" for c in cells
            ]
            out.append(f"| {m} | " + " | ".join(texts) + " |")
        for full in (r for r in group if r["method"] == FULL):
            out.append("")
            out.append(
                f"Full KV: {_ci(full['fidelity'], full['fidelity_ci'])}, prompt reads "
                f"{_ci(full['fidelity_prompt'], None)}, {full['reads']} generated reads"
            )
        if not methods:
            out.append("")
            continue
        out += ["", f"**{title}: {reference} minus each method, same problems [95% paired CI]**", "", header, rule]
        for m in (m for m in methods if m != reference):
            out.append(f"| {m} | " + " | ".join(_diff(at.get((m, p), {}).get("vs_reference")) for p in points) + " |")
        out.append("")
        if any(r["nonmodal"] is not None for r in group):
            out += _nonmodal_headline(title, reference, methods, points, at, group, header, rule)
    return "\n".join(out)


def _nonmodal_headline(
    title: str,
    reference: str,
    methods: Sequence[str],
    points: Sequence[float],
    at: dict,
    group: Sequence[dict],
    header: str,
    rule: str,
) -> list[str]:
    """The headline tables again on the reads off each chain's modal value, with the floor:
    once when every cell shares it (teacher-forced cells grade the forced text's), else
    beside each cell (free cells grade each method's own chains)."""
    floors = {r["floor"] for r in group}
    shared = len(floors) == 1
    heading = f"floor {_floor(group[0])} in every cell" if shared else "floor"
    out = [f"**{title}: non-modal generated-read fidelity [95% CI] ({heading})**", "", header, rule]
    for m in methods:
        cells = [at.get((m, p)) for p in points]
        texts = [
            "-"
            if c is None or c["nonmodal"] is None
            else _ci(c["nonmodal"], c["nonmodal_ci"]) + ("" if shared else f" ({_floor(c)})")
            for c in cells
        ]
        out.append(f"| {m} | " + " | ".join(texts) + " |")
    for full in (r for r in group if r["method"] == FULL):
        share = full["modal_result_share"]
        out.append("")
        out.append(
            f"Full KV: non-modal {_ci(full['nonmodal'], full['nonmodal_ci'])}, floor {_floor(full)}, "
            f"modal result share {'-' if share is None else f'{share:.3f}'}"
        )
    out += ["", f"**{title}: {reference} minus each method, non-modal reads [95% paired CI]**", "", header, rule]
    for m in (m for m in methods if m != reference):
        diffs = [at.get((m, p), {}).get("vs_reference_nonmodal") for p in points]
        out.append(f"| {m} | " + " | ".join(_diff(d) for d in diffs) + " |")
    out.append("")
    return out


def frontier_markdown(
    rows: Sequence[dict], levels: Sequence[float] = (0.15, 0.2, 0.25, 0.3, 0.4, 0.45, 0.55, 0.6, 0.7)
) -> str:
    """The accuracy-memory frontier of :func:`lookup_rows` as a table, per (family, mode):
    for each method and memory level, its best generated-read fidelity among cells (any
    W, b, r) holding at most that share of the generated tokens' KV (time-averaged),
    with that cell's W/b/r. The default levels span both shipped models' grids: the
    second model's long reason chains hold as little as 0.15, the shipped one's trace 0.7."""
    rows = [r for r in rows if r["method"] != FULL]
    by_fidelity = itemgetter("fidelity")
    out: list[str] = []
    for family, mode in sorted({(r["family"], r["mode"]) for r in rows}):
        mine = [r for r in rows if (r["family"], r["mode"]) == (family, mode)]
        out += [f"**{family}, {mode}: best generated-read fidelity with memory held <= level (W/b/r)**", ""]
        out.append("| method | " + " | ".join(f"<= {x:g}" for x in levels) + " |")
        out.append("| --- |" + " ---: |" * len(levels))
        best = {}
        for m in {r["method"] for r in mine}:
            cells = [r for r in mine if r["method"] == m]
            best[m] = [max((r for r in cells if r["held_mean"] <= x), key=by_fidelity, default=None) for x in levels]
        for m in sorted(best, key=lambda m: (m != ORACLE, -sum(c["fidelity"] for c in best[m] if c))):
            texts = [
                "-" if c is None else f"{c['fidelity']:.3f} ({c['window']}/{c['buffer']}/{c['retention']:g})"
                for c in best[m]
            ]
            out.append(f"| {m} | " + " | ".join(texts) + " |")
        out.append("")
    return "\n".join(out)


def _method_order(group: list[dict], reference: str) -> Callable[[str], tuple]:
    """The oracle and the bound first, then ``reference``, then by mean fidelity, best first."""
    means = defaultdict(list)
    for r in group:
        means[r["method"]].append(r["fidelity"])
    return lambda m: (m != ORACLE, m != BOUND, m != reference, -sum(means[m]) / len(means[m]))


def _distance_markdown(results: Sequence[CellResult]) -> list[str]:
    """Generated-read fidelity by distance bucket, per (family, mode, W, b, method, r)."""
    from kvllm.eval.lookup import BUCKETS

    cells = sorted((r for r in results if r.problems), key=lambda r: r.key)
    if not cells:
        return []
    labels = [b[0] for b in BUCKETS]
    out = ["**generated-read fidelity by distance (tokens back, in W)**", ""]
    out.append("| family | mode | W | b | method | r | " + " | ".join(labels) + " |")
    out.append("| --- | --- | ---: | ---: | --- | ---: |" + " ---: |" * len(labels))
    for c in cells:
        vals = []
        for label in labels:
            n = sum(p["bucket_reads"][label] for p in c.problems)
            k = sum(p["bucket_right"][label] for p in c.problems)
            vals.append(f"{k / n:.3f} ({n})" if n else "-")
        out.append(
            f"| {c.family} | {c.mode} | {c.window} | {c.buffer} | {c.method} | {c.retention:g} | "
            + " | ".join(vals)
            + " |"
        )
    out.append("")
    return out


def pareto(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices, by memory, of the points that hold a higher fidelity than every point
    holding no more memory: a method's accuracy-memory frontier (a point that another
    matches with less memory is left out)."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    keep, best = [], float("-inf")
    for i in order:
        if points[i][1] > best:
            keep.append(i)
            best = points[i][1]
    return keep


def plot_frontier(every: Sequence[dict], path: Path, title: str = "") -> Path:
    """Generated-read fidelity vs time-averaged memory held (:func:`lookup_rows`), a panel
    per (family, mode).

    Each method's cells (its retentions at every W and b) are points; its frontier (the
    cells no other of its cells beats on both axes) is a line with a 95% bootstrap band.
    """
    rows = [r for r in every if r["method"] != FULL]
    panels = sorted({(r["family"], r["mode"]) for r in rows})
    if not panels:
        return path
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5), squeeze=False, sharey=True)
    # One colour per method across panels; tab20 without its reds: red is the oracle's.
    palette = [c for i, c in enumerate(plt.get_cmap("tab20").colors) if i not in (6, 7)]
    colors = {m: palette[k % len(palette)] for k, m in enumerate(sorted({r["method"] for r in rows}))}
    for ax, (family, mode) in zip(axes[0], panels, strict=True):
        mine = [r for r in rows if (r["family"], r["mode"]) == (family, mode)]
        for method in sorted({r["method"] for r in mine}):
            pts = [r for r in mine if r["method"] == method]
            front = [pts[i] for i in pareto([(p["held_mean"], p["fidelity"]) for p in pts])]
            style = {"linewidth": 1.2, "color": colors[method]}
            if method == "kara":
                style = {"linewidth": 2.8, "color": "black"}
            elif method == ORACLE:
                style = {"linewidth": 2.2, "color": "tab:red", "linestyle": "--"}
            elif method == BOUND:
                style = {"linewidth": 2.2, "color": "tab:purple", "linestyle": ":"}
            xs = [p["held_mean"] for p in front]
            ax.plot(xs, [p["fidelity"] for p in front], marker="o", markersize=3, label=method, **style)
            lo, hi = ([p["fidelity_ci"][j] for p in front] for j in (0, 1))
            ax.fill_between(xs, lo, hi, color=style["color"], alpha=0.12, linewidth=0)
            ax.scatter(
                [p["held_mean"] for p in pts], [p["fidelity"] for p in pts], s=8, color=style["color"], alpha=0.4
            )
        for r in (r for r in every if r["method"] == FULL and (r["family"], r["mode"]) == (family, mode)):
            ax.axhline(r["fidelity"], color="grey", linestyle=":", label="Full KV")
        points = sorted({(r["window"], r["buffer"]) for r in mine})
        ax.set_title(f"{family}, {mode} (W/b: {', '.join(f'{w}/{b}' for w, b in points)})")
        ax.set_xlabel("KV held for generated tokens (time-averaged share)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("generated-read lookup fidelity")
    unique = {}
    for ax in axes[0]:
        handles, labels = ax.get_legend_handles_labels()
        unique.update(zip(labels, handles, strict=True))
    fig.legend(unique.values(), unique.keys(), loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    return save_figure(fig, path, title)


def statements_markdown(results: Sequence[CellResult]) -> str:
    """The statement grade of the free cells (:mod:`kvllm.eval.statements`), per (family,
    W, b): a row per (method, retention) with statements right [95% bootstrap CI over
    problems], its ratio to Full KV's on the same problems [95% paired CI], stopped right
    and answered right [Wilson 95%], the mean chain length over Full KV's, cap hits and the
    generated KV held at the end. Empty when no free cell carries the grade."""
    from kvllm.eval.stats import bootstrap_ratio, paired_ratio, wilson

    def counts(cell: CellResult) -> tuple[list[int], list[int]]:
        graded = [p["statements"] for p in cell.problems]
        return [g["right"] for g in graded], [g["total"] for g in graded]

    free = [r for r in results if r.mode == "free" and r.statements is not None]
    out: list[str] = []
    for family, window, buffer in sorted({(r.family, r.window, r.buffer) for r in free}):
        group = sorted(
            (r for r in free if (r.family, r.window, r.buffer) == (family, window, buffer)),
            key=lambda r: (r.method != FULL, r.method, r.retention),
        )
        full = next((r for r in free if r.method == FULL and r.family == family), None)
        out += [
            f"**{family}, free-running, W={window}, b={buffer}, {group[0].n} problems: the statement grade**",
            "",
            "| method | r | statements right [95% CI] | / Full KV's [95% paired CI] | stopped right | answered right "
            "| chain / Full KV's | cap hits | held (end) |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for cell in group:
            right, total = counts(cell)
            lo, hi = bootstrap_ratio(right, total)
            ratio, length = "-", "-"
            if full is not None and [p["uid"] for p in full.problems] == [p["uid"] for p in cell.problems]:
                ratio = "{:.3f} [{:.3f}-{:.3f}]".format(*paired_ratio(right, total, *counts(full)))
                length = f"{cell.mean_new_tokens / full.mean_new_tokens:.2f}"
            stopped = round(cell.stopped * cell.n)
            answered = round(cell.answered * cell.n)
            s_lo, s_hi = wilson(stopped, cell.n)
            a_lo, a_hi = wilson(answered, cell.n)
            out.append(
                f"| {cell.method} | {cell.retention:g} | {cell.statements:.3f} [{lo:.3f}-{hi:.3f}] | {ratio} "
                f"| {stopped}/{cell.n} [{s_lo:.2f}-{s_hi:.2f}] | {answered}/{cell.n} [{a_lo:.2f}-{a_hi:.2f}] "
                f"| {length} | {cell.cap_hits} | {cell.held_end:.3f} |"
            )
        out.append("")
    return "\n".join(out)
