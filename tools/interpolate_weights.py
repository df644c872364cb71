"""Interpolate two checkpoints of one model: ``(1 - ALPHA) * BASE + ALPHA * TUNED``.

Weight-space ensembling of a fine-tuned model with the model it started from (WiSE-FT:
Wortsman et al., "Robust fine-tuning of zero-shot models", arXiv 2109.01903) often keeps
what the fine-tuning taught and what it made the model forget. OUT gets TUNED's config,
tokenizer and ``training.json`` (its operator included), with the interpolation recorded.

    python tools/interpolate_weights.py BASE TUNED ALPHA OUT
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

WEIGHTS = "model.safetensors"


def interpolate(base: Path, tuned: Path, alpha: float, out: Path) -> None:
    """Write the interpolated checkpoint to ``out``; refuses checkpoints of other shapes."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"ALPHA {alpha} is invalid: must be in [0, 1]")
    a, b = load_file(base / WEIGHTS), load_file(tuned / WEIGHTS)
    if {k: v.shape for k, v in a.items()} != {k: v.shape for k, v in b.items()}:
        raise ValueError(f"{base} and {tuned} hold tensors of other names or shapes")
    out.mkdir(parents=True, exist_ok=True)
    for f in tuned.iterdir():
        if f.is_file() and f.name != WEIGHTS:
            shutil.copy(f, out / f.name)
    mixed = {k: ((1 - alpha) * a[k].float() + alpha * b[k].float()).to(b[k].dtype) for k in b}
    save_file(mixed, out / WEIGHTS, metadata={"format": "pt"})
    summary = json.loads((tuned / "training.json").read_text())
    summary["interpolation"] = {"base": str(base), "tuned": str(tuned), "alpha": alpha}
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    interpolate(Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]), Path(sys.argv[4]))
