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

from kvllm.config import CompressionConfig

app = typer.Typer(help="KvLLM: reasoning-LLM serving with Kara KV-cache compression.", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks (speed targets live here, not in unit tests).", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
console = Console()


class Backend(StrEnum):
    hf = "hf"


@app.callback()
def main() -> None:
    """KvLLM command line."""


@app.command()
def generate(
    prompts: Annotated[list[str], typer.Argument(help="One or more prompts, generated as one batch.")],
    model: Annotated[Path, typer.Option(help="Local model directory (transformers format).")],
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
) -> None:
    """Generate with KV compression and print the texts and the cache statistics."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvllm.hf import generate as hf_generate

    try:
        config = None
        if method != "none":
            config = CompressionConfig(
                method=method, retention=retention, window=window, buffer=buffer, period=period, policy=policy
            )
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    if not model.is_dir():
        raise typer.BadParameter(f"--model {model} is not a model directory")
    tok = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
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
            on_step=lambda n: progress.update(task, completed=n),
        )
        elapsed = time.perf_counter() - start
    for i, text in enumerate(result.texts):
        console.rule(f"prompt {i}")
        console.print(prompts[i] + text, markup=False, highlight=False)
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


if __name__ == "__main__":
    app()
