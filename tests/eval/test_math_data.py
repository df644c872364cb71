from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvllm.eval.math_data import grade_math, load_math
from kvllm.testing import train_tokenizer


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


def test_load_math_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "math500.jsonl"
    rows = [{"problem": "What is 1+1?", "answer": "2", "unique_id": "a"}, {"question": "2*3?", "answer": "6"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    problems = load_math(path, train_tokenizer(), max_new_tokens=64)
    assert [p.family for p in problems] == ["math500", "math500"]
    assert problems[0].uid == "a" and "\\boxed{}" in problems[0].prompt
    assert problems[1].grade("\\boxed{6}") and not problems[1].grade("\\boxed{5}")


def test_load_math_rejects_rows_without_answer(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"problem": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        load_math(path, train_tokenizer(), max_new_tokens=8)
