from __future__ import annotations

import pytest

from kvllm.eval.grading import grade_math


@pytest.mark.parametrize(
    ("gold", "completion", "right"),
    [
        ("\\frac{1}{2}", "So the answer is \\boxed{\\frac{1}{2}}.", True),
        ("\\frac{1}{2}", "Therefore \\boxed{0.5}", True),  # equivalent form
        ("\\frac{1}{2}", "We get \\boxed{\\frac{2}{4}}", True),  # unreduced
        ("3", "hence \\boxed{3}", True),
        ("3", "hence \\boxed{4}", False),
        ("3", "the value is 3 but I am not sure", False),  # no boxed answer
        (
            "7",
            "First guess \\boxed{5}. After checking every case again, the earlier guess was wrong, so \\boxed{7}",
            True,
        ),  # the last boxed answer counts
        ("2\\sqrt{2}", "\\boxed{\\sqrt{8}}", True),
        ("(1,2)", "\\boxed{(2,1)}", False),
    ],
)
def test_grade_math(gold: str, completion: str, right: bool) -> None:
    assert grade_math(gold, completion) is right
