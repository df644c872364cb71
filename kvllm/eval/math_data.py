"""Real-model math evaluation: MATH-500 / AIME / AMC jsonl files, graded by math-verify.

Each line holds at least ``problem`` and ``answer`` (the MATH-500 field names; ``question``
is accepted for ``problem``). A completion is right when math-verify finds the gold
answer equivalent to the completion's final ``\\boxed{}`` answer
(:func:`kvllm.eval.grading.grade_math`).
"""

from __future__ import annotations

import json
from pathlib import Path

from kvllm.eval.problems import Problem

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def load_math(path: str | Path, tokenizer, max_new_tokens: int, limit: int | None = None) -> list[Problem]:
    """Problems of a jsonl file, prompted through the tokenizer's chat template if any."""
    path = Path(path)
    problems = []
    with path.open() as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            row = json.loads(line)
            question = row.get("problem", row.get("question"))
            if question is None or "answer" not in row:
                raise ValueError(f"{path}:{i + 1}: each line needs 'problem' (or 'question') and 'answer'")
            text = f"{question}\n{INSTRUCTION}"
            if getattr(tokenizer, "chat_template", None):
                text = tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
                )
            problems.append(
                Problem(
                    family=path.stem,
                    uid=str(row.get("unique_id", i)),
                    prompt=text,
                    answer=str(row["answer"]),
                    max_new_tokens=max_new_tokens,
                    grader="math",
                )
            )
            if limit is not None and len(problems) >= limit:
                break
    return problems
