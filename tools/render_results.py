"""Render the results tables of README.md and docs/ from the stored results files.

Every results table (and the plot beside it) stands in a page between two marker lines::

    <!-- results:throughput-kara -->
    ...written by this tool...
    <!-- /results:throughput-kara -->

Between them goes what the renderer registered under that block name returns, computed
from the stored files under ``docs/results/data/`` with the package's own report code.
The prose around the blocks is free to change; the numbers inside them are not.

    python tools/render_results.py            # rewrite every block of README.md and docs/
    python tools/render_results.py --check    # rewrite nothing; exit 1 naming each stale block

``--check`` also fails on a block no renderer knows, on a marker left open, and on a
renderer whose block no page holds. It reads only stored files: no model, a few seconds.

Adding a table: write a function that takes the :class:`Page` being rendered and returns
the block's markdown, register it under the block's name, and put the two marker lines
where the table belongs; then run the tool to fill the block in::

    @renderer("throughput-goodput")
    def _goodput(page: Page) -> str:
        folder = page.data / "throughput" / "goodput"
        table = my_report.markdown_table(stored_rows(folder))
        return table + page.source(rows_file(folder))

:meth:`Page.source` names the files a table comes from, :meth:`Page.image` links a plot
from wherever the page sits, and the renderers below show the report functions at hand.

Prose quotes a table's number through a cell, which the tool fills in and checks as it
does a block: the row whose first column reads ROW (or ``where HEADER=VALUE; ...``, the
row whose cells read so), the column whose header starts with COLUMN, in the table the
block BLOCK renders (on any page), up to its interval::

    at r=0.2 Kara keeps <!-- cell:summary | `kara@0.2` | statements right -->0.306<!-- /cell -->
    of Full KV's statements

In README.md and ``docs/results/`` a result number in prose, outside a block, a cell and a
code span, fails ``--check``: a number typed by hand goes stale unseen. A setting
(``r=0.2``, ``kara@0.5``) or a bound (``>= 0.98``) is not a result and passes.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path
from typing import Any

from kvllm.bench import report as throughput_report
from kvllm.bench import serving_report
from kvllm.bench.throughput import UNCOMPRESSED
from kvllm.eval import side_by_side
from kvllm.eval.grid import FULL, ORACLE, CellResult, load_results
from kvllm.eval.report import frontier_markdown, lookup_rows
from kvllm.eval.side_by_side import columns, equal_memory_table, fidelity_table, target_table

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "docs" / "results" / "data"


# --- the stored results ------------------------------------------------------------------------
# Benchmark folders (kvllm bench throughput and serve) hold their per-repeat rows in
# results.jsonl or, for the older runs, only in results.csv; accuracy folders (kvllm eval)
# one cell per line of results.jsonl. Both loaders cache what they read.


def _typed(text: str) -> int | float | str | None:
    """A CSV field as the JSON rows hold it: int, float, str, or None when empty."""
    if text == "":
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def rows_file(folder: Path) -> Path:
    """Where a benchmark folder's rows are: ``results.jsonl`` (the runs' own records) when
    stored, else ``results.csv`` (what the report wrote from them)."""
    jsonl = folder / "results.jsonl"
    return jsonl if jsonl.exists() else folder / "results.csv"


@cache
def stored_rows(folder: Path) -> tuple[dict[str, Any], ...]:
    """A benchmark folder's per-repeat rows (:func:`rows_file`)."""
    path = rows_file(folder)
    if path.suffix == ".jsonl":
        return tuple(json.loads(line) for line in path.read_text().splitlines() if line.strip())
    with path.open() as f:
        return tuple({k: _typed(v) for k, v in row.items()} for row in csv.DictReader(f))


@cache
def stored_cells(folder: Path) -> tuple[CellResult, ...]:
    """A ``kvllm eval`` folder's cells, from its ``results.jsonl``."""
    return tuple(load_results(folder / "results.jsonl").values())


@dataclass(frozen=True)
class Page:
    """The page a block is rendered into, and the stored results it reads."""

    path: Path  # the markdown file
    data: Path  # the stored results folder (docs/results/data/, or a copy in tests)

    def name(self, path: Path) -> str:
        """How a stored file is named in prose: its path in the repository."""
        return f"docs/results/data/{path.relative_to(self.data).as_posix()}"

    def link(self, path: Path) -> str:
        return Path(os.path.relpath(path, self.path.parent)).as_posix()

    def source(self, *paths: Path) -> str:
        """A line naming (and linking) the stored files a table comes from."""
        named = ", ".join(f"[`{self.name(p)}`]({self.link(p)})" for p in paths)
        return f"\nFrom {named}.\n"

    def image(self, path: Path, alt: str) -> str:
        return f"\n![{alt}]({self.link(path)})\n"


Renderer = Callable[[Page], str]
RENDERERS: dict[str, Renderer] = {}


def renderer(name: str) -> Callable[[Renderer], Renderer]:
    """Register a renderer for the block ``name``."""

    def register(render: Renderer) -> Renderer:
        if name in RENDERERS:
            raise ValueError(f"two renderers for block {name!r}")
        RENDERERS[name] = render
        return render

    return register


# --- accuracy (kvllm eval folders) -------------------------------------------------------------

ACCURACY = Path("accuracy")
OWN_CHAINS = ACCURACY / "6l-own-chains"  # kara-reasoner-6l v2 on its own reason chains
REFERENCE = ACCURACY / "reference-forced"  # both shipped models, the tasks' own chains forced
REFERENCE_V1 = ACCURACY / "reference-forced-6l-v1"  # the same grid on kara-reasoner-6l v1
TINY_TRACE = ACCURACY / "tiny-trace"  # kara-reasoner-tiny on trace, baselines at tuned knobs
# Kara, its two ablations and the paper's four baselines: the claims' methods.
CLAIM_METHODS = ("kara", "kara-topk", "kara-causal", "pyramidkv", "snapkv", "adakv", "chunkkv")
BASELINES = ("snapkv", "pyramidkv", "adakv", "chunkkv")
RETENTIONS = (0.05, 0.1, 0.2, 0.3, 0.5)
# The shipped tiny model's trace grid (tools/accuracy_grid.sh), the oracle first.
TRACE_METHODS = (
    ORACLE,
    "kara",
    "kara-topk",
    "kara-causal",
    "kara-far",
    "kara-late",
    "pyramidkv",
    "chunkkv",
    "snapkv",
    "adakv",
    "h2o",
    "rkv",
    "streamingllm",
    "random",
)


def _ci(value: float, ci: Sequence[float] | None) -> str:
    return f"{value:.3f}" if ci is None else f"{value:.3f} [{ci[0]:.3f}-{ci[1]:.3f}]"


@cache
def _lookup(data: Path, folder: Path, family: str, mode: str, window: int = 128, buffer: int = 32) -> list[dict]:
    """:func:`kvllm.eval.report.lookup_rows` of one setting's cells in ``folder``."""
    cells = [
        c
        for c in stored_cells(data / folder)
        if (c.family, c.mode, c.window, c.buffer) == (family, mode, window, buffer) and c.problems
    ]
    return lookup_rows(cells)


def _full(data: Path, folder: Path, family: str, mode: str) -> dict[str, Any]:
    """The setting's Full-KV row: its own mode's, else the free one (teacher-forced cells
    force the free Full-KV cell's completions)."""
    rows = _lookup(data, folder, family, mode) or []
    for row in rows + _lookup(data, folder, family, "free"):
        if row["method"] == FULL:
            return row
    raise ValueError(f"no Full-KV cell for {family}, {mode} in {folder}")


def _recalled(cell: CellResult) -> str:
    flags = [p["recall"] for p in cell.problems if p["recall"] is not None]
    return f"{sum(flags)} of {len(flags)}" if flags else "-"


def _cell(data: Path, folder: Path, method: str, retention: float, family: str, mode: str) -> CellResult:
    return next(
        c
        for c in stored_cells(data / folder)
        if (c.method, c.retention, c.family, c.mode, c.window, c.buffer) == (method, retention, family, mode, 128, 32)
    )


