"""The accuracy grid: methods x retentions x problem families, on the reference backend.

Every finished cell is appended to ``results.jsonl`` at once, so an interrupted run
resumes where it stopped. Retention 1.0 keeps every token whatever the method, so it is
run once per family as the ``full`` (Full KV) cell and shared by every method's curve.
"""

from __future__ import annotations

import csv
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kvllm.config import CompressionConfig
from kvllm.eval.problems import Problem

FULL = "full"
# Methods default to every registered one (kvllm.methods.available()).
DEFAULT_RETENTIONS = (0.1, 0.2, 0.3, 0.5, 1.0)


@dataclass(frozen=True)
class CellResult:
    method: str
    retention: float
    family: str
    n: int
    correct: int
    accuracy: float
    mean_new_tokens: float
    mean_kept: float  # physical / logical length at the end, averaged
    seconds: float
    per_problem: list[bool]

    @property
    def key(self) -> tuple[str, float, str]:
        return (self.method, self.retention, self.family)


def cells(methods: Sequence[str], retentions: Sequence[float], families: Sequence[str]) -> list[tuple[str, float, str]]:
    """The distinct (method, retention, family) cells, Full KV once per family."""
    out: list[tuple[str, float, str]] = []
    for family in families:
        if any(r >= 1.0 for r in retentions):
            out.append((FULL, 1.0, family))
        out += [(m, r, family) for m in methods for r in retentions if r < 1.0]
    return out


def load_results(path: Path) -> dict[tuple[str, float, str], CellResult]:
    if not path.exists():
        return {}
    results = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = CellResult(**json.loads(line))
            results[r.key] = r
    return results


def run_accuracy_cell(
    model,
    tokenizer,
    problems: Sequence[Problem],
    config: CompressionConfig | None,
    *,
    batch_size: int,
    samples: int = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    on_problem: Callable[[int], None] | None = None,
) -> tuple[list[bool], list[int], list[float]]:
    """Per-sample correctness, new-token counts and kept ratios for ``problems``."""
    from kvllm.hf import generate  # transformers is heavy; `kvllm --help` should not wait

    correct, lengths, kept = [], [], []
    for sample in range(samples):
        for lo in range(0, len(problems), batch_size):
            batch = problems[lo : lo + batch_size]
            out = generate(
                model,
                tokenizer,
                [p.prompt for p in batch],
                config,
                max(p.max_new_tokens for p in batch),
                temperature=temperature,
                top_p=top_p,
                seed=sample * 1_000_003 + lo,
            )
            for p, text, ids, st in zip(batch, out.texts, out.token_ids, out.stats, strict=True):
                correct.append(p.grade(text))
                lengths.append(len(ids))
                kept.append(st.physical_length / st.logical_length)
            if on_problem is not None:
                on_problem(len(batch))
    return correct, lengths, kept


def run_grid(
    model,
    tokenizer,
    problems: dict[str, list[Problem]],
    methods: Sequence[str],
    retentions: Sequence[float],
    base: CompressionConfig,
    out_dir: Path,
    *,
    batch_size: int = 8,
    samples: int = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    on_progress: Callable[[str, int], None] | None = None,
) -> list[CellResult]:
    """Run every missing cell, append it to ``out_dir/results.jsonl``, and return all cells.

    ``base`` supplies window, buffer, period and the other knobs; each cell overrides
    method and retention. ``on_progress(cell_name, problems_done)`` drives a progress bar.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.jsonl"
    done = load_results(path)
    for method, retention, family in cells(methods, retentions, list(problems)):
        if (method, retention, family) in done:
            if on_progress is not None:
                on_progress("resumed", len(problems[family]) * samples)
            continue
        config = None if method == FULL else base.replace(method=method, retention=retention)
        name = f"{method} r={retention} {family}"
        start = time.perf_counter()
        correct, lengths, kept = run_accuracy_cell(
            model,
            tokenizer,
            problems[family],
            config,
            batch_size=batch_size,
            samples=samples,
            temperature=temperature,
            top_p=top_p,
            on_problem=None if on_progress is None else lambda k, name=name: on_progress(name, k),
        )
        result = CellResult(
            method=method,
            retention=retention,
            family=family,
            n=len(correct),
            correct=sum(correct),
            accuracy=sum(correct) / len(correct),
            mean_new_tokens=sum(lengths) / len(lengths),
            mean_kept=sum(kept) / len(kept),
            seconds=round(time.perf_counter() - start, 2),
            per_problem=correct,
        )
        with path.open("a") as f:
            f.write(json.dumps(asdict(result)) + "\n")
        done[result.key] = result
    wanted = set(cells(methods, retentions, list(problems)))
    results = [r for k, r in done.items() if k in wanted]
    write_tables(results, out_dir)
    return results


def write_tables(results: Sequence[CellResult], out_dir: Path) -> None:
    """``results.csv`` (one row per cell) and ``results.json`` (without per-problem lists)."""
    fields = [f for f in CellResult.__dataclass_fields__ if f != "per_problem"]
    rows = [{f: getattr(r, f) for f in fields} for r in sorted(results, key=lambda r: r.key)]
    with (out_dir / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    (out_dir / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
