"""What a generation returns, the same from both backends (hf and vLLM)."""

from __future__ import annotations

from dataclasses import dataclass

from rich.table import Table


@dataclass(frozen=True)
class SeqStats:
    """Cache statistics of one generated sequence.

    ``compress_seconds`` is the sequence's share of the time its rounds took.
    ``held_mean`` and ``held_end`` are the KV slots held for *generated* tokens over the
    generated tokens seen (physical over logical, the prompt left out), averaged over
    the decode steps and at the end; ``None`` where a backend does not track them.
    """

    logical_length: int
    physical_length: int
    compressions: int
    compress_seconds: float
    held_mean: float | None = None
    held_end: float | None = None


@dataclass(frozen=True)
class Generation:
    """Texts, token ids and cache statistics, one entry per prompt."""

    texts: list[str]
    token_ids: list[list[int]]
    stats: list[SeqStats]
    #: Teacher forcing only: per row, the model's argmax at each forced position.
    predictions: list[list[int]] | None = None


def stats_table(result: Generation, title: str) -> Table:
    """A rich table of ``result``'s per-sequence cache statistics."""
    table = Table(title=title)
    for col in ("seq", "new tokens", "logical len", "physical len", "kept %", "rounds", "compress s"):
        table.add_column(col, justify="right")
    for i, (ids, s) in enumerate(zip(result.token_ids, result.stats, strict=True)):
        table.add_row(
            str(i),
            str(len(ids)),
            str(s.logical_length),
            str(s.physical_length),
            f"{100.0 * s.physical_length / s.logical_length:.1f}",
            str(s.compressions),
            f"{s.compress_seconds:.3f}",
        )
    return table
