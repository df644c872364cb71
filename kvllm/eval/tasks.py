"""Generated reasoning tasks whose chains of thought re-read what was written long before.

Every task is ``prompt -> "<think>\\n" + chain of thought + "</think>\\n" + answer`` and
is a pure function of its family, its seed and its difficulty knobs, so train and test
sets are disjoint by seed (:data:`TEST_SEEDS` vs :data:`TRAIN_SEEDS`). Families:

``trace``
    The prompt is a program of constants (``bo41``) and assignments (``ce = bo + ku``;
    values 00-99, ``+`` and ``-`` mod 100, each statement reading two earlier variables,
    possibly the same one, chosen uniformly among all earlier ones, so reads reach back
    hundreds of tokens). The chain of thought evaluates it line by line,
    ``ce = bo + ku = bo41 + ku13 = ce54``; the answer is the last variable's value.
``gen-needle``
    The first line of the chain of thought derives a fact, ``key = 37 + 48 = key85``;
    then comes a long trace that never reads it; the answer recalls ``key``.
``prompt-needle``
    A line ``code85`` sits in the prompt at a chosen depth among the program's
    lines; after the long trace, the answer recalls ``code`` from the prompt.

The format is regular on purpose, so that a model of a few million parameters trained
for minutes on a CPU can learn it (``docs/training-attempts.md``): variables are named
in the order of :data:`NAMES` from a random start (the next statement's name follows
from the previous one), every value has two digits, and every chain-of-thought line
has the same number of tokens. Every value is written right after its variable's name,
with no space (``bo41``), wherever it is written, so that reading a value back is one lookup: find
the name, copy what follows (an induction head), not "find the line that defines it and
skip to its end". What is left to learn is what compression can break: copying each
statement from the prompt and each operand's value from where it was written, hundreds
of tokens back.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

FAMILIES: tuple[str, ...] = ("trace", "gen-needle", "prompt-needle")
TEST_SEEDS = range(0, 1_000_000)
TRAIN_SEEDS = range(1_000_000, 2**31)
THINK, END_THINK = "<think>", "</think>"
# Consonant-vowel names: few enough that the tokenizer makes each one a single token.
NAMES = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]


@dataclass(frozen=True)
class Difficulty:
    """Knobs of a task's length and recall distance.

    Attributes
    ----------
    constants
        Variables given a value in the prompt.
    steps
        Assignments the chain of thought evaluates (18 tokens each with the shipped tokenizer).
    depth
        ``prompt-needle``: where the needle sits among the prompt's lines, in [0, 1].
    """

    constants: int = 12
    steps: int = 40
    depth: float = 0.5

    def __post_init__(self) -> None:
        if self.constants < 2:
            raise ValueError(f"Difficulty.constants={self.constants} is invalid: must be >= 2")
        if not 1 <= self.steps <= len(NAMES) - self.constants:
            raise ValueError(f"Difficulty.steps={self.steps} is invalid: must be in [1, {len(NAMES) - self.constants}]")
        if not 0.0 <= self.depth <= 1.0:
            raise ValueError(f"Difficulty.depth={self.depth} is invalid: must be in [0, 1]")


@dataclass(frozen=True)
class Task:
    family: str
    seed: int
    prompt: str
    target: str
    answer: str

    @property
    def text(self) -> str:
        """Prompt and target: a training example."""
        return self.prompt + self.target


def _program(rng: random.Random, d: Difficulty) -> tuple[list[str], list[str], str, dict[str, int]]:
    """Prompt lines, chain-of-thought lines, the last variable and all values."""
    start = rng.randrange(len(NAMES))
    names = [NAMES[(start + i) % len(NAMES)] for i in range(d.constants + d.steps)]
    values: dict[str, int] = {}
    prompt, cot = [], []
    for name in names[: d.constants]:
        values[name] = rng.randrange(100)
        prompt.append(f"{name}{values[name]:02d}")
    for name in names[d.constants :]:
        defined = list(values)
        op = rng.choice("+-")
        x, y = rng.choice(defined), rng.choice(defined)
        vx, vy = values[x], values[y]
        values[name] = (vx + vy) % 100 if op == "+" else (vx - vy) % 100
        prompt.append(f"{name} = {x} {op} {y}")
        cot.append(f"{name} = {x} {op} {y} = {x}{vx:02d} {op} {y}{vy:02d} = {name}{values[name]:02d}")
    return prompt, cot, names[-1], values


def make_task(family: str, seed: int, difficulty: Difficulty | None = None) -> Task:
    """The task of ``family`` for ``seed`` (deterministic)."""
    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is invalid: must be one of {', '.join(FAMILIES)}")
    d = difficulty or Difficulty()
    rng = random.Random(f"{family}:{seed}:{d}")
    prompt, cot, last, values = _program(rng, d)
    ask, answer = last, values[last]
    if family == "gen-needle":
        a, b = rng.randrange(100), rng.randrange(100)
        ask, answer = "key", (a + b) % 100
        prompt.insert(0, f"key = {a:02d} + {b:02d}")
        cot.insert(0, f"key = {a:02d} + {b:02d} = key{answer:02d}")
    elif family == "prompt-needle":
        ask, answer = "code", rng.randrange(100)
        prompt.insert(round(d.depth * len(prompt)), f"code{answer:02d}")
    # Every line starts with a space, so a name is the same token wherever it appears.
    lines = [f"{family}: evaluate and report {ask}.", *prompt, THINK, *cot, END_THINK, f"{ask}{answer:02d}"]
    text = "\n ".join(lines)
    split = text.index(THINK) + len(THINK)
    return Task(family=family, seed=seed, prompt=text[:split], target=text[split:], answer=f"{answer:02d}")


_ANSWER = re.compile(r"\d+")


def extract_answer(completion: str) -> str | None:
    """The first number after the last ``</think>``, if any."""
    _, sep, tail = completion.rpartition(END_THINK)
    if not sep:
        return None
    match = _ANSWER.search(tail)
    return match.group(0) if match else None


def grade(task: Task, completion: str) -> bool:
    """Exact match of the final answer."""
    return extract_answer(completion) == task.answer
