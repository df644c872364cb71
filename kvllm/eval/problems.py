"""What the accuracy runner evaluates: prompts with a gold answer and a grader."""

from __future__ import annotations

from dataclasses import dataclass

from kvllm.eval import tasks


@dataclass(frozen=True)
class Problem:
    """One prompt to complete and grade.

    ``grader`` names how a completion is checked: ``"task"`` (exact match of the
    generated tasks' final answer) or ``"math"`` (math-verify on the boxed answer).
    ``reference`` is the task's own completion (its true chain of thought and answer),
    which reference-forced cells force through each cache; math problems have none.
    """

    family: str
    uid: str
    prompt: str
    answer: str
    max_new_tokens: int
    grader: str = "task"
    reference: str = ""

    def grade(self, completion: str) -> bool:
        if self.grader == "task":
            return tasks.extract_answer(completion) == self.answer
        if self.grader == "math":
            from kvllm.eval.grading import grade_math  # math-verify loads slowly: only when used

            return grade_math(self.answer, completion)
        raise ValueError(f"grader={self.grader!r} is invalid: must be 'task' or 'math'")


def task_problems(
    family: str, n: int, difficulty: tasks.Difficulty, tokenizer, first_seed: int = 0, slack: float = 1.25
) -> list[Problem]:
    """``n`` held-out generated tasks (seeds from ``first_seed`` in the test range).

    Each gets room for ``slack`` times its reference completion's length.
    """
    problems = []
    for seed in range(first_seed, first_seed + n):
        if seed not in tasks.TEST_SEEDS:
            raise ValueError(f"seed {seed} is outside the held-out range {tasks.TEST_SEEDS}")
        task = tasks.make_task(family, seed, difficulty)
        budget = round(len(tokenizer(task.target)["input_ids"]) * slack) + 8
        problems.append(Problem(family, str(seed), task.prompt, task.answer, budget, reference=task.target))
    return problems
