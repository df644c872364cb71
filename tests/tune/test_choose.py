"""The choice rule of kvllm tune on crafted runs."""

from __future__ import annotations

import pytest

from kvllm.tune.choose import Tolerances, choose, paired_ratio, passes, summarize


def records(scores: list[float], stopped: list[bool], tokens: list[int], held: list[int]) -> list[dict]:
    return [
        {"uid": str(i), "score": s, "stopped": st, "tokens": t, "held": h, "divergence": None}
        for i, (s, st, t, h) in enumerate(zip(scores, stopped, tokens, held, strict=True))
    ]


FULL = records([1.0] * 16, [True] * 16, [100] * 16, [100] * 16)


def candidate(key: str, scores: list[float], stop: int, tokens: int, held: int) -> dict:
    run = records(scores, [i < stop for i in range(16)], [tokens] * 16, [held] * 16)
    return {"key": key, "summary": summarize(run, FULL)}


def test_the_least_memory_that_keeps_every_tolerance_is_chosen() -> None:
    tol = Tolerances()
    runs = [
        candidate("r0.5", [1.0] * 16, 16, 100, 50),
        candidate("r0.3", [1.0] * 16, 16, 102, 30),
        candidate("r0.2", [1.0] * 15 + [0.0], 16, 100, 20),  # one answer lost: its bound falls below 0.98
        candidate("r0.1", [1.0] * 16, 16, 130, 10),  # chains 30% longer
    ]
    assert [passes(r["summary"], tol) for r in runs] == [True, True, False, False]
    chosen, best = choose(runs, tol)
    assert chosen["key"] == "r0.3" and best is None
    # Looser tolerances let the one-answer loss through, and it holds less.
    loose = Tolerances(accuracy=0.8)
    assert choose(runs, loose)[0]["key"] == "r0.2"


def test_no_setting_passing_says_which_came_closest() -> None:
    runs = [
        candidate("a", [1.0] * 12 + [0.0] * 4, 16, 100, 30),
        candidate("b", [1.0] * 14 + [0.0] * 2, 10, 100, 40),  # better answers, stops less often
    ]
    chosen, best = choose(runs, Tolerances())
    assert chosen is None and best["key"] == "b"
    assert choose([], Tolerances()) == (None, None)


def test_paired_ratio_interval_and_the_all_zero_case() -> None:
    value, lo, hi = paired_ratio([1, 1, 0, 1] * 4, [1, 1, 1, 1] * 4)
    assert value == 0.75 and lo < 0.75 < hi
    assert paired_ratio([0] * 16, [0] * 16) == (1.0, 1.0, 1.0)


def test_summaries_need_the_same_prompts() -> None:
    with pytest.raises(ValueError, match="same order"):
        summarize(records([1.0], [True], [1], [1]), FULL)


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"accuracy": 0}, "--min-accuracy 0"), ({"length": 1.0}, "--max-length")]
)
def test_bad_tolerances_name_their_flag(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Tolerances(**kwargs)
