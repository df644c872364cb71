"""Flags and helpers shared by the ``kvllm`` commands.

Flag names are shared across commands (``--method``, ``--retention``, ``--window``,
``--buffer``, ``--period``, ``--param``); list flags repeat or take commas. Defaults come
from :class:`~kvllm.config.CompressionConfig` and the method registry.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvllm.bench.shapes import SHAPES
from kvllm.bench.throughput import SYSTEMS
from kvllm.config import POLICIES, CompressionConfig
from kvllm.eval.grid import DEFAULT_RETENTIONS
from kvllm.eval.tasks import TRACE_FAMILIES
from kvllm.methods import available, calibrated

console = Console()
D = CompressionConfig()
# List defaults, as module-level values (typer reads them; nothing mutates them).
# Every method that runs without a per-model calibration file (qfilter needs one).
METHODS = [m for m in available() if not calibrated(m)]
RETENTIONS = [",".join(str(r) for r in DEFAULT_RETENTIONS)]
TASK_FAMILIES = list(TRACE_FAMILIES)
ALL_SYSTEMS = list(SYSTEMS)
CONCURRENCY = ["16,32,64,128"]
POOLS = ["8x,16x,max"]
SERVERS = ["vanilla,kara"]
SERVE_CONCURRENCY = ["16,32"]

Model = Annotated[
    Path | None,
    typer.Option(help="Local model directory (transformers format) or a shipped model's name; default: shipped."),
]
Shape = Annotated[str | None, typer.Option(help=f"A random-weight model instead: {', '.join(SHAPES)}.")]
Retention = Annotated[float, typer.Option(help="Fraction of each window kept, in (0, 1].")]
Window = Annotated[int, typer.Option(help="Window W: compressible tokens (a multiple of the block size).")]
Buffer = Annotated[int, typer.Option(help="Protected buffer b at the window's end.")]
Period = Annotated[int, typer.Option(help="Period P: a round every P of a sequence's decode steps.")]
Policy = Annotated[str, typer.Option(help=f"When to compress: {', '.join(POLICIES)}.")]
Lazy = Annotated[
    int, typer.Option(help="Lazy retention F: a window keeps F x its budget until the next window's queries cut it.")
]
LazyKeep = Annotated[float, typer.Option(help="Lazy retention: the cut's weight on stage one's score, in [0, 1].")]
Param = Annotated[list[str] | None, typer.Option(help="A method parameter, KEY=VALUE (repeatable), e.g. rho=0.4.")]
Op = Annotated[
    str | None,
    typer.Option(
        help="The tasks' operator: add (+/- mod 100) or shift; default: the one the model was trained on "
        "(its training.json), else add.",
        show_default=False,
    ),
]


class Backend(StrEnum):
    hf = "hf"
    vllm = "vllm"


def split(values: list[str], cast: Callable[[str], Any] = str) -> list[Any]:
    """Repeated and comma-separated values, flattened."""
    return [cast(v.strip()) for value in values for v in value.split(",") if v.strip()]


def parse_params(pairs: list[str] | None) -> dict[str, Any]:
    """``KEY=VALUE`` pairs; a value is read as JSON (numbers, booleans) or kept as text."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"--param {pair!r} is invalid: must be KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def make_config(**fields: Any) -> CompressionConfig:
    try:
        return CompressionConfig(**fields)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err


def model_path(model: Path | None) -> Path:
    """``model`` (a directory, or a shipped model's name) or the shipped default, checked
    to be a model directory; a local directory wins over a shipped model of its name."""
    from kvllm.assets import model_path as shipped_path
    from kvllm.assets import shipped

    if model is None:
        return shipped_path()
    if model.is_dir():
        return model
    if str(model) in shipped():
        return shipped_path(str(model))
    raise typer.BadParameter(f"--model {model} is not a model directory or a shipped model ({', '.join(shipped())})")


def trained_op(model: Path | None) -> str:
    """The tasks' operator ``model`` was trained on: ``tools/train_reasoner.py``'s ``--op``
    in the model's ``training.json``, or ``add``, the only one before ``--op`` existed.

    A model scores nothing on tasks of an operator it never learned: its arithmetic, and
    so every read of a result, is then wrong from the first step.
    """
    summary = model_path(model) / "training.json"
    if not summary.exists():
        # Said aloud: a checkpoint copied without its summary grades a shift-trained model
        # on add tasks, where it writes two statements and stops, as a broken model would.
        console.print(f"[yellow]{summary.parent} has no training.json: the tasks use --op add[/yellow]")
        return "add"
    return json.loads(summary.read_text())["args"].get("op", "add")


def model_or_shape(model: Path | None, shape: str | None) -> Path:
    """``--model`` (or the shipped default), or the random-weight model of ``--shape``."""
    from kvllm.bench.shapes import shape_model

    if model is not None and shape is not None:
        raise typer.BadParameter("give --model or --shape, not both")
    if shape is None:
        return model_path(model)
    try:
        return shape_model(shape)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err


def load_model(model: Path | None) -> tuple[Any, Any]:
    """Tokenizer and fp32 model, offline."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_path(model)
    # fp32: on CPUs without AMX/AVX-512 bf16 matmul is emulated and far slower.
    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def progress(label: str = "{task.description}") -> Progress:
    columns = (TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    return Progress(*columns, console=console, transient=True)
