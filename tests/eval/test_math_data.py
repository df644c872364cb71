from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvllm.eval.math_data import load_math
from kvllm.testing import train_tokenizer


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
