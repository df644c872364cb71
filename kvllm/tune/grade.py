"""How ``kvllm tune`` grades a completion: against a gold answer, a shipped family's own
grade, or, with no gold, agreement with Full KV's completion of the same prompt."""

from __future__ import annotations

import re
from typing import Any

from kvllm.tune.prompts import TunePrompt

GRADERS = ("auto", "math", "exact", "agreement")
_END_THINK = re.compile(r"</think>")


def final_answer(text: str) -> str | None:
    """A completion's answer: its last ``\\boxed{...}`` (braces balanced), else the last
    non-empty line after ``</think>`` when it has one; ``None`` when neither exists."""
    start = text.rfind("\\boxed{")
    if start >= 0:
        depth, i = 0, start + len("\\boxed")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i + 1 : j].strip()
        return None
    ends = list(_END_THINK.finditer(text))
    if ends:
        lines = [line.strip() for line in text[ends[-1].end() :].splitlines() if line.strip()]
        return lines[-1] if lines else None
    return None


def first_divergence(a: list[int], b: list[int]) -> int:
    """The first index at which two token sequences differ (the shorter's length if one is
    a prefix of the other, and their length if equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def resolve_grader(grader: str, prompts: list[TunePrompt]) -> str:
    """``auto``: a family's own grade, math-verify with gold answers, agreement without."""
    if grader not in GRADERS:
        raise ValueError(f"--grader {grader!r} is invalid: must be one of {', '.join(GRADERS)}")
    if prompts[0].task is not None:
        return "family"
    has_gold = [p.answer is not None for p in prompts]
    if grader in ("math", "exact") and not all(has_gold):
        raise ValueError(f'--grader {grader} needs a gold "answer" on every prompt; {has_gold.count(False)} lack one')
    if grader == "auto":
        return "math" if all(has_gold) else "agreement"
    return grader


def score(grader: str, prompt: TunePrompt, text: str, full_text: str | None) -> float:
    """The completion's grade in [0, 1]: right or wrong, or a family's share of statements right."""
    if grader == "family":
        from kvllm.eval.statements import grade, program
        from kvllm.eval.tasks import grade as answer_grade

        if prompt.task.family == "reason":
            return grade(program(prompt.text), text).share
        return float(answer_grade(prompt.task, text))
    if grader == "math":
        from kvllm.eval.grading import grade_math

        return float(grade_math(prompt.answer, text))
    if grader == "exact":
        return float(final_answer(text) == prompt.answer.strip())
    # agreement: Full KV's own answer, where it wrote one; else its whole completion.
    if full_text is None:  # Full KV's run itself
        return 1.0
    ours, theirs = final_answer(text), final_answer(full_text)
    return float(ours == theirs) if theirs is not None else float(text == full_text)


def stopped(grader: str, prompt: TunePrompt, text: str, finish_reason: str) -> bool:
    """Whether the chain ended by itself: for a ``reason`` task, at its program's end."""
    if grader == "family" and prompt.task.family == "reason":
        from kvllm.eval.statements import grade, program

        return grade(program(prompt.text), text).stopped
    return finish_reason == "stop"


def outcome(grader: str, prompt: TunePrompt, out: Any, full: dict[str, Any] | None) -> dict[str, Any]:
    """One prompt's record: its grade, whether it stopped, its length, the KV it held at
    the end, and where it left Full KV's completion (``full``: Full KV's record)."""
    completion = out.outputs[0]
    ids = list(completion.token_ids)
    stats = (out.kv_transfer_params or {}).get("kvllm") or {}
    generated = len(ids)
    held = stats.get("physical_length", 0) - len(out.prompt_token_ids) if stats.get("method") else generated
    text = completion.text
    return {
        "uid": prompt.uid,
        "score": score(grader, prompt, text, None if full is None else full["text"]),
        "stopped": stopped(grader, prompt, text, completion.finish_reason or ""),
        "tokens": generated,
        "held": max(0, min(generated, held)),
        "divergence": None if full is None else first_divergence(ids, full["ids"]),
        "text": text,
        "ids": ids,
    }
