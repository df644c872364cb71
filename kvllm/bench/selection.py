"""Time one window's selection for a model shape (scoring + choosing, no engine)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from rich.table import Table

from kvllm.config import CompressionConfig
from kvllm.methods import Window, build
from kvllm.methods.rope import Rope


@dataclass(frozen=True)
class SelectionTiming:
    method: str
    median_ms: float
    min_ms: float
    max_ms: float
    repeats: int


def time_selection(
    config: CompressionConfig,
    *,
    layers: int = 36,
    heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    batch: int = 1,
    repeats: int = 5,
    seed: int = 0,
) -> SelectionTiming:
    """Wall time of ``method.select`` over one window per sequence, fp32 inputs.

    The window has W + b queries, keys and values, as the periodic policy hands it over
    (random ones, at positions from 0). One untimed call first warms up allocators and
    kernels.
    """
    span = config.window + config.buffer
    gen = torch.Generator().manual_seed(seed)
    window = Window(
        queries=torch.randn(batch, layers, heads, span, head_dim, generator=gen),
        keys=torch.randn(batch, layers, kv_heads, span, head_dim, generator=gen),
        n_compress=config.window,
        # For the methods that draw (random, compactor's sketch), one stream per sequence.
        seeds=tuple(range(batch)),
        positions=(0,) * batch,
        values=torch.randn(batch, layers, kv_heads, span, head_dim, generator=gen),
        # Qwen3's RoPE base, for the methods that undo or redo the rotation.
        rope=Rope.from_inv_freq(1.0 / 1e6 ** (torch.arange(0, head_dim, 2) / head_dim), span),
    )
    method = build(config)
    method.select(window, config.budget)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        method.select(window, config.budget)
        times.append((time.perf_counter() - start) * 1e3)
    return SelectionTiming(config.method, statistics.median(times), min(times), max(times), repeats)


def timing_table(timings: list[SelectionTiming], window: int, buffer: int, shape: dict[str, int], batch: int) -> Table:
    """The timings as a rich table, titled with the shape they were measured on."""
    title = (
        f"selection of one window: W={window}, b={buffer}, {shape['layers']} layers, "
        f"{shape['heads']}q/{shape['kv_heads']}kv heads (torch threads: {torch.get_num_threads()})"
    )
    table = Table(title=title)
    for col in ("method", "batch", "median ms", "min ms", "max ms"):
        table.add_column(col, justify="right")
    for t in timings:
        table.add_row(t.method, str(batch), f"{t.median_ms:.1f}", f"{t.min_ms:.1f}", f"{t.max_ms:.1f}")
    return table
