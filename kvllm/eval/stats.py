"""Intervals for accuracy figures: Wilson for problem-level proportions, a bootstrap over
problems for read-level ratios (reads within one problem are correlated), and paired
differences on the same problems."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.stats import binomtest

CONFIDENCE = 0.95
RESAMPLES = 2000


def wilson(k: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Wilson score interval of ``k`` successes in ``n`` trials."""
    if n == 0:
        return (0.0, 1.0)
    ci = binomtest(k, n).proportion_ci(confidence_level=confidence, method="wilson")
    return (float(ci.low), float(ci.high))


def _bounds(samples: np.ndarray, confidence: float) -> tuple[float, float]:
    lo, hi = np.quantile(samples, [(1 - confidence) / 2, (1 + confidence) / 2])
    return (float(lo), float(hi))


def ratio_of_sums(right: Sequence[int], total: Sequence[int]) -> float:
    """Pooled ratio: all right reads over all reads."""
    n = float(np.sum(total))
    return float(np.sum(right)) / n if n else float("nan")


def bootstrap_ratio(
    right: Sequence[int], total: Sequence[int], confidence: float = CONFIDENCE, seed: int = 0
) -> tuple[float, float]:
    """Percentile interval of the pooled ratio, resampling whole problems."""
    r, t = np.asarray(right, dtype=float), np.asarray(total, dtype=float)
    idx = np.random.default_rng(seed).integers(0, len(r), size=(RESAMPLES, len(r)))
    sums = t[idx].sum(1)
    return _bounds(r[idx].sum(1) / np.where(sums > 0, sums, 1), confidence)


def paired_difference(
    right_a: Sequence[int],
    total_a: Sequence[int],
    right_b: Sequence[int],
    total_b: Sequence[int],
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> tuple[float, float, float]:
    """A's pooled ratio minus B's on the same problems, and its bootstrap interval.

    Problem ``i`` of A and of B is the same problem; resampling draws problems, so the
    interval accounts for what the two share.
    """
    (a, b), (pa, pb) = _paired(right_a, total_a, right_b, total_b, seed)
    lo, hi = _bounds(a - b, confidence)
    return (pa - pb, lo, hi)


def paired_ratio(
    right_a: Sequence[int],
    total_a: Sequence[int],
    right_b: Sequence[int],
    total_b: Sequence[int],
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> tuple[float, float, float]:
    """A's pooled ratio over B's on the same problems (a method's fidelity as a share of
    Full KV's, say), and its bootstrap interval, resampling problems as
    :func:`paired_difference` does."""
    (a, b), (pa, pb) = _paired(right_a, total_a, right_b, total_b, seed)
    lo, hi = _bounds(a / np.where(b > 0, b, np.nan), confidence)
    return (pa / pb if pb else float("nan"), lo, hi)


def _paired(right_a, total_a, right_b, total_b, seed: int) -> tuple[tuple[np.ndarray, np.ndarray], tuple[float, float]]:
    """Both sides' pooled ratios over the same bootstrap draws of problems, and on the whole sample."""
    ra, ta, rb, tb = (np.asarray(x, dtype=float) for x in (right_a, total_a, right_b, total_b))
    if not len(ra) == len(ta) == len(rb) == len(tb):
        raise ValueError("a paired statistic needs the same problems on both sides")
    idx = np.random.default_rng(seed).integers(0, len(ra), size=(RESAMPLES, len(ra)))

    def ratio(r: np.ndarray, t: np.ndarray) -> np.ndarray:
        s = t[idx].sum(1)
        return r[idx].sum(1) / np.where(s > 0, s, 1)

    return (ratio(ra, ta), ratio(rb, tb)), (ratio_of_sums(ra, ta), ratio_of_sums(rb, tb))
