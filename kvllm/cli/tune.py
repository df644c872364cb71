"""``kvllm tune``: which compression setting keeps a model's answers, measured in vLLM."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kvllm.cli.options import Buffer, D, Period, Window, console, model_path, split, trained_op


def tune(
    model: Annotated[Path, typer.Argument(help="A local model directory or a shipped model's name.")],
    prompts: Annotated[
        Path | None,
        typer.Option(
            help='A jsonl of prompts: {"prompt": ...} or {"messages": [...]}, each with an optional "answer".'
        ),
    ] = None,
    family: Annotated[
        str | None, typer.Option(help="Instead of --prompts: a shipped task family (development seeds).")
    ] = None,
    n: Annotated[int, typer.Option(help="With --family: how many tasks.")] = 32,
    grader: Annotated[
        str,
        typer.Option(
            help="auto (a family's grade; math-verify with gold answers; else agreement), math, exact, agreement."
        ),
    ] = "auto",
    method: Annotated[list[str] | None, typer.Option(help="Methods to try (repeatable or commas).")] = None,
    retention: Annotated[
        list[str] | None, typer.Option(help="The coarse retention grid (repeatable or commas).")
    ] = None,
    window: Window = D.window,
    buffer: Buffer = D.buffer,
    period: Period = D.period,
    bisect: Annotated[int, typer.Option(help="Bisection steps per method below its smallest passing retention.")] = 2,
    concurrency: Annotated[int, typer.Option(help="Requests in flight (vLLM's max_num_seqs).")] = 16,
    num_gpu_blocks_override: Annotated[
        int | None, typer.Option(help="The KV pool in blocks (vLLM's flag); default: from --gpu-memory-utilization.")
    ] = None,
    gpu_memory_utilization: Annotated[float, typer.Option(help="vLLM's memory share for the pool.")] = 0.3,
    cap: Annotated[int, typer.Option(help="Tokens a completion may generate.")] = 4096,
    enforce_eager: Annotated[
        bool, typer.Option(help="vLLM's flag: run eager, as `kvllm serve --enforce-eager` would (default: compiled).")
    ] = False,
    min_accuracy: Annotated[float, typer.Option(help="Answers (or agreement) kept, as a share of Full KV's.")] = 0.98,
    min_stop: Annotated[float, typer.Option(help="Stop rate kept, as a share of Full KV's.")] = 0.95,
    max_length_change: Annotated[float, typer.Option(help="Mean chain length's largest change from Full KV's.")] = 0.05,
    calibration: Annotated[
        Path | None, typer.Option(help="The calibration file of kara-retain or qfilter, when one is tried.")
    ] = None,
    out: Annotated[
        Path, typer.Option(help="Output folder: runs.jsonl (resumable), report.md, tune.png, result.json.")
    ] = Path("tune-results"),
    json_output: Annotated[bool, typer.Option("--json", help="Print the result as JSON instead of a summary.")] = False,
) -> None:
    """Find the least KV that keeps MODEL's answers on your prompts, inside vLLM.

    Full KV runs first; then each method at each retention of the grid, and bisection
    below each method's smallest passing retention. The recommended setting is the one
    of least KV held whose 95% bounds keep every tolerance; its kvllm serve flags are
    printed, or what the best setting tried costs when none keeps them.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from kvllm.tune import Tolerances, Tune, family_prompts, load_prompts, run_tune
    from kvllm.tune.report import verdict, write

    if (prompts is None) == (family is None):
        raise typer.BadParameter("give exactly one of --prompts FILE or --family NAME")
    path = model_path(model)
    try:
        if prompts is not None:
            from transformers import AutoTokenizer

            loaded = load_prompts(prompts, AutoTokenizer.from_pretrained(path))
        else:
            loaded = family_prompts(family, n, trained_op(path))
        run = Tune(
            model=str(path),
            name=str(model),
            out=out,
            prompts=tuple(loaded),
            grader=grader,
            methods=tuple(split(method or ["kara,snapkv"])),
            retentions=tuple(split(retention or ["0.5,0.3,0.2,0.1"], float)),
            window=window,
            buffer=buffer,
            period=period,
            bisect=bisect,
            concurrency=concurrency,
            pool_blocks=num_gpu_blocks_override,
            memory=gpu_memory_utilization,
            cap=cap,
            eager=enforce_eager,
            tolerances=Tolerances(min_accuracy, min_stop, max_length_change),
            calibration=None if calibration is None else str(calibration),
        )
    except (ValueError, FileNotFoundError) as err:
        raise typer.BadParameter(str(err)) from err
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("tune", total=None)

        def advance(label: str, total: int) -> None:
            done = bar.tasks[0].completed + (bar.tasks[0].description != "tune")
            bar.update(task, description=label, total=total, completed=done)

        try:
            result = run_tune(run, progress=advance)
        except ValueError as err:  # stored runs made under other conditions
            raise typer.BadParameter(str(err)) from err
    report = write(result, out)
    text = json.dumps(result, indent=1)
    (out / "result.json").write_text(text + "\n")
    if json_output:
        print(text)
        return
    console.print(verdict(result))
    console.print(f"Report: {report}")