def retention_table(
    page: Page,
    folder: Path,
    family: str,
    mode: str,
    methods: Sequence[str],
    value: str = "fidelity",
    full_from: Path | None = None,
) -> str:
    """Per method (a row) and retention (a column): generated-read fidelity [95% CI]
    (memory held), or with ``value="nonmodal"`` the same on the reads off each chain's
    modal value; then Full KV's (from ``full_from`` when ``folder`` has none), with its
    answers' recall when free-running."""
    rows = _lookup(page.data, folder, family, mode)
    at = {(r["method"], r["retention"]): r for r in rows}
    points = sorted({r["retention"] for r in rows if r["method"] != FULL})
    shown = [m for m in methods if any((m, p) in at for p in points)]
    lines = ["| method | " + " | ".join(f"r={p:g}" for p in points) + " |", "| --- |" + " ---: |" * len(points)]
    for m in shown:
        texts = []
        for p in points:
            row = at.get((m, p))
            if row is None or row[value] is None:
                texts.append("-")
            elif value == "fidelity":
                texts.append(f"{_ci(row['fidelity'], row['fidelity_ci'])} ({row['held_mean']:.2f})")
            else:
                texts.append(_ci(row["nonmodal"], row["nonmodal_ci"]))
        lines.append(f"| {m} | " + " | ".join(texts) + " |")
    full = _full(page.data, full_from or folder, family, mode)
    if value == "fidelity":
        note = f"Full KV reads back {_ci(full['fidelity'], full['fidelity_ci'])} of {full['reads']:,} generated values"
    else:
        note = f"Full KV: {_ci(full['nonmodal'], full['nonmodal_ci'])} off a floor of {full['floor']:.2f}"
    recalled = _recalled(_cell(page.data, full_from or folder, FULL, 1.0, family, "free")) if mode == "free" else "-"
    if recalled != "-":
        note += f"; its answers name the asked value in {recalled}"
    return "\n".join(lines) + f"\n\n{note}.\n" + page.source(page.data / folder / "results.jsonl")


def difference_table(
    page: Page, folder: Path, family: str, mode: str, methods: Sequence[str], key: str = "vs_reference"
) -> str:
    """Kara minus each method on the same problems [95% paired CI], a row per method and a
    column per retention; ``key="vs_reference_nonmodal"`` on the reads off the floor."""
    rows = _lookup(page.data, folder, family, mode)
    at = {(r["method"], r["retention"]): r for r in rows}
    points = sorted({r["retention"] for r in rows if r["method"] != FULL})
    lines = ["| kara minus | " + " | ".join(f"r={p:g}" for p in points) + " |", "| --- |" + " ---: |" * len(points)]
    for m in methods:
        diffs = [(at.get((m, p)) or {}).get(key) for p in points]
        if any(diffs):
            texts = ["-" if d is None else f"{d[0]:+.3f} [{d[1]:+.3f}, {d[2]:+.3f}]" for d in diffs]
            lines.append(f"| {m} | " + " | ".join(texts) + " |")
    return "\n".join(lines) + "\n" + page.source(page.data / folder / "results.jsonl")


def _columns(page: Page, folders: dict[str, Path], mode: str, window: int = 128, buffer: int = 32) -> list:
    return columns({label: page.data / f for label, f in folders.items()}, mode, window, buffer)


GOODPUT = Path("goodput")  # kvllm bench goodput on kara-reasoner-6l v2, reason


@cache
def _goodput(data: Path) -> tuple[dict[str, Any], ...]:
    from kvllm.bench.goodput_report import summarize

    return tuple(summarize(stored_rows(data / GOODPUT)))


