"""``kvllm calibrate``: a model's calibration file, for ``qfilter`` or ``kara-retain``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kvllm.cli.options import TASK_FAMILIES, D, Op, console, load_model, model_path, split, trained_op
from kvllm.eval.tasks import FAMILIES, TRAIN_SEEDS


def shipped_name(path: Path) -> str | None:
    """A shipped model's name, for files that record their model (not its path on one machine)."""
    from kvllm.assets import model_path as shipped_path
    from kvllm.assets import shipped

    return path.name if path.name in shipped() and path.resolve() == shipped_path(path.name).resolve() else None


KINDS = ("qfilter", "kara-retain")


def calibrate(
    model: Annotated[Path | None, typer.Argument(help="Local model directory; default: shipped.")] = None,
    out: Annotated[Path, typer.Option(help="The calibration file to write (safetensors).")] = Path(
        "q_filters.safetensors"
    ),
    kind: Annotated[str, typer.Option(help=f"The method the file is for: {', '.join(KINDS)}.")] = "qfilter",
    n: Annotated[int, typer.Option(help="Calibration texts.")] = 32,
    family: Annotated[
        list[str], typer.Option(help="Task families the texts cycle through (repeatable or commas).")
    ] = TASK_FAMILIES,
    op: Op = None,
    window: Annotated[int, typer.Option(help="kara-retain: the windows the labels are taken in (W).")] = D.window,
    buffer: Annotated[
        int, typer.Option(help="kara-retain: a label counts queries at least W + b tokens later.")
    ] = D.buffer,
    retention: Annotated[float, typer.Option(help="kara-retain: the labels keep this share of a window.")] = 0.2,
) -> None:
    """Compute MODEL's calibration for --kind and write it to --out.

    The texts are generated tasks, prompt and chain of thought, of the training seeds
    (the first N from 1,000,000, the families in turn): never a development or test seed,
    so no evaluated problem is seen. --op gives the tasks an operator; by default, the one
    MODEL was trained on. qfilter: the model's Q-Filters, from its queries on the texts
    (32 texts of the trace families, about 1,000 tokens each, run twice). kara-retain:
    its retaining heads, a ridge regression per (layer, KV head) of the attention each
    chain-of-thought key would be kept by the oracle (the top --retention of its
    --window by the attention queries W + b or more tokens later give it), on the key
    and value (kvllm/methods/retain.py). Pass the file as params={"calibration": PATH},
    --param METHOD:calibration=PATH or --calibration PATH (kvllm eval), --kv-calibration
    PATH (kvllm serve).
    """
    from dataclasses import replace

    from kvllm.eval.tasks import default_difficulty, make_task
    from kvllm.methods.qfilter import FILTERS, model_signature, save_calibration
    from kvllm.methods.retain import WEIGHTS

    if kind not in KINDS:
        raise typer.BadParameter(f"--kind {kind!r} is invalid: must be one of {', '.join(KINDS)}")
    families = split(family)
    for f in families:
        if f not in FAMILIES:
            raise typer.BadParameter(f"--family {f!r} is invalid: must be one of {', '.join(FAMILIES)}")
    if n < 1:
        raise typer.BadParameter(f"--n {n} is invalid: must be >= 1")
    if window < 1 or buffer < 0 or not 0 < retention <= 1:
        raise typer.BadParameter(
            f"--window {window} / --buffer {buffer} / --retention {retention}: need W >= 1, b >= 0, 0 < r <= 1"
        )
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
    metadata = {
        "method": kind,
        "model": shipped_name(path) or str(path),
        **model_signature(lm.config),
        "op": op,
        "tasks": json.dumps([[t.family, t.seed] for t in tasks]),
        "tokens": str(sum(len(ids) for ids in inputs)),
    }
    if kind == "qfilter":
        from kvllm.hf.calibrate import q_filters

        tensor, name = q_filters(lm, inputs), FILTERS
        metadata["queries"] = "post-RoPE, every token of every text"
    else:
        from kvllm.hf.calibrate import retain_weights

        starts = [len(tok(t.prompt)["input_ids"]) for t in tasks]
        keep = max(1, round(retention * window))
        tensor, name = retain_weights(lm, inputs, starts, window + buffer, window, keep), WEIGHTS
        metadata["labels"] = (
            f"1 for the top {keep} of each {window}-token window by the attention of the queries "
            f"{window + buffer} or more tokens past the window's start, else 0; chain-of-thought keys"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    save_calibration(out, tensor, metadata, name=name)
    console.print(
        f"wrote {out}: {name} {list(tensor.shape)} from {n} texts ({metadata['tokens']} tokens) "
        f"of {', '.join(families)}, seeds {TRAIN_SEEDS.start}-{TRAIN_SEEDS.start + n - 1}"
    )
