"""``kvllm eval``: the accuracy grid."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvllm.cli.options import (
    ALL_FAMILIES,
    FAMILIES,
    METHODS,
    RETENTIONS,
    Buffer,
    D,
    Model,
    Period,
    Window,
    console,
    load_model,
    make_config,
    progress,
    split,
)


def evaluate(
    out: Annotated[Path, typer.Option(help="Output folder: results.jsonl/csv/json/md and accuracy.png.")] = Path(
        "eval-results"
    ),
    model: Model = None,
    method: Annotated[list[str], typer.Option(help="Methods (repeatable or comma-separated).")] = METHODS,
    retention: Annotated[list[str], typer.Option(help="Retentions (1.0 = Full KV; repeatable, commas).")] = RETENTIONS,
    family: Annotated[list[str], typer.Option(help="Task families (repeatable or comma-separated).")] = ALL_FAMILIES,
    n: Annotated[int, typer.Option(help="Problems per family.")] = 32,
    steps: Annotated[int, typer.Option(help="Program steps per task (CoT about 18 tokens each).")] = 40,
    constants: Annotated[int, typer.Option(help="Constants per program.")] = 12,
    depth: Annotated[float, typer.Option(help="prompt-needle depth in [0, 1].")] = 0.5,
    math_jsonl: Annotated[list[Path] | None, typer.Option(help="MATH/AIME jsonl files instead of tasks.")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Math problems: generation budget.")] = 4096,
    samples: Annotated[int, typer.Option(help="Samples per problem.")] = 1,
    temperature: Annotated[float, typer.Option(help="0 = greedy (math: use 0.6).")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus mass (math: use 0.95).")] = 1.0,
    window: Window = D.window,
    buffer: Buffer = D.buffer,
    period: Period = D.period,
    batch_size: Annotated[int, typer.Option(help="Prompts generated together.")] = 8,
) -> None:
    """Accuracy vs retention for every method: a table, a CSV/JSON and a plot. Resumes."""
    from kvllm.eval.grid import cells, run_grid
    from kvllm.eval.math_data import load_math
    from kvllm.eval.problems import task_problems
    from kvllm.eval.report import accuracy_markdown, accuracy_rich, plot_accuracy
    from kvllm.eval.tasks import Difficulty

    methods, retentions, families = split(method), split(retention, float), split(family)
    base = make_config(window=window, buffer=buffer, period=period)
    for m, r in ((m, r) for m in methods for r in retentions):
        make_config(method=m, retention=r, window=window, buffer=buffer, period=period)
    for f in families:
        if f not in FAMILIES:
            raise typer.BadParameter(f"--family {f!r} is invalid: must be one of {', '.join(FAMILIES)}")
    try:
        difficulty = Difficulty(constants=constants, steps=steps, depth=depth)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    tok, lm = load_model(model)
    if math_jsonl:
        problems = {p.stem: load_math(p, tok, max_new_tokens) for p in math_jsonl}
    else:
        problems = {f: task_problems(f, n, difficulty, tok) for f in families}
    total = sum(len(problems[f]) * samples for _, _, f in cells(methods, retentions, list(problems)))
    with progress() as bar:
        job = bar.add_task("eval", total=total)
        sampling = {"samples": samples, "temperature": temperature, "top_p": top_p}
        results = run_grid(
            lm, tok, problems, methods, retentions, base, out, batch_size=batch_size, **sampling,
            on_progress=lambda name, k: bar.update(job, advance=k, description=name),
        )  # fmt: skip
    plot_accuracy(results, out / "accuracy.png", title=f"W={window} b={buffer} P={period}")
    (out / "results.md").write_text(accuracy_markdown(results))
    console.print(accuracy_rich(results))
    console.print(f"wrote {out / 'results.csv'}, {out / 'results.json'}, {out / 'results.md'}, {out / 'accuracy.png'}")
