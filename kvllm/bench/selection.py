"""Time one window's selection for a model shape (scoring + choosing, no engine)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from rich.table import Table

from kvllm.config import CompressionConfig
from kvllm.methods import Window, build
from kvllm.methods.lazy import lazy_select
from kvllm.methods.rope import Rope


@dataclass(frozen=True)
class SelectionTiming:
    method: str
    median_ms: float
    min_ms: float
    max_ms: float
    repeats: int
    reads_values: bool = False  # the method's Method.reads_values


def _timed(call: Callable[[], object], repeats: int) -> list[float]:
    """Milliseconds of ``repeats`` calls of ``call``, after one untimed call that warms up
    allocators and kernels."""
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    return times


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
    (random ones, at positions from 0). Under lazy retention (``config.lazy`` > 1) it is
    a round after the first: the last round's candidates and their carried scores come
    first, and the round runs both cuts (:func:`~kvllm.methods.lazy.lazy_select`). One
    untimed call first warms up allocators and kernels.
    """
    n = config.lazy_first if config.lazy > 1 else 0
    queries = config.window + config.buffer
    span = n + queries
    gen = torch.Generator().manual_seed(seed)
    window = Window(
        queries=torch.randn(batch, layers, heads, queries, head_dim, generator=gen),
        keys=torch.randn(batch, layers, kv_heads, span, head_dim, generator=gen),
        n_compress=n + config.window,
        # For the methods that draw (random, compactor's sketch), one stream per sequence.
        seeds=tuple(range(batch)),
        positions=(0,) * batch,
        values=torch.randn(batch, layers, kv_heads, span, head_dim, generator=gen),
        # Qwen3's RoPE base, for the methods that undo or redo the rotation.
        rope=Rope.from_inv_freq(1.0 / 1e6 ** (torch.arange(0, head_dim, 2) / head_dim), span),
    )
    method = build(config)
    if n:
        carried = torch.randn(batch, layers, kv_heads, n, generator=gen)
        times = _timed(lambda: lazy_select(method, window, config.lazy_round(n), carried), repeats)
    else:
        times = _timed(lambda: method.select(window, config.budget), repeats)
    label = f"{config.method}+lazy{config.lazy}" if n else config.method
    return SelectionTiming(label, statistics.median(times), min(times), max(times), repeats, method.reads_values)


@dataclass(frozen=True)
class ReadTiming:
    """Median wall time of reading one round's window from vLLM's CPU paged layout
    (:func:`kvllm.vllm.paged.read_spans`)."""

    with_values_ms: float  # keys and values: for methods that read values
    keys_only_ms: float  # keys alone: for the rest (``Method.reads_values`` False)
    repeats: int


def time_window_read(
    *,
    layers: int = 36,
    kv_heads: int = 8,
    head_dim: int = 128,
    batch: int = 1,
    span: int = 160,
    block_size: int = 16,
    repeats: int = 5,
    seed: int = 0,
) -> ReadTiming:
    """Wall time of :func:`kvllm.vllm.paged.read_spans` over ``batch`` spans of ``span``
    slots in random blocks of every layer's cache, fp32 (the CPU backend's ``vec``
    layout), with the values and without."""
    from kvllm.vllm import paged

    gen = torch.Generator().manual_seed(seed)
    per_request = -(-span // block_size)
    blocks = batch * per_request + 1
    caches = [torch.randn(blocks, kv_heads, block_size, 2 * head_dim, generator=gen) for _ in range(layers)]
    tables = torch.randperm(blocks, generator=gen)[: batch * per_request].view(batch, per_request)
    slots = torch.stack([paged.slots_of(t, torch.arange(span), block_size) for t in tables])
    timed = {
        v: statistics.median(_timed(lambda v=v: paged.read_spans(caches, slots, values=v), repeats))
        for v in (True, False)
    }
    return ReadTiming(timed[True], timed[False], repeats)


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


def read_table(read: ReadTiming, timings: list[SelectionTiming]) -> Table:
    """Each method's round: the window's read (with the values only if the method reads
    them) and its selection; and what reading the values would add to it."""
    table = Table(title="a round: the window read from the paged cache, and the selection (median ms)")
    for col in ("method", "reads values", "read", "select", "round", "values would add"):
        table.add_column(col, justify="right")
    added = read.with_values_ms - read.keys_only_ms
    for t in timings:
        ms = read.with_values_ms if t.reads_values else read.keys_only_ms
        keys_round = read.keys_only_ms + t.median_ms
        table.add_row(
            t.method,
            "yes" if t.reads_values else "no",
            f"{ms:.1f}",
            f"{t.median_ms:.1f}",
            f"{ms + t.median_ms:.1f}",
            f"{added:+.1f} ({100 * added / keys_round:+.1f}%)",
        )
    return table
