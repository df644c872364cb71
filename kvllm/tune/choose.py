"""Which setting ``kvllm tune`` recommends: the least memory that keeps the tolerances.

Every candidate is compared with Full KV on the same prompts, paired: a bootstrap over
prompts gives each ratio (accuracy, stop rate, chain length) a confidence interval, and a
candidate passes when the interval's pessimistic end keeps the tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

RESAMPLES = 2000
CONFIDENCE = 0.95


@dataclass(frozen=True)
class Tolerances:
    """What a setting must keep of Full KV's: answers (or agreement) and stop rate as
    shares, and mean chain length within a relative change."""

    accuracy: float = 0.98
    stop: float = 0.95
    length: float = 0.05

    def __post_init__(self) -> None:
        for name in ("accuracy", "stop"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"--min-{name} {value} is invalid: must be in (0, 1]")
        if not 0.0 <= self.length < 1.0:
            raise ValueError(f"--max-length-change {self.length} is invalid: must be in [0, 1)")


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise ``sum(a) / sum(b)``; 1 where both are 0 (nothing to lose)."""
    num, den = a.sum(axis=-1), b.sum(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1), np.where(num > 0, np.inf, 1.0))


def paired_ratio(a: list[float], b: list[float], seed: int = 0) -> tuple[float, float, float]:
    """``sum(a) / sum(b)`` over the same prompts, with a percentile bootstrap interval."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    idx = np.random.default_rng(seed).integers(0, len(x), size=(RESAMPLES, len(x)))
    samples = _ratio(x[idx], y[idx])
    lo, hi = np.quantile(samples, [(1 - CONFIDENCE) / 2, (1 + CONFIDENCE) / 2])
    return float(_ratio(x, y)), float(lo), float(hi)


def summarize(records: list[dict[str, Any]], full: list[dict[str, Any]]) -> dict[str, Any]:
    """A candidate's figures against Full KV's, on the same prompts in the same order."""
    if [r["uid"] for r in records] != [f["uid"] for f in full]:
        raise ValueError("a candidate's prompts must be Full KV's, in the same order")

    def column(rows: list[dict[str, Any]], key: str) -> list[float]:
        return [float(r[key]) for r in rows]

    accuracy = paired_ratio(column(records, "score"), column(full, "score"))
    stop = paired_ratio(column(records, "stopped"), column(full, "stopped"))
    length = paired_ratio(column(records, "tokens"), column(full, "tokens"))
    held = sum(column(records, "held"))
    return {
        "accuracy": float(np.mean(column(records, "score"))),
        "accuracy_ratio": accuracy,
        "stop_rate": float(np.mean(column(records, "stopped"))),
        "stop_ratio": stop,
        "length_ratio": length,
        # KV of generated tokens held at the end: per request, and against Full KV's tokens.
        "kv_held_tokens": held / len(records),
        "kv_held": held / max(1.0, sum(column(full, "tokens"))),
        "agreement_position": float(np.mean([r["divergence"] or 0 for r in records])),
    }


def failures(summary: dict[str, Any], tol: Tolerances) -> list[str]:
    """Each tolerance whose interval's pessimistic end misses it, said with the numbers."""
    acc, stop, length = summary["accuracy_ratio"], summary["stop_ratio"], summary["length_ratio"]
    missed = []
    if acc[1] < tol.accuracy:
        missed.append(f"answers' 95% bound {acc[1]:.3f} below {tol.accuracy:g}")
    if stop[1] < tol.stop:
        missed.append(f"stop rate's 95% bound {stop[1]:.3f} below {tol.stop:g}")
    if length[1] < 1 - tol.length or length[2] > 1 + tol.length:
        missed.append(f"length's 95% interval [{length[1]:.3f}-{length[2]:.3f}] outside 1 ± {tol.length:g}")
    return missed


def passes(summary: dict[str, Any], tol: Tolerances) -> bool:
    """The pessimistic end of each interval keeps its tolerance."""
    return not failures(summary, tol)


def choose(candidates: list[dict[str, Any]], tol: Tolerances) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The passing candidate of least KV held (then of the best accuracy), or ``None``;
    and, when none passes, the best of the rest (highest accuracy bound, then least KV)."""
    passing = [c for c in candidates if passes(c["summary"], tol)]
    if passing:
        return min(passing, key=lambda c: (c["summary"]["kv_held"], -c["summary"]["accuracy_ratio"][1])), None
    if not candidates:
        return None, None
    best = max(candidates, key=lambda c: (c["summary"]["accuracy_ratio"][1], -c["summary"]["kv_held"]))
    return None, best
