"""Intervals on known inputs."""

from __future__ import annotations

import pytest

from kvllm.eval.stats import bootstrap_ratio, paired_difference, paired_ratio, ratio_of_sums, wilson


def test_wilson_matches_the_closed_form() -> None:
    # Wilson 95% for 8/10: (0.4902, 0.9433) (Brown, Cai & DasGupta 2001, table values).
    lo, hi = wilson(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-3) and hi == pytest.approx(0.9433, abs=1e-3)
    lo, hi = wilson(0, 20)
    assert lo == 0.0 and hi == pytest.approx(0.1611, abs=1e-3)
    assert wilson(0, 0) == (0.0, 1.0)


def test_bootstrap_pools_reads_and_resamples_problems() -> None:
    assert ratio_of_sums([9, 1], [10, 10]) == 0.5
    lo, hi = bootstrap_ratio([5, 5, 5, 5], [10, 10, 10, 10])
    assert lo == hi == 0.5  # every problem alike: nothing to vary
    lo, hi = bootstrap_ratio([10, 0] * 20, [10, 10] * 20)
    assert lo < 0.5 < hi and hi - lo < 0.4


def test_paired_difference_of_identical_and_shifted_methods() -> None:
    right, total = [3, 7, 5, 9], [10, 10, 10, 10]
    assert paired_difference(right, total, right, total) == (0.0, 0.0, 0.0)
    diff, lo, hi = paired_difference([r + 1 for r in right], total, right, total)
    assert diff == pytest.approx(0.1) and lo == pytest.approx(0.1) and hi == pytest.approx(0.1)
    with pytest.raises(ValueError, match="same problems"):
        paired_difference([1], [2], [1, 1], [2, 2])


def test_paired_ratio_of_a_method_over_full_kv() -> None:
    full, total = [10, 10, 10, 10], [10, 10, 10, 10]
    assert paired_ratio(full, total, full, total) == (1.0, 1.0, 1.0)
    # Half of Full KV's reads on every problem: the ratio is 0.5 whatever the draw.
    assert paired_ratio([4, 4, 2, 2], total, [8, 8, 4, 4], total) == (0.5, 0.5, 0.5)
    # A method that keeps one problem whole and loses the other: the interval spans both.
    ratio, lo, hi = paired_ratio([10, 0] * 10, [10, 10] * 10, [10, 10] * 10, [10, 10] * 10)
    assert ratio == 0.5 and lo < 0.5 < hi
    with pytest.raises(ValueError, match="same problems"):
        paired_ratio([1], [2], [1, 1], [2, 2])
