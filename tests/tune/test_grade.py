"""kvllm tune's graders on crafted completions."""

from __future__ import annotations

import pytest

from kvllm.tune.grade import final_answer, first_divergence, resolve_grader, score
from kvllm.tune.prompts import TunePrompt


def test_final_answer_is_the_last_box_or_the_line_after_thinking() -> None:
    assert final_answer("so \\boxed{2} then \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert final_answer("<think>steps</think>\n\nThe answer is 7.\n") == "The answer is 7."
    assert final_answer("still thinking about it") is None
    assert final_answer("\\boxed{unclosed") is None


def test_agreement_with_full_kv() -> None:
    prompt = TunePrompt("0", "q")
    full = "<think>a long chain</think>\n42"
    assert score("agreement", prompt, "<think>a shorter chain</think>\n42", full) == 1.0
    assert score("agreement", prompt, "<think>a chain</think>\n41", full) == 0.0
    assert score("agreement", prompt, "it never finished", full) == 0.0
    # Full KV wrote no answer either: the whole completion must match.
    assert score("agreement", prompt, "same words", "same words") == 1.0
    assert score("agreement", prompt, "other words", "same words") == 0.0
    assert first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_gold_graders() -> None:
    prompt = TunePrompt("0", "q", answer="1/2")
    assert score("math", prompt, "so \\boxed{0.5}", None) == 1.0
    assert score("math", prompt, "so \\boxed{0.4}", None) == 0.0
    assert score("exact", TunePrompt("0", "q", answer="42"), "<think>x</think>\n42", None) == 1.0


def test_the_grader_follows_what_the_prompts_give() -> None:
    gold = [TunePrompt(str(i), "q", answer="1") for i in range(16)]
    free = [TunePrompt(str(i), "q") for i in range(16)]
    assert resolve_grader("auto", gold) == "math" and resolve_grader("auto", free) == "agreement"
    assert resolve_grader("agreement", gold) == "agreement"
    with pytest.raises(ValueError, match='--grader exact needs a gold "answer" on every prompt; 16 lack one'):
        resolve_grader("exact", free)
    with pytest.raises(ValueError, match="--grader 'nope'"):
        resolve_grader("nope", free)
