"""Package data: the shipped small reasoning models (safetensors + tokenizer + card)."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL = "kara-reasoner-tiny"


def model_path(name: str = DEFAULT_MODEL) -> Path:
    """Directory of a shipped model, loadable offline with ``from_pretrained``."""
    path = Path(__file__).parent / name
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"shipped model {name!r} is missing at {path}")
    return path


def shipped() -> tuple[str, ...]:
    """The names of the shipped models, each a directory here with a ``config.json``."""
    return tuple(sorted(p.name for p in Path(__file__).parent.iterdir() if (p / "config.json").exists()))


def calibration_file(model: Path, method: str) -> Path | None:
    """The calibration file a model directory ships for ``method``
    (``calibration/METHOD.safetensors``, written by ``kvllm calibrate --kind METHOD``), if
    it has one. Not beside the weights: vLLM loads every ``*.safetensors`` there as a shard."""
    path = Path(model) / "calibration" / f"{method}.safetensors"
    return path if path.exists() else None
