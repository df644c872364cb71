"""``kvllm calibrate``: a model's Q-Filters, for the ``qfilter`` method."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kvllm.cli.options import TASK_FAMILIES, Op, console, load_model, model_path, split, trained_op
from kvllm.eval.tasks import FAMILIES, TRAIN_SEEDS


def calibrate(
    model: Annotated[Path | None, typer.Argument(help="Local model directory; default: shipped.")] = None,
    out: Annotated[Path, typer.Option(help="The calibration file to write (safetensors).")] = Path(
        "q_filters.safetensors"
    ),
    n: Annotated[int, typer.Option(help="Calibration texts.")] = 32,
    family: Annotated[
        list[str], typer.Option(help="Task families the texts cycle through (repeatable or commas).")
    ] = TASK_FAMILIES,
    op: Op = None,
) -> None:
    """Compute MODEL's Q-Filters and write them to --out, for --method qfilter.

    The texts are generated tasks, prompt and chain of thought, of the training seeds
    (the first N from 1,000,000, the families in turn): never a development or test seed,
    so no evaluated problem is seen. 32 texts of the trace families (about 1,000 tokens
    each) run through the model twice, once for the directions and once for their signs.
    --op gives the tasks an operator; by default, the one MODEL was trained on.
    Pass the file as params={"calibration": PATH}, --param qfilter:calibration=PATH or
    --calibration PATH (kvllm eval), --kv-calibration PATH (kvllm serve).
    """
    from dataclasses import replace

    from kvllm.eval.tasks import default_difficulty, make_task
    from kvllm.hf.calibrate import q_filters
    from kvllm.methods.qfilter import model_signature, save_calibration

    families = split(family)
    for f in families:
        if f not in FAMILIES:
            raise typer.BadParameter(f"--family {f!r} is invalid: must be one of {', '.join(FAMILIES)}")
    if n < 1:
        raise typer.BadParameter(f"--n {n} is invalid: must be >= 1")
    path = model_path(model)
    op = op or trained_op(path)
    try:
        difficulties = {f: replace(default_difficulty(f), op=op) for f in families}
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    tok, lm = load_model(path)
    picked = [families[i % len(families)] for i in range(n)]
    tasks = [make_task(f, TRAIN_SEEDS.start + i, difficulties[f]) for i, f in enumerate(picked)]
    inputs = [tok(t.text, return_tensors="pt")["input_ids"][0] for t in tasks]
    filters = q_filters(lm, inputs)
    layers, kv_heads, head_dim = filters.shape
    metadata = {
        "method": "qfilter",
        "model": str(path),
        **model_signature(lm.config),
        "queries": "post-RoPE, every token of every text",
        "op": op,
        "tasks": json.dumps([[t.family, t.seed] for t in tasks]),
        "tokens": str(sum(len(ids) for ids in inputs)),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    save_calibration(out, filters, metadata)
    console.print(
        f"wrote {out}: q_filters [{layers}, {kv_heads}, {head_dim}] from {n} texts ({metadata['tokens']} tokens) "
        f"of {', '.join(families)}, seeds {TRAIN_SEEDS.start}-{TRAIN_SEEDS.start + n - 1}"
    )
