"""kvllm tune's prompts: a user's jsonl or a shipped family, and too few refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from kvllm.assets import model_path
from kvllm.tune.prompts import MIN_PROMPTS, family_prompts, load_prompts


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_plain_and_chat_prompts_with_optional_answers(tmp_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(model_path("kara-reasoner-6l"))
    rows = [{"prompt": f"p{i}"} for i in range(8)]
    rows += [{"messages": [{"role": "user", "content": f"q{i}"}], "answer": 3} for i in range(8)]
    prompts = load_prompts(write(tmp_path / "p.jsonl", rows), tok)
    assert [p.text for p in prompts[:2]] == ["p0", "p1"] and prompts[0].answer is None
    assert prompts[8].text == tok.apply_chat_template(rows[8]["messages"], tokenize=False, add_generation_prompt=True)
    assert prompts[8].answer == "3"


def test_too_few_prompts_are_refused(tmp_path: Path) -> None:
    path = write(tmp_path / "p.jsonl", [{"prompt": "p"}] * (MIN_PROMPTS - 1))
    with pytest.raises(ValueError, match=f"has {MIN_PROMPTS - 1} prompts: at least {MIN_PROMPTS} are needed"):
        load_prompts(path, None)
    with pytest.raises(ValueError, match="at least 16"):
        family_prompts("reason", 4, "shift")


def test_bad_lines_name_their_place(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"p.jsonl:2: each line needs exactly one of"):
        load_prompts(write(tmp_path / "p.jsonl", [{"prompt": "a"}, {"text": "b"}]), None)
    (tmp_path / "q.jsonl").write_text('{"prompt": "a"}\nnot json\n')
    with pytest.raises(ValueError, match=r"q.jsonl:2: not a JSON object"):
        load_prompts(tmp_path / "q.jsonl", None)


def test_family_prompts_are_development_seeds() -> None:
    prompts = family_prompts("reason", 16, "shift")
    assert [int(p.uid) for p in prompts] == list(range(100_000, 100_016))
    assert all(p.task is not None and p.answer for p in prompts)
