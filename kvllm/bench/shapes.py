"""Random-weight model shapes for ``kvllm bench throughput --shape``.

Real shapes' widths and head layouts, with fewer layers so that this CPU runs a sweep
in minutes: per-token attention and KV bytes per layer are the real ones. The models
are built once (seeded) under ``~/.cache/kvllm/models/``.
"""

from __future__ import annotations

from pathlib import Path

SHAPES: dict[str, dict[str, int]] = {
    # The demo/test model of tools/make_tiny_model.py: overheads, not FLOPs, dominate.
    "tiny-qwen3": {"hidden_size": 128, "layers": 4, "heads": 4, "kv_heads": 2, "head_dim": 32},
    # Qwen3-0.6B: hidden 1024, 16 query / 8 KV heads of 128; 28 layers -> 4.
    "qwen3-0.6b-4l": {"hidden_size": 1024, "layers": 4, "heads": 16, "kv_heads": 8, "head_dim": 128},
    # Qwen3-4B: hidden 2560, 32 query / 8 KV heads of 128; 36 layers -> 2.
    "qwen3-4b-2l": {"hidden_size": 2560, "layers": 2, "heads": 32, "kv_heads": 8, "head_dim": 128},
}


def shape_model(shape: str) -> Path:
    """The random-weight model of ``shape``, built on first use."""
    if shape not in SHAPES:
        raise ValueError(f"--shape {shape!r} is invalid: must be one of {', '.join(SHAPES)}")
    from kvllm.testing import save_tiny_model

    path = Path.home() / ".cache" / "kvllm" / "models" / shape
    if not (path / "config.json").exists():
        save_tiny_model(path, **SHAPES[shape])
    return path