@renderer("summary")
def _summary(page: Page) -> str:
    """README: per system, what it costs in accuracy and buys in goodput, in one run."""
    from kvllm.bench.goodput import BASELINE, LIMIT

    cells = _goodput(page.data)
    lines = [
        "| system | KV held for generated tokens | statements right / Full KV's [95% CI] | stopped at the end "
        "| chain length / Full KV's | goodput / vLLM's [min-max] |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for e in cells:
        label = {BASELINE: "vLLM (Full KV)", LIMIT: "vLLM, a pool with no pressure (the limit)"}.get(e["system"])
        label = label or f"`{e['system']}`"
        share, lo, hi = e["statements_ratio"]
        g, g_lo, g_hi = e["statements_right_s_ratio"]
        lines.append(
            f"| {label} | {e['held_end']:.2f} | {share:.3f} [{lo:.3f}-{hi:.3f}] | {e['stopped_right']}/{e['tasks']} "
            f"| {e['length_ratio']:.2f} | **{g:.2f}x** [{g_lo:.2f}-{g_hi:.2f}] |"
        )
    folder = page.data / GOODPUT
    return (
        "\n".join(lines)
        + "\n"
        + page.source(folder / "results.jsonl")
        + page.image(folder / "goodput.png", "goodput against accuracy, a curve per method")
    )


@renderer("goodput")
def _goodput_page(page: Page) -> str:
    """docs/results/goodput.md: the iso-accuracy table and every cell, as the report writes them."""
    from kvllm.bench.goodput_report import markdown

    text = markdown(list(_goodput(page.data)))
    body = text.split("\n", 2)[2].lstrip()  # without the report's own title
    folder = page.data / GOODPUT
    return body + page.source(folder / "results.jsonl") + page.image(folder / "goodput.png", "goodput against accuracy")


GOODPUT_SCALE = Path("goodput-scale")  # the same workload at the 16x pool and at C = 16 and 64


@renderer("goodput-scale")
def _goodput_scale(page: Page) -> str:
    """docs/results/goodput.md: the main cells at other pools and concurrencies, each
    ratio to vLLM in the same pool, concurrency and repeat."""
    return _goodput_cells(page, page.data / GOODPUT_SCALE)


GOODPUT_LAZY = Path("goodput-lazy")  # lazy retention against single-stage, in one run


@renderer("goodput-lazy")
def _goodput_lazy(page: Page) -> str:
    """docs/results/goodput.md: lazy retention served, each ratio to vLLM in the same repeat."""
    return _goodput_cells(page, page.data / GOODPUT_LAZY)


def _goodput_cells(page: Page, folder: Path) -> str:
    """Every (pool, concurrency, system) cell of a goodput run folder, one row each."""
    from kvllm.bench.goodput_report import summarize

    lines = [
        "| pool | C | system | statements right / Full KV's | stopped | goodput / vLLM [min-max] "
        "| output tok/s / vLLM | chain / Full KV's | preemptions | rounds' share (max) |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for e in summarize(stored_rows(folder)):
        g, lo, hi = e["statements_right_s_ratio"]
        lines.append(
            f"| {e['pool']} | {e['concurrency']} | {e['system']} | {e['statements_ratio'][0]:.3f} "
            f"| {e['stopped_right']}/{e['tasks']} | **{g:.2f}x** [{lo:.2f}-{hi:.2f}] | {e['tok_s_ratio'][0]:.2f} "
            f"| {e['length_ratio']:.2f} | {e['preemptions']:.0f} "
            f"| {e['compress_share']:.3f} ({e['compress_share_max']:.3f}) |"
        )
    return "\n".join(lines) + "\n" + page.source(folder / "results.jsonl")


PROFILE = Path("profile") / "profile.json"  # python tools/step_profile.py
PROFILE_PARTS = {
    "attention": "attention kernel (KV write included)",
    "attention_projections": "QKV/O projections, norms, rotary",
    "mlp": "MLP",
    "forward_other": "rest of the forward (embedding, norms)",
    "logits": "logits",
    "rounds": "compression rounds",
    "runner_other": "runner: input preparation, sampling",
    "schedule": "scheduler",
    "step_other": "rest of the engine step",
    "outside_step": "output processing, detokenizing",
}


@renderer("step-profile")
def _step_profile(page: Page) -> str:
    """docs/results/goodput.md: where the serving loop's wall time goes, per part, as a share."""
    runs = json.loads((page.data / PROFILE).read_text())

    def row(label: str, cell: Callable[[dict[str, Any]], str]) -> str:
        return f"| {label} | " + " | ".join(cell(r) for r in runs) + " |"

    lines = [
        row("part", lambda r: f"{r['model']}, {r['system']}"),
        row("---", lambda r: "---:"),
        *(row(label, lambda r, p=part: f"{r['parts'][p] / r['seconds']:.1%}") for part, label in PROFILE_PARTS.items()),
        row("wall s (engine steps)", lambda r: f"{r['seconds']:.0f} ({r['engine_steps']})"),
        row("ms per step", lambda r: f"{1e3 * r['seconds'] / r['engine_steps']:.1f}"),
        row("mean requests running", lambda r: f"{r['mean_running']:.1f}"),
    ]
    return "\n".join(lines) + "\n" + page.source(page.data / PROFILE)


STATEMENTS = ACCURACY / "6l-statements"  # kara-reasoner-6l v2, free-running, the statement grade


@renderer("accuracy-bound-6l")
def _bound_6l(page: Page) -> str:
    """kara-reasoner-6l on reason at r=0.2: per selector, reads right forced through the
    tasks' own chains and through Full KV's (64 problems each), and statements right
    free-running (32 problems)."""
    from kvllm.eval.stats import bootstrap_ratio

    lines = [
        "| selector | what it knows | reads right, tasks' chains forced [95% CI] (held) "
        "| reads right, Full KV's chains forced | statements right, free [95% CI] | stopped right, free |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    teacher = {
        c.method: c for c in stored_cells(page.data / OWN_CHAINS) if (c.retention, c.mode) == (0.2, "teacher-forced")
    }
    knows = {
        ORACLE: "the attention of this chain's own future queries",
        "bound": "each token's role in the grammar (its line's kind, its place from the line's end)",
        "kara-retain": "the window's attention and a score learned from keys and values",
        "kara-topk": "the window's attention",
        "kara": "the window's attention, as chunks",
    }
    for method, what in knows.items():
        forced = _cell(page.data, REFERENCE / "6l", method, 0.2, "reason", "reference-forced")
        right, total = forced.read_counts()
        reads = f"{_ci(forced.fidelity_generated, bootstrap_ratio(right, total))} ({forced.held_mean:.2f})"
        free = [c for c in stored_cells(page.data / STATEMENTS) if (c.method, c.retention) == (method, 0.2)]
        statements, stopped = "- (reads the future)", "-"
        if free:
            graded = [p["statements"] for p in free[0].problems]
            ci = bootstrap_ratio([g["right"] for g in graded], [g["total"] for g in graded])
            statements = _ci(free[0].statements, ci)
            stopped = f"{round(free[0].stopped * free[0].n)}/{free[0].n}"
        own = teacher.get(method)
        forced_own = "-" if own is None else _ci(own.fidelity_generated, bootstrap_ratio(*own.read_counts()))
        lines.append(f"| `{method}` | {what} | {reads} | {forced_own} | {statements} | {stopped} |")
    source = page.source(
        page.data / REFERENCE / "6l" / "results.jsonl",
        page.data / OWN_CHAINS / "results.jsonl",
        page.data / STATEMENTS / "results.jsonl",
    )
    return "\n".join(lines) + "\n" + source


SELECTION_BETS = ACCURACY / "selection-bets"  # tools/selection_bets.py on test seeds


@renderer("accuracy-selection-bets")
def _selection_bets(page: Page) -> str:
    """Lazy two-stage retention and merging (tools/selection_bets.py), free-running, each
    against the method it changes, on the same problems."""
    from kvllm.eval.stats import bootstrap_ratio, paired_difference

    rows = stored_rows(page.data / SELECTION_BETS)
    cells: dict[tuple[float, str], list[dict]] = {}
    for row in rows:
        cells.setdefault((row["retention"], row["cell"]), []).append(row)
    full = next(c for c in stored_cells(page.data / STATEMENTS) if c.method == FULL)
    lines = [
        "| cell | r | statements right [95% CI] | against its method [95% paired CI] | of the program's "
        "| stopped right | chain / Full KV's | held (end) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for (retention, name), cell in sorted(cells.items(), key=lambda item: (item[0][1].split("+")[0], item[0])):
        right, graded = [r["right"] for r in cell], [r["graded"] for r in cell]
        base = cells[(retention, name.split("+")[0])]
        if [r["uid"] for r in base] != [r["uid"] for r in cell]:
            raise ValueError(f"{name} and its method ran different problems at r={retention}")
        diff, lo, hi = paired_difference(right, graded, [r["right"] for r in base], [r["graded"] for r in base])
        against = "-" if base is cell else f"{diff:+.3f} [{lo:+.3f}, {hi:+.3f}]"
        of_program = sum(right) / sum(r["program"] for r in cell)
        chain = statistics.mean(r["tokens"] for r in cell) / full.mean_new_tokens
        lines.append(
            f"| `{name}` | {retention:g} | {_ci(sum(right) / sum(graded), bootstrap_ratio(right, graded))} "
            f"| {against} | {of_program:.3f} | {sum(r['stopped'] for r in cell)}/{len(cell)} | {chain:.2f} "
            f"| {statistics.mean(r['held_end'] for r in cell):.3f} |"
        )
    source = page.source(page.data / SELECTION_BETS / "results.jsonl", page.data / STATEMENTS / "results.jsonl")
    return "\n".join(lines) + "\n" + source


CHUNK_GAP = ACCURACY / "chunk-gap.json"  # tools/chunk_gap.py: what Token2Chunk's fill keeps


@renderer("accuracy-chunk-gap")
def _chunk_gap(page: Page) -> str:
    """Kara's tokens past its endpoints against top-m's: how many the oracle keeps, and their kinds."""
    record = json.loads((page.data / CHUNK_GAP).read_text())
    kinds = record["kinds"]
    labels = {"endpoints": "the K endpoints (both)", "kara": "Kara's other m - K", "top-m": "top-m's other m - K"}
    lines = [
        "| kept | tokens | also kept by the oracle | " + " | ".join(kinds) + " |",
        "| --- | ---: | ---: |" + " ---: |" * len(kinds),
    ]
    for who, label in labels.items():
        c = record["tally"][who]
        shares = " | ".join(f"{c.get(k, 0) / c['tokens']:.2f}" for k in kinds)
        lines.append(f"| {label} | {c['tokens']:,} | {c['oracle'] / c['tokens']:.3f} | {shares} |")
    return "\n".join(lines) + "\n" + page.source(page.data / CHUNK_GAP)


@renderer("goodput-agreement")
def _agreement(page: Page) -> str:
    """docs/results/goodput.md: the goodput run's statement grade inside vLLM against the
    statement grid's transformers cells on the same seeds (kvllm.bench.agreement)."""
    from kvllm.bench.agreement import agreement, markdown

    table = markdown(agreement(page.data / GOODPUT, page.data / STATEMENTS))
    return table + page.source(page.data / GOODPUT / "results.jsonl", page.data / STATEMENTS / "results.jsonl")


@renderer("accuracy-statements")
def _statements(page: Page) -> str:
    """The statement grade of every free cell (kvllm.eval.report.statements_markdown)."""
    from kvllm.eval.report import statements_markdown

    table = statements_markdown(stored_cells(page.data / STATEMENTS)).split("\n", 2)[2]  # without its title
    return table.rstrip() + "\n" + page.source(page.data / STATEMENTS / "results.jsonl")


@renderer("accuracy-own-chains-free")
def _own_chains_free(page: Page) -> str:
    table = retention_table(page, OWN_CHAINS, "reason", "free", CLAIM_METHODS)
    return table + page.image(page.data / OWN_CHAINS / "frontier.png", "fidelity against KV held, free and forced")


@renderer("accuracy-own-chains-forced")
def _own_chains_forced(page: Page) -> str:
    return retention_table(page, OWN_CHAINS, "reason", "teacher-forced", (ORACLE, *CLAIM_METHODS))


@renderer("accuracy-reference-6l-reason")
def _reference_6l_reason(page: Page) -> str:
    return retention_table(page, REFERENCE / "6l", "reason", "reference-forced", (ORACLE, *CLAIM_METHODS))


@renderer("accuracy-reference-6l-tuned")
def _reference_6l_tuned(page: Page) -> str:
    tuned, defaults = REFERENCE / "6l-tuned", REFERENCE / "6l"
    return retention_table(page, tuned, "reason", "reference-forced", CLAIM_METHODS, full_from=defaults)


def _grid_order(method: str) -> tuple[bool, bool, bool, str]:
    """Kara, then its variants, then the rest by name, the oracle last."""
    return (method != "kara", not method.startswith("kara"), method == ORACLE, method)


def _side_by_side(page: Page, folder: Path) -> str:
    """Every method of the grid at r=0.2, a column per model and family."""
    cols = _columns(page, {"tiny": folder / "tiny", "6l": folder / "6l"}, "reference-forced")
    methods = sorted({m for c in cols for m, r in c.cells if r == 0.2 and m != FULL}, key=_grid_order)
    return "\n".join(fidelity_table(cols, methods, 0.2)) + "\n" + page.source(page.data / folder)


renderer("accuracy-reference-r02")(partial(_side_by_side, folder=REFERENCE))
renderer("accuracy-reference-r02-v1")(partial(_side_by_side, folder=REFERENCE_V1))


def _equal_memory(page: Page, folder: Path) -> str:
    folders = {"tiny": REFERENCE / "tiny", "6l": folder / "6l", "6l-tuned": folder / "6l-tuned"}
    cols = [c for c in _columns(page, folders, "reference-forced") if c.label != "tiny / reason"]
    return "\n".join(equal_memory_table(cols, BASELINES, RETENTIONS)) + "\n" + page.source(page.data / folder)


renderer("accuracy-equal-memory")(partial(_equal_memory, folder=REFERENCE))

#: Lazy retention and kara-retain on the second model, reference-forced, each in its own
#: folder (a cell's key holds no lazy knobs): the label their cells take here.
LAZY_FOLDERS = {
    "kara+lazy2": REFERENCE / "6l-lazy",
    "kara-retain": REFERENCE / "6l-retain",
    "kara-retain+lazy2": REFERENCE / "6l-retain-lazy",
}


@renderer("accuracy-lazy-equal-memory")
def _lazy_equal_memory(page: Page) -> str:
    """Lazy retention and kara-retain against Kara at the same r, and against the paper's
    four baselines at equal memory, on both families of the second model."""
    cols = _columns(page, {"6l": REFERENCE / "6l"}, "reference-forced")
    for label, folder in LAZY_FOLDERS.items():
        for extra in _columns(page, {"6l": folder}, "reference-forced"):
            col = next(c for c in cols if c.label == extra.label)
            col.cells.update({(label, r): cell for (m, r), cell in extra.cells.items() if m != FULL})
    parts = []
    for label in LAZY_FOLDERS:
        parts.append(f"**`{label}`** minus Kara at the same r, then minus each baseline at equal memory:\n")
        rows = side_by_side.difference_table(cols, ["kara"], RETENTIONS, reference=label)
        rows += equal_memory_table(cols, BASELINES, RETENTIONS, reference=label)[2:]
        parts.append("\n".join(rows) + "\n")
    return "\n".join(parts) + page.source(*(page.data / f for f in LAZY_FOLDERS.values()))


renderer("accuracy-equal-memory-v1")(partial(_equal_memory, folder=REFERENCE_V1))


@renderer("accuracy-claims")
def _claims(page: Page) -> str:
    """The paper's claim (a) for Kara at r=0.2, on every testbed of the shipped models."""
    cols = _columns(page, {"tiny, forced": REFERENCE / "tiny", "6l v2, forced": REFERENCE / "6l"}, "reference-forced")
    cols = [c for c in cols if c.label != "tiny, forced / reason"]
    cols += _columns(page, {"6l v2, own chains, teacher-forced": OWN_CHAINS}, "teacher-forced")
    cols += _columns(page, {"6l v2, own chains, free": OWN_CHAINS}, "free")
    return "\n".join(target_table(cols)) + "\n" + page.source(page.data / REFERENCE, page.data / OWN_CHAINS)


@renderer("accuracy-claims-record")
def _claims_record(page: Page) -> str:
    """Claim (a) on the versions and stages that no longer ship."""
    cols = _columns(page, {"6l v1, forced": REFERENCE_V1 / "6l"}, "reference-forced")
    stage7 = Path("training") / "6l-stage-7" / "claim-a"
    cols += _columns(page, {"6l stage 7, free": stage7}, "free")
    return "\n".join(target_table(cols)) + "\n" + page.source(page.data / REFERENCE_V1 / "6l", page.data / stage7)


def _frontier(page: Page, folder: Path, family: str, mode: str, levels: Sequence[float]) -> str:
    table = frontier_markdown(_every_window(page.data, folder, family, mode), levels).split("\n", 2)[
        2
    ]  # without its title line
    return table.rstrip("\n") + "\n" + page.source(page.data / folder / "results.jsonl")


def _every_window(data: Path, folder: Path, family: str, mode: str) -> list[dict]:
    return [
        row
        for window, buffer in ((64, 16), (128, 32), (256, 64))
        for row in _lookup(data, folder, family, mode, window, buffer)
    ]


@renderer("accuracy-frontier-6l-reason")
def _frontier_6l(page: Page) -> str:
    levels = (0.15, 0.2, 0.25, 0.3, 0.4, 0.45, 0.6, 0.7)
    table = _frontier(page, REFERENCE / "6l", "reason", "reference-forced", levels)
    return table + page.image(page.data / REFERENCE / "6l" / "frontier.png", "fidelity against KV held, 6l v2")


@renderer("accuracy-frontier-tiny-trace")
def _frontier_tiny(page: Page) -> str:
    levels = (0.3, 0.4, 0.45, 0.55, 0.6, 0.7, 0.85)
    table = _frontier(page, TINY_TRACE, "trace", "teacher-forced", levels)
    return table + page.image(page.data / TINY_TRACE / "frontier.png", "fidelity against KV held, tiny model")


@renderer("accuracy-tiny-trace")
def _tiny_trace(page: Page) -> str:
    return retention_table(page, TINY_TRACE, "trace", "teacher-forced", TRACE_METHODS)


@renderer("accuracy-tiny-trace-off-floor")
def _tiny_trace_off_floor(page: Page) -> str:
    return retention_table(page, TINY_TRACE, "trace", "teacher-forced", TRACE_METHODS, value="nonmodal")


@renderer("accuracy-tiny-trace-free")
def _tiny_trace_free(page: Page) -> str:
    return retention_table(page, TINY_TRACE, "trace", "free", TRACE_METHODS)


@renderer("reason-chains")
def _reason_chains(page: Page) -> str:
    """What the families' reference chains ask of a cache, as ``tools/chain_report.py`` wrote it."""
    path = page.data / ACCURACY / "reason-chains" / "chains-train-tokenizer.md"
    report = path.read_text().split("\n", 2)[2]  # without its tokenizer line and the blank after it
    return report.rstrip("\n") + "\n" + page.source(path)


# The appendix's record: the same report functions on the cells the results pages leave out.
OTHER_BASELINES = ("pyramidkv", "snapkv", "adakv", "chunkkv", "kara-topk", "kara-causal")
TRACE_BASELINES = tuple(m for m in TRACE_METHODS if m != "kara")
MORE_METHODS = ACCURACY / "tiny-trace-more-methods"
# The further methods, the best first at r=0.2 on the test seeds, then Kara.
FURTHER_METHODS = (
    "noncausal-attn",
    "kara-vpool",
    "compactor",
    "kara-vnorm",
    "kara-pool",
    "kara-twoway",
    "expected-attention",
    "tova",
    "qfilter",
    "lagkv",
    "keydiff",
    "knorm",
    "kara",
)

_FORCED = {"family": "reason", "mode": "reference-forced"}
_TRACE = {"family": "trace", "mode": "teacher-forced"}
_BOUND_METHODS = (ORACLE, "bound", "noncausal-attn", "kara-vpool", "kara")
for _name, _render in {
    "accuracy-reference-6l-differences": partial(
        difference_table, folder=REFERENCE / "6l", methods=(ORACLE, *OTHER_BASELINES), **_FORCED
    ),
    "accuracy-reference-6l-tuned-differences": partial(
        difference_table, folder=REFERENCE / "6l-tuned", methods=BASELINES, **_FORCED
    ),
    "accuracy-v1-tuned": partial(
        retention_table,
        folder=REFERENCE_V1 / "6l-tuned",
        methods=CLAIM_METHODS,
        full_from=REFERENCE_V1 / "6l",
        **_FORCED,
    ),
    "accuracy-v1-tuned-differences": partial(
        difference_table, folder=REFERENCE_V1 / "6l-tuned", methods=BASELINES, **_FORCED
    ),
    "accuracy-tiny-trace-differences": partial(difference_table, folder=TINY_TRACE, methods=TRACE_BASELINES, **_TRACE),
    "accuracy-tiny-trace-off-floor-differences": partial(
        difference_table, folder=TINY_TRACE, methods=TRACE_BASELINES, key="vs_reference_nonmodal", **_TRACE
    ),
    "accuracy-tiny-trace-free-differences": partial(
        difference_table, folder=TINY_TRACE, family="trace", mode="free", methods=TRACE_BASELINES
    ),
    "accuracy-more-methods": partial(retention_table, folder=MORE_METHODS / "test", methods=FURTHER_METHODS, **_TRACE),
    "accuracy-bound": partial(retention_table, folder=MORE_METHODS / "test", methods=_BOUND_METHODS, **_TRACE),
}.items():
    renderer(_name)(_render)


@renderer("accuracy-v1-differences")
def _v1_differences(page: Page) -> str:
    cols = _columns(page, {"tiny": REFERENCE / "tiny", "6l v1": REFERENCE_V1 / "6l"}, "reference-forced")
    cols = [c for c in cols if c.label != "tiny / reason"]
    table = side_by_side.difference_table(cols, OTHER_BASELINES, RETENTIONS)
    return "\n".join(table) + "\n" + page.source(page.data / REFERENCE_V1 / "6l")


@renderer("accuracy-tiny-trace-dev-sweep")
def _dev_sweep(page: Page) -> str:
    """The trace sweep's table, as ``tools/dev_sweep.py`` wrote it (its cells are not stored)."""
    path = page.data / TINY_TRACE / "dev-sweep.md"
    return path.read_text().rstrip("\n") + "\n" + page.source(path)


# --- models (their Full-KV evaluations) --------------------------------------------------------

TRAINING = Path("training")
# kara-reasoner-6l's evaluated checkpoints, in training order: (label, folder, families' folders).
STAGES = (
    ("stage 2", TRAINING / "6l-stages-1-2", ("eval-trace", "eval-reason")),
    ("stage 3 = v1", TRAINING / "6l-stage-3", ("eval-trace", "eval-reason")),
    ("stage 6", TRAINING / "6l-stage-6", ("eval-trace", "eval-reason")),
    ("stage 7", TRAINING / "6l-stage-7", ("eval-trace", "eval-reason")),
    ("stage 8", TRAINING / "6l-stages-8-9" / "stage8", ("eval-trace", "eval-reason")),
    ("stage 10a", TRAINING / "6l-stages-10-11" / "test", ("stage10a-eval-trace", "stage10a-eval-reason")),
    ("stage 10b", TRAINING / "6l-stages-10-11" / "test", ("stage10b-eval-trace", "stage10b-eval-reason")),
    ("stage 11a = v2", TRAINING / "6l-stages-10-11" / "test", ("stage11a-eval-trace", "stage11a-eval-reason")),
)


@renderer("models-6l-stages")
def _models_6l_stages(page: Page) -> str:
    """The second model's Full-KV bars for each evaluated stage: free-running, 16 test seeds."""
    lines = [
        "| checkpoint | family | values read back [95% CI] | off the floor | modal result share "
        "| prompt reads | answer recall / exact match |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    sources = []
    for label, folder, evals in STAGES:
        for name in evals:
            sources.append(page.data / folder / name / "results.jsonl")
            for family in ("trace", "gen-needle", "reason"):
                full = [r for r in _lookup(page.data, folder / name, family, "free") if r["method"] == FULL]
                if not full:
                    continue
                row = full[0]
                answer = f"exact {row['accuracy']:.3f}" if family == "trace" else f"recall {row['recall']:.3f}"
                nonmodal = "-" if row["nonmodal"] is None else f"{row['nonmodal']:.3f}"
                share = "-" if row["modal_result_share"] is None else f"{row['modal_result_share']:.3f}"
                lines.append(
                    f"| {label} | {family} | {_ci(row['fidelity'], row['fidelity_ci'])} | {nonmodal} | {share} "
                    f"| {row['fidelity_prompt']:.3f} | {answer} |"
                )
    folders = sorted({p.parent.parent for p in sources})
    return "\n".join(lines) + "\n" + page.source(*folders)


V3 = Path("training") / "6l-v3"
STOP_ROW = re.compile(r"^\| (?P<subset>[^|]+) \| (?P<p>[0-9.]+) \| (?P<k>\d+)/(?P<n>\d+) \|$", re.M)


@renderer("models-6l-v3-attempts")
def _models_6l_v3(page: Page) -> str:
    """Each v3 candidate against its acceptance criteria, on development seeds, below v2 as
    it ships: the recipe, Full KV's free-running grades on 48 reason tasks, ``random`` at
    r=0.2's statements right, and the stop under dropped keys."""
    lines = [
        "| model | recipe | tokens | Full KV: statements right / stopped / answers (48 tasks) "
        "| Full KV chain tokens (mean) | answers naming the asked variable (of them right) "
        "| wrong answers naming the last result | random r=0.2: statements right "
        "| P(stop), far operand values dropped | P(stop), a random 80% of far keys dropped |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    sources = []
    attempts = sorted((page.data / V3).glob("attempt-*"), key=lambda f: int(f.name.removeprefix("attempt-")))
    for folder in [page.data / V3 / "v2", *attempts]:
        name, recipe, tokens = "v2", "as shipped", "-"
        if folder.name != "v2":
            training = json.loads((folder / "training.json").read_text())
            args = training["args"]
            recipe = f"--drop-far {args['drop_far']} --drop-clean {args['drop_clean']} from {args['init_from']}"
            for flag in ("drop_unscored", "drop_answer_whole"):
                if args.get(flag) == "True":
                    recipe += ", --" + flag.replace("_", "-")
            if float(args.get("long_share", 0)):
                recipe += f", --long-share {args['long_share']}"
            if float(args.get("answer_weight", 10)) != 10:
                recipe += f", --answer-weight {args['answer_weight']}"
            name, tokens = f"attempt {folder.name.removeprefix('attempt-')}", f"{training['train_tokens'] / 1e6:.2f}M"
            if mix := training.get("interpolation"):  # no training of its own: two checkpoints' weights mixed
                recipe = f"{1 - mix['alpha']:g} x {mix['base']} + {mix['alpha']:g} x {mix['tuned']} (weights)"
                tokens = "-"
            sources.append(folder / "training.json")
        grades, length, asked, last, random = "not evaluated", "-", "-", "-", "-"
        cells = folder / "dev" / "results.jsonl"
        if cells.exists():
            rows = {(r["method"], r["retention"]): r for r in map(json.loads, cells.read_text().splitlines())}
            full = rows[FULL, 1.0]
            n = full["n"]
            grades = f"{full['statements']:.3f} / {round(full['stopped'] * n)} / {round(full['answered'] * n)}"
            length = f"{full['mean_new_tokens']:.0f}"
            texts = folder / "dev" / "completions" / "full-r1.0-reason-W128b32.jsonl.gz"
            named, right_named, last_result = _answer_lines(full, texts)
            asked, last = f"{named} ({right_named})", f"{last_result} of {n - full['correct']}"
            sources.append(texts)
            if ("random", 0.2) in rows:
                cell = rows["random", 0.2]
                random = f"{cell['statements']:.3f} (W={cell['window']}, b={cell['buffer']})"
            sources.append(cells)
        far = rand = "-"
        if (folder / "stop_ablation.txt").exists():
            stop = {m["subset"]: m for m in STOP_ROW.finditer((folder / "stop_ablation.txt").read_text())}
            far = "{p} ({k}/{n} chains > 0.5)".format(**stop["far operand values"].groupdict())
            rand = stop["a random 80% of far"]["p"]
            sources.append(folder / "stop_ablation.txt")
        row = [name, recipe, tokens, grades, length, asked, last, random, far, rand]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n" + page.source(*sources)


def _answer_lines(cell: dict[str, Any], completions: Path) -> tuple[int, int, int]:
    """A free cell's answer lines, read once from its stored completions: how many name
    the variable the task asks for, how many of those are right, and how many wrong ones
    repeat the chain's last statement result (the miss of a model that reads the last
    line instead of the question). A reason task asks for its first statement's
    variable, so the chain's first statement names it."""
    import gzip

    from kvllm.eval.lookup import results
    from kvllm.eval.tasks import END_THINK, extract_answer

    with gzip.open(completions, "rt") as f:
        texts = [json.loads(line) for line in f]
    named = right_named = last = 0
    for problem, right, text in zip(cell["problems"], cell["per_problem"], texts, strict=True):
        assert problem["uid"] == text["uid"], f"{completions}: completions out of the problems' order"
        chain = text["text"]
        written = results(chain)
        answer = chain.split(END_THINK)[-1].split() if END_THINK in chain else []
        hit = bool(written and answer and answer[0].rstrip("0123456789") == written[0][0])
        named += hit
        right_named += hit and right
        last += bool(not right and written and extract_answer(chain) == chain[written[-1][2] :][:2])
    return named, right_named, last


@renderer("models-tiny-full-kv")
def _models_tiny(page: Page) -> str:
    """kara-reasoner-tiny's Full-KV exact match, from the first accuracy grid's Full-KV cells."""
    folder = page.data / ACCURACY / "tiny-exact-match"
    lines = ["| family | problems | chain-of-thought tokens (mean) | exact match |", "| --- | ---: | ---: | ---: |"]
    for cell in stored_cells(folder):
        if cell.method == FULL:
            lines.append(f"| {cell.family} | {cell.n} | {cell.mean_new_tokens:.0f} | {cell.correct} of {cell.n} |")
    return "\n".join(lines) + "\n" + page.source(folder / "results.jsonl")


# --- throughput (kvllm bench throughput folders) -----------------------------------------------

THROUGHPUT = Path("throughput")
# Block name -> the run's folder; docs/results/throughput.md (and, for the earlier runs, its
# record in docs/appendix/first-vllm-measurements.md) says what each run measured.
THROUGHPUT_RUNS = {
    "throughput-kara": "all4",
    "throughput-systems": ".",
    "throughput-c128": "c128",
    "throughput-after-preemption": "preempt",
    "throughput-pool16": "pool16",
    "throughput-matched": "matched",
    "throughput-mix": "mix",
    "throughput-long": "long3800",
    "throughput-no-pressure-512": "nopress512",
    "throughput-qwen3-0.6b": "qwen3-0.6b-4l",
    "throughput-inversion": "inversion",
}


@cache
def _throughput_summary(folder: Path) -> dict[str, Any]:
    return throughput_report.summarize(stored_rows(folder))


def _throughput_mean(data: Path, folder: Path, system: str) -> dict[str, float]:
    """``system``'s ratio to the baseline in the tightest pool: the mean over concurrency,
    and the lowest and highest concurrency's."""
    summary = _throughput_summary(data / folder)
    ratios = [c["ratio"] for c in summary["cells"] if (c["system"], c["pool"]) == (system, summary["tight_pool"])]
    return {"mean": statistics.fmean(ratios), "low": min(ratios), "high": max(ratios)}


def throughput_table(page: Page, run: str) -> str:
    """The run's cells, a row per pool, concurrency and system: output tok/s and its ratio to
    the baseline within repeats (mean [min-max]), preemptions, requests running, mean TTFT
    and TPOT, step time and the share of engine time spent compressing (means over
    repeats); then, when the run had an unpressured pool, the limit rows of
    :func:`kvllm.bench.report.summarize`."""
    folder = page.data / THROUGHPUT / run
    rows = stored_rows(folder)
    summary = _throughput_summary(folder)
    base = summary["baseline"]
    lines = [
        f"| pool | C | system | tok/s [min-max] | / {base} | preemptions | running | TTFT s | TPOT ms | step ms "
        "| compress % |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in summary["cells"]:
        mine = [
            r
            for r in rows
            if (r["system"], r["pool_blocks"], r["concurrency"]) == (c["system"], c["pool_blocks"], c["concurrency"])
        ]
        ttft = statistics.fmean(r["mean_ttft_s"] for r in mine)
        pool = c["pool"] if c["pool"] == str(c["pool_blocks"]) else f"{c['pool']} ({c['pool_blocks']})"
        ratio = "-" if c["system"] == base or c["ratio"] is None else f"{c['ratio']:.2f}"
        if ratio != "-" and c["repeats"] > 1:
            ratio += f" [{c['ratio_min']:.2f}-{c['ratio_max']:.2f}]"
        compress = "-" if c["system"] in UNCOMPRESSED else f"{100 * c['compress_share']:.1f}"
        tok_s = f"{c['tok_s_mean']:.0f} [{c['tok_s_min']:.0f}-{c['tok_s_max']:.0f}]"
        lines.append(
            f"| {pool} | {c['concurrency']} | {c['system']} | {tok_s} "
            f"| {ratio} | {c['preemptions']:.0f} | {c['mean_running']:.1f} | {ttft:.2f} | {c['mean_tpot_ms']:.1f} "
            f"| {c['mean_step_ms']:.1f} | {compress} |"
        )
    if summary["limit"]:
        lines += [
            "",
            f"Each system in pool {summary['tight_pool']} over {base} in pool {summary['ceiling_pool']} (no pressure), "
            "within repeats:",
            "",
            "| system | C | ratio [min-max] |",
            "| --- | ---: | ---: |",
        ]
        lines += [
            f"| {r['system']} | {r['concurrency']} | {r['ratio']:.2f} [{r['ratio_min']:.2f}-{r['ratio_max']:.2f}] |"
            for r in summary["limit"]
        ]
    return "\n".join(lines) + "\n" + page.source(rows_file(folder))


for _name, _run in THROUGHPUT_RUNS.items():
    renderer(_name)(partial(throughput_table, run=_run))


@renderer("throughput-kara-mean")
def _throughput_kara_mean(page: Page) -> str:
    """The headline's one number: Kara's ratio averaged over C = 16-128, in one run."""
    speed = _throughput_mean(page.data, THROUGHPUT / "all4", "kara")
    return (
        f"Mean over C = 16, 32, 64, 128: **{speed['mean']:.2f}x** vLLM's output tokens/s "
        f"({speed['low']:.2f}x to {speed['high']:.2f}x by C).\n"
    )


# --- serving (kvllm bench serve and kvllm bench soak folders) ----------------------------------

SERVING = Path("serving")
SERVING_RUNS = {
    "serving-c16": ".",
    "serving-sweep": "sweep",
    "serving-shared-prefix-c16": "shared-prefix/c16",
    "serving-shared-prefix-c32": "shared-prefix/c32",
    "serving-multi-turn": "multi-turn/c16",
    "serving-multi-turn-stripped": "multi-turn-stripped/c16",
}


def serving_table(page: Page, run: str) -> str:
    """The run's summary table, as ``kvllm bench serve`` writes it (``summary.md``)."""
    folder = page.data / SERVING / run
    cells = serving_report.summarize(stored_rows(folder))
    return serving_report.markdown_table(cells) + page.source(rows_file(folder))


for _name, _run in SERVING_RUNS.items():
    renderer(_name)(partial(serving_table, run=_run))

# The soaks' reports (``kvllm bench soak`` writes soak.md; only the later runs kept soak.json).
SOAKS = (
    ("kvllm serve, first run", "soak/kvllm-first.md"),
    ("kvllm serve, second run", "soak/kvllm.md"),
    ("vLLM's own server", "soak/vanilla.md"),
    ("kvllm serve, shared 300-token prefix", "soak-prefix/soak.md"),
    ("kvllm serve, shared 300-token prefix", "soak-prefix10k/soak.md"),
    (
        "kvllm serve, 96-token prefill chunks, shared and block-aligned prefixes, off requests replayed",
        "soak-chunked/soak.md",
    ),
    ("the same, strict (`KVLLM_STRICT=1`)", "soak-strict/soak.md"),
)
SOAK_HEAD = re.compile(r"# Soak: (?P<requests>\d+) requests, (?P<seconds>\d+) s")
SOAK_COUNTS = re.compile(r"finished (\d+), cancelled (\d+), rejected (\d+), failed (\d+)")
SOAK_TOTALS = re.compile(r"Over the soak: (\d+) preemptions, (\d+) compression rounds")
SOAK_RSS = re.compile(r"(python|VLLM::EngineCore|VLLM::Worker)-\d+ ([+-]\d+\.\d)%")
SOAK_REFUSED = re.compile(r"\| no round refused \(strict\) \| (True|False) \| (\d+) \|")


@renderer("serving-soak")
def _soak(page: Page) -> str:
    lines = [
        "| run | requests | seconds | finished / cancelled / refused / failed | preemptions | rounds "
        "| rounds refused | blocks back | RSS growth after warm-up: API / EngineCore / worker |",
        "| --- | ---: | ---: | --- | ---: | ---: | --- | --- | --- |",
    ]
    paths = []
    for label, name in SOAKS:
        path = page.data / SERVING / name
        paths.append(path)
        text = path.read_text()
        head = SOAK_HEAD.search(text)
        counts = "{:,} / {:,} / {:,} / {:,}".format(*map(int, SOAK_COUNTS.search(text).groups()))
        preemptions, rounds = SOAK_TOTALS.search(text).groups()
        growth: dict[str, str] = {}
        for process, percent in SOAK_RSS.findall(text):  # the server's process first, then its children
            growth.setdefault(process, percent)
        blocks = "yes" if "| every block back | True |" in text else "no"
        strict = SOAK_REFUSED.search(text)
        refused = f"{int(strict[2]):,}, strict" if strict else "not read (not strict)"
        rss = " / ".join(f"{growth[p]}%" for p in ("python", "VLLM::EngineCore", "VLLM::Worker"))
        lines.append(
            f"| {label} | {int(head['requests']):,} | {int(head['seconds']):,} | {counts} | {int(preemptions):,} "
            f"| {int(rounds):,} | {refused} | {blocks} | {rss} |"
        )
    return "\n".join(lines) + "\n" + page.source(*paths)


RANDOM_WORKLOADS = Path("random-workloads") / "record.jsonl"  # make test-slow's randomized differential
SHORT_OF_P = (("P-1", 1), ("P-2", 2), ("P-b", 32))  # the probes' prefill chunk ends (block size 32)


@renderer("random-workloads")
def _random_workloads(page: Page) -> str:
    """The stored run of the randomized scheduler differential: per engine shape, its
    examples, jobs, comparisons with vanilla vLLM, divergences, rounds and refusals, and
    how often each probed chunk end happened."""
    path = page.data / RANDOM_WORKLOADS
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    lines = [
        "| pool blocks / prefill chunk | examples (seeds) | jobs | compressing | compared with vanilla "
        "| diverged | rounds | rounds refused | "
        + " | ".join(f"examples with a chunk ending at {name}" for name, _ in SHORT_OF_P)
        + " |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in SHORT_OF_P) + " |",
    ]
    shapes = sorted({(r["pool_blocks"], r["chunk"]) for r in rows}, key=lambda shape: min(
        r["seed"] for r in rows if (r["pool_blocks"], r["chunk"]) == shape))  # fmt: skip
    for shape in [*shapes, None]:
        group = [r for r in rows if shape is None or (r["pool_blocks"], r["chunk"]) == shape]
        seeds = sorted(r["seed"] for r in group)
        label = "all" if shape is None else f"{shape[0]} / {shape[1]}"
        compressing = sum(r["kinds"][k] for r in group for k in ("kara", "lazy"))
        short = [sum(n in r["chunk_ends_short"] for r in group) for _, n in SHORT_OF_P]
        lines.append(
            f"| {label} | {len(group)} ({seeds[0]}-{seeds[-1]}) | {sum(r['jobs'] for r in group):,} "
            f"| {compressing:,} | {sum(r['compared_with_vanilla'] for r in group):,} "
            f"| {sum(r['diverged'] for r in group)} | {sum(r['rounds'] for r in group):,} "
            f"| {sum(r['rounds_refused'] for r in group)} | " + " | ".join(map(str, short)) + " |"
        )
    return "\n".join(lines) + "\n" + page.source(path)


TUNE = Path("tune")  # kvllm tune's stored runs: result.json, runs.jsonl, report.md, tune.png


def _tune(page: Page, name: str) -> str:
    """A stored ``kvllm tune`` run as its report prints it: the verdict, then every run."""
    from kvllm.tune import report

    folder = page.data / TUNE / name
    result = json.loads((folder / "result.json").read_text())
    body = report.markdown(result).split("\n", 2)[2]  # its title left out: the guide has its own
    body = body.replace("![accuracy and goodput against KV held](tune.png)\n", "")
    return (
        body.rstrip("\n")
        + "\n"
        + page.image(folder / "tune.png", "accuracy and goodput against KV held")
        + (page.source(folder / "result.json"))
    )


for _name in ("6l-v2-reason", "tiny-prompt-needle", "tiny-agreement"):
    renderer(f"tune-{_name}")(partial(_tune, name=_name))


COMPILE = SERVING / "compile-vs-eager"  # python tools/compile_timing.py


@renderer("compile-vs-eager")
def _compile_vs_eager(page: Page) -> str:
    """Eager against compiled engines: start-up, generation and its speed, per mode."""
    path = page.data / COMPILE / "results.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]

    def spread(values: list[float], digits: int = 1) -> str:
        return f"{statistics.mean(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"

    lines = [
        "| engine | runs | start-up s [min-max] | generation s [min-max] | output tokens/s [min-max] | rounds |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    groups = (
        ("eager", [r for r in rows if r["mode"] == "eager"]),
        ("compiled, first start (empty compile cache)", [r for r in rows if r.get("cold_compile_cache")]),
        ("compiled, later starts", [r for r in rows if r["mode"] == "compiled" and not r.get("cold_compile_cache")]),
    )
    for label, group in groups:
        rate = [r["output_tokens"] / r["generate_s"] for r in group]
        rounds = sorted({r["rounds"] for r in group})
        lines.append(
            f"| {label} | {len(group)} | {spread([r['startup_s'] for r in group])} "
            f"| {spread([r['generate_s'] for r in group])} | {spread(rate, 0)} | {', '.join(map(str, rounds))} |"
        )
    return "\n".join(lines) + "\n" + page.source(path)


# --- the pages ---------------------------------------------------------------------------------

MARKER = re.compile(r"^<!-- (?P<end>/?)results:(?P<name>[a-z0-9.-]+) -->$")


@dataclass(frozen=True)
class Block:
    name: str
    start: int  # the opening marker's line index
    stop: int  # the closing marker's line index


def blocks(lines: Sequence[str]) -> tuple[list[Block], list[str]]:
    """The blocks of a page's lines, and a message per marker that does not pair."""
    found, problems, open_at = [], [], None
    for i, line in enumerate(lines):
        marker = MARKER.match(line)
        if marker is None:
            continue
        name, closing = marker["name"], bool(marker["end"])
        if not closing and open_at is None:
            open_at = (name, i)
        elif closing and open_at is not None and open_at[0] == name:
            found.append(Block(name, open_at[1], i))
            open_at = None
        else:
            problems.append(f"line {i + 1}: {line} does not pair with the markers around it")
    if open_at is not None:
        problems.append(f"line {open_at[1] + 1}: block {open_at[0]!r} is never closed")
    return found, problems


CELL = re.compile(r"<!-- cell:(?P<ref>[^>]*?) -->(?P<value>.*?)<!-- /cell -->")
# A result typed into prose: a decimal (a trailing x for a ratio) or a percentage. A
# number right after "=", "@", "/", a comparison or a word character is a setting, a
# bound or part of a name, not a result.
PROSE_NUMBER = re.compile(r"(?<![\w.@=/<>≤≥~-])(?<![<>≤≥=] )(?:\d+(?:\.\d+)?%|\d+\.\d+x?(?![\w.]))")
CODE_SPAN = re.compile(r"`[^`]*`")


def checks_prose(path: Path) -> bool:
    """Whether ``path`` is a page whose prose may hold no hand-typed result."""
    at_root = path.name == "README.md" and (path.parent / "docs").is_dir()
    return at_root or (path.parent.name == "results" and path.parent.parent.name == "docs")


def table_cell(markdown: str, row: str, column: str) -> str:
    """The cell of a rendered markdown table at the row whose first column reads ``row``
    (or, for ``where H1=V1; H2=V2``, whose columns headed H1... read V1...) and the column
    whose header starts with ``column``, without its emphasis and interval."""
    tables = [
        [[c.strip() for c in line.strip().strip("|").split("|")] for line in chunk.strip().split("\n")]
        for chunk in re.findall(r"(?m)(?:^\|.*\|\s*$\n?)+", markdown)
    ]

    def index(header: list[str], prefix: str) -> int | None:
        found = [i for i, h in enumerate(header) if h.startswith(prefix)]
        return found[0] if len(found) == 1 else None

    for table in tables:
        header, body = table[0], table[2:]
        columns = [i for i, h in enumerate(header) if h.startswith(column)]
        # "where pool=8x; system=`kara@0.2`": the row whose cells read so, for tables whose
        # first column repeats.
        wanted = (
            [c.split("=", 1) for c in row.removeprefix("where ").split(";")]
            if row.startswith("where ")
            else [(header[0], row)]
        )
        where = [(index(header, h.strip()), v.strip()) for h, v in wanted]
        if any(i is None for i, _ in where):
            continue
        rows = [r for r in body if all(r[i].replace("**", "") == v for i, v in where)]
        if len(columns) == 1 and len(rows) == 1:
            return rows[0][columns[0]].split(" [")[0].replace("**", "").strip()
    raise KeyError(f"no table row {row!r} with one column {column!r}")


def prose_numbers(lines: Sequence[str], found: Sequence[Block]) -> list[str]:
    """A message per result number typed into prose, outside blocks, cells and code."""
    inside = {i for b in found for i in range(b.start, b.stop + 1)}
    problems, fence = [], False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fence = not fence
        if fence or i in inside or line.startswith("```"):
            continue
        for number in PROSE_NUMBER.findall(CODE_SPAN.sub("", CELL.sub("", line))):
            problems.append(f"line {i + 1}: result {number!r} typed into prose; quote it as a cell or remove it")
    return problems


def render_cells(
    lines: list[str], page: Page, renderers: dict[str, Renderer], fresh: dict[str, str]
) -> tuple[list[str], list[str]]:
    """``lines`` with every cell filled in from its table, and a message per stale or
    unknown cell. ``fresh`` caches the blocks rendered so far."""
    problems = []

    def fill(i: int, match: re.Match) -> str:
        ref = match["ref"]
        try:
            name, row, column = (part.strip() for part in ref.split("|"))
            if name not in fresh:
                fresh[name] = renderers[name](page)
            value = table_cell(fresh[name], row, column)
        except (ValueError, KeyError) as error:
            problems.append(f"line {i + 1}: cell {ref!r} names no table cell ({error})")
            return match[0]
        if value != match["value"]:
            problems.append(
                f"line {i + 1}: cell {ref!r} differs from its stored results: {match['value']!r}, its table {value!r}"
            )
        return f"<!-- cell:{ref} -->{value}<!-- /cell -->"

    return [CELL.sub(partial(fill, i), line) for i, line in enumerate(lines)], problems


def render_page(path: Path, data: Path, renderers: dict[str, Renderer] = RENDERERS) -> tuple[str, list[str], set]:
    """The page with every block and cell rendered anew; a message per stale block or
    cell, bad marker, or result typed into prose; and the names of the blocks it holds."""
    text = path.read_text()
    lines = text.split("\n")
    found, problems = blocks(lines)
    if checks_prose(path):
        problems += prose_numbers(lines, found)
    page = Page(path, data)
    rendered: dict[str, str] = {}
    out, done = [], 0
    for block in found:
        if block.name not in renderers:
            problems.append(f"block {block.name!r} has no renderer in tools/render_results.py")
            continue
        body = "\n".join(lines[block.start + 1 : block.stop])
        try:
            rendered[block.name] = renderers[block.name](page)
        except (OSError, KeyError, ValueError) as error:  # a stored file missing or malformed
            problems.append(f"block {block.name!r} cannot be rendered from its stored results: {error}")
            continue
        fresh = rendered[block.name].strip("\n")
        if body != fresh:
            old, new = [*body.split("\n"), ""], [*fresh.split("\n"), ""]
            first = next(
                (i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b), len(min(old, new, key=len)) - 1
            )
            problems.append(
                f"block {block.name!r} differs from its stored results at its line {first + 1}: "
                f"{old[first]!r}, rendered {new[first]!r}"
            )
        out += [*lines[done : block.start + 1], fresh]
        done = block.stop
    out += lines[done:]
    out, stale = render_cells("\n".join(out).split("\n"), page, renderers, rendered)
    return "\n".join(out), problems + stale, {b.name for b in found}


def pages(root: Path = ROOT) -> list[Path]:
    """README.md and every page under docs/, the stored results' own files left out."""
    docs = sorted(p for p in (root / "docs").rglob("*.md") if DATA not in p.parents)
    return [root / "README.md", *docs]


def run(paths: Iterable[Path], data: Path, write: bool, every_renderer: bool) -> list[str]:
    """Render ``paths``; rewrite the stale ones when ``write``. Returns a message per problem
    (when writing, the stale blocks it rewrote are none). With ``every_renderer``, a
    renderer whose block no page holds is a problem too."""
    for cached in (stored_rows, stored_cells, _lookup, _throughput_summary):
        cached.cache_clear()  # each run reads the stored files afresh
    problems, used = [], set()
    for path in paths:
        text, found, names = render_page(path, data)
        used |= names
        stale = [p for p in found if "differs from its stored results" in p]
        if write and stale:
            path.write_text(text)
            print(f"{_shown(path)}: rewrote {len(stale)} block(s)")
        problems += [f"{_shown(path)}: {p}" for p in found if not (write and p in stale)]
    if every_renderer:
        problems += [f"renderer {name!r} renders no block of any page" for name in sorted(set(RENDERERS) - used)]
    return problems


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if ROOT in path.parents else str(path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="Rewrite nothing; exit 1 naming each stale block.")
    parser.add_argument("--data", type=Path, default=DATA, help="The stored results (default: docs/results/data).")
    parser.add_argument("pages", type=Path, nargs="*", help="Pages to render (default: README.md and docs/).")
    args = parser.parse_args(argv)
    paths = [p.absolute() for p in args.pages] or pages()
    problems = run(paths, args.data.absolute(), write=not args.check, every_renderer=not args.pages)
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems and args.check:
        print(f"{len(paths)} pages: every results block matches its stored results")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
