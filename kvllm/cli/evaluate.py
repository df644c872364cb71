"""``kvllm eval``: the accuracy grid."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from kvllm.cli.options import (
    METHODS,
    RETENTIONS,
    TASK_FAMILIES,
    Buffer,
    D,
    Lazy,
    LazyKeep,
    Model,
    Op,
    Period,
    Window,
    console,
    load_model,
    make_config,
    parse_params,
    progress,
    split,
    trained_op,
)
from kvllm.eval.grid import FORCED_ONLY, SELECTORS
from kvllm.eval.tasks import FAMILIES
from kvllm.methods import available, calibrated


def evaluate(
    out: Annotated[Path, typer.Option(help="Output folder: results.jsonl/csv/json/md and accuracy.png.")] = Path(
        "eval-results"
    ),
    model: Model = None,
    method: Annotated[
        list[str], typer.Option(help="Methods (repeatable or comma-separated); default: all but qfilter.")
    ] = METHODS,
    retention: Annotated[list[str], typer.Option(help="Retentions (1.0 = Full KV; repeatable, commas).")] = RETENTIONS,
    family: Annotated[
        list[str], typer.Option(help="Task families (repeatable or comma-separated); 'reason' too, by name.")
    ] = TASK_FAMILIES,
    n: Annotated[int, typer.Option(help="Problems per family.")] = 32,
    steps: Annotated[
        int | None, typer.Option(help="Program steps per task; default 40 (reason: 84).", show_default=False)
    ] = None,
    constants: Annotated[
        int | None, typer.Option(help="Constants per program; default 12 (reason: 6).", show_default=False)
    ] = None,
    depth: Annotated[float, typer.Option(help="prompt-needle depth in [0, 1].")] = 0.5,
    op: Op = None,
    math_jsonl: Annotated[list[Path] | None, typer.Option(help="MATH/AIME jsonl files instead of tasks.")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Math problems: generation budget.")] = 4096,
    samples: Annotated[int, typer.Option(help="Samples per problem.")] = 1,
    temperature: Annotated[float, typer.Option(help="0 = greedy (math: use 0.6).")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus mass (math: use 0.95).")] = 1.0,
    window: Window = D.window,
    buffer: Buffer = D.buffer,
    period: Period = D.period,
    lazy: Lazy = D.lazy,
    lazy_keep: LazyKeep = D.lazy_keep,
    batch_size: Annotated[int, typer.Option(help="Prompts generated together.")] = 8,
    param: Annotated[
        list[str] | None,
        typer.Option(help="A method parameter, KEY=VALUE for every method or METHOD:KEY=VALUE for one (repeatable)."),
    ] = None,
    calibration: Annotated[
        Path | None,
        typer.Option(help="The model's `kvllm calibrate` file, for the methods that read one (kara-retain, qfilter)."),
    ] = None,
    teacher_forced: Annotated[
        bool, typer.Option(help="Force Full KV's completions through each method (methods oracle and bound allowed).")
    ] = False,
    reference_forced: Annotated[
        bool,
        typer.Option(
            help="Force each task's own completion (its true chain) through each method instead: reads of real "
            "values, graded whatever the model's arithmetic (methods oracle and bound allowed)."
        ),
    ] = False,
    split_: Annotated[str, typer.Option("--split", help="Seeds to run: test (reported) or dev (tuning).")] = "test",
    test_seeds: Annotated[str, typer.Option(help="Test seed range START:END (held out from tuning).")] = "0:100000",
    dev_seeds: Annotated[str, typer.Option(help="Development seed range START:END (tuning only).")] = "100000:200000",
) -> None:
    """Accuracy vs retention for every method: exact match, lookup fidelity, memory held;
    tables, CSV/JSON and plots. Resumes."""
    from kvllm.eval.grid import StoredCellsMismatch, cells, run_grid
    from kvllm.eval.math_data import load_math
    from kvllm.eval.problems import task_problems
    from kvllm.eval.report import (
        accuracy_markdown,
        accuracy_rich,
        frontier_markdown,
        headline_markdown,
        lookup_markdown,
        lookup_rows,
        plot_accuracy,
        plot_frontier,
        statements_markdown,
    )

    methods, retentions, families = split(method), split(retention, float), split(family)
    for r in retentions:
        if not 0.0 < r <= 1.0:
            raise typer.BadParameter(f"--retention {r} is invalid: must be in (0, 1]")
    if teacher_forced and reference_forced:
        raise typer.BadParameter("--teacher-forced and --reference-forced are exclusive: give one")
    mode = "teacher-forced" if teacher_forced else "reference-forced" if reference_forced else "free"
    for m in (m for m in FORCED_ONLY if m in methods and mode == "free"):
        raise typer.BadParameter(
            f"--method {m} is invalid without --teacher-forced or --reference-forced: it reads the forced sequence"
        )
    if reference_forced and math_jsonl:
        raise typer.BadParameter("--reference-forced is invalid with --math-jsonl: MATH problems have no reference")
    if lazy > 1 and (selectors := [m for m in methods if m in SELECTORS]):
        raise typer.BadParameter(f"--lazy {lazy} is invalid with --method {selectors[0]}: it has no score to carry")
    base = make_config(window=window, buffer=buffer, period=period, lazy=lazy, lazy_keep=lazy_keep)
    params = method_params(parse_params(param), methods)
    if calibration is not None:
        with_file = [m for m in methods if m in available() and calibrated(m)]
        if not with_file:
            raise typer.BadParameter(f"--calibration {calibration} is invalid: no method among --method reads one")
        for m in with_file:
            params[m]["calibration"] = str(calibration)
    for m, r in ((m, r) for m in methods if m not in SELECTORS for r in retentions):
        make_config(
            method=m, retention=r, window=window, buffer=buffer, period=period, lazy=lazy, lazy_keep=lazy_keep,
            params=params[m],
        )  # fmt: skip
    first_seed = _first_seed(split_, test_seeds, dev_seeds, n)
    for f in families:
        if f not in FAMILIES:
            raise typer.BadParameter(f"--family {f!r} is invalid: must be one of {', '.join(FAMILIES)}")
    op = op or trained_op(model)
    try:
        difficulties = {f: family_difficulty(f, constants, steps, depth, op) for f in families}
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    tok, lm = load_model(model)
    if math_jsonl:
        problems = {p.stem: load_math(p, tok, max_new_tokens) for p in math_jsonl}
    else:
        problems = {f: task_problems(f, n, difficulties[f], tok, first_seed=first_seed) for f in families}
    grid = cells(methods, retentions, list(problems), mode)
    total = sum(len(problems[f]) * samples for _, _, f, _ in grid)
    with progress() as bar:
        job = bar.add_task("eval", total=total)
        sampling = {"samples": samples, "temperature": temperature, "top_p": top_p}
        try:
            results = run_grid(
                lm, tok, problems, methods, retentions, base, out, batch_size=batch_size, **sampling,
                mode=mode, params=params,
                on_progress=lambda name, k: bar.update(job, advance=k, description=name),
            )  # fmt: skip
        except StoredCellsMismatch as err:
            raise typer.BadParameter(str(err), param_hint="--out") from err
    free = any(r.mode == "free" for r in results)  # exact match is a free-running grade
    if free:
        plot_accuracy(results, out / "accuracy.png", title=f"W={window} b={buffer} P={period}")
        (out / "results.md").write_text(accuracy_markdown(results))
    rows = lookup_rows(results)  # bootstraps every cell: once, for the tables and the plot
    tables = (
        statements_markdown(results),
        headline_markdown(rows),
        frontier_markdown(rows),
        lookup_markdown(results, rows),
    )
    (out / "lookup.md").write_text("\n".join(tables))
    plot_frontier(rows, out / "frontier.png", title=f"P={period}")
    if free:
        console.print(accuracy_rich(results))
        console.print(statements_markdown(results), markup=False, highlight=False)
        console.print(f"wrote results.csv/json/md, lookup.md, accuracy.png, frontier.png in {out}")
    else:
        console.print(headline_markdown(rows))
        console.print(f"wrote results.csv/json, lookup.md, frontier.png in {out} (forced cells: no exact match)")


def family_difficulty(family: str, constants: int | None, steps: int | None, depth: float, op: str = "add") -> Any:
    """The flags' difficulty for ``family``; a knob not given is the family's default."""
    from kvllm.eval.tasks import Difficulty, default_difficulty

    default = default_difficulty(family)
    return Difficulty(
        constants=default.constants if constants is None else constants,
        steps=default.steps if steps is None else steps,
        depth=depth,
        op=op,
    )


def method_params(pairs: dict, methods: list[str]) -> dict[str, dict]:
    """Each method's overrides: the unscoped ``KEY`` pairs and its own ``METHOD:KEY`` ones."""
    common = {k: v for k, v in pairs.items() if ":" not in k}
    out = {m: dict(common) for m in methods}
    for key, value in pairs.items():
        method, sep, name = key.partition(":")
        if not sep:
            continue
        if method not in out or method in SELECTORS:
            why = f"the {method} takes none" if method in SELECTORS else f"{method!r} is not among --method"
            raise typer.BadParameter(f"--param {key}={value} is invalid: {why}")
        out[method][name] = value
    return out


def _range(flag: str, text: str) -> range:
    from kvllm.eval.tasks import TEST_SEEDS

    start, sep, end = text.partition(":")
    try:
        seeds = range(int(start), int(end))
    except ValueError:
        seeds = range(0)
    if not sep or not seeds or seeds.start < TEST_SEEDS.start or seeds.stop > TEST_SEEDS.stop:
        raise typer.BadParameter(
            f"{flag} {text!r} is invalid: must be START:END with {TEST_SEEDS.start} <= START < END <= "
            f"{TEST_SEEDS.stop} (the seeds no training saw)"
        )
    return seeds


def _first_seed(which: str, test_seeds: str, dev_seeds: str, n: int) -> int:
    """The first seed of the chosen split, after checking the two splits are disjoint."""
    test, dev = _range("--test-seeds", test_seeds), _range("--dev-seeds", dev_seeds)
    if test.start < dev.stop and dev.start < test.stop:
        raise typer.BadParameter(
            f"--dev-seeds {dev_seeds} and --test-seeds {test_seeds} overlap: they must be disjoint"
        )
    if which not in ("test", "dev"):
        raise typer.BadParameter(f"--split {which!r} is invalid: must be test or dev")
    seeds = test if which == "test" else dev
    if n > len(seeds):
        raise typer.BadParameter(f"--n {n} is invalid: the {which} seeds {seeds.start}:{seeds.stop} hold {len(seeds)}")
    return seeds.start
