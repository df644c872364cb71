from __future__ import annotations

import re

import pytest

from kvllm.eval.tasks import END_THINK, FAMILIES, NAMES, THINK, Difficulty, extract_answer, grade, make_task


@pytest.mark.parametrize("family", FAMILIES)
def test_deterministic_by_seed(family: str) -> None:
    assert make_task(family, 7) == make_task(family, 7)
    assert make_task(family, 7) != make_task(family, 8)
    hard = Difficulty(steps=50)
    assert make_task(family, 7, hard) != make_task(family, 7)


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_completion_is_right_and_wrong_answers_are_not(family: str) -> None:
    task = make_task(family, 3)
    assert task.prompt.endswith(THINK)
    assert grade(task, task.target)
    wrong = f"{(int(task.answer) + 1) % 100:02d}"
    assert not grade(task, task.target[:-2] + wrong)
    assert not grade(task, task.target.replace(END_THINK, ""))  # no final answer section
    assert not grade(task, "")


def test_trace_lines_are_correct_arithmetic() -> None:
    task = make_task("trace", 11, Difficulty(constants=5, steps=30))
    values = {}
    for line in task.prompt.splitlines()[1:]:
        m = re.fullmatch(r" ([a-z]+)(\d+)", line)
        if m:
            values[m[1]] = int(m[2])
    cot = task.target.split(END_THINK)[0].strip().splitlines()
    assert len(cot) == 30
    for line in cot:
        m = re.fullmatch(r"(\w+) = (\w+) ([+-]) (\w+) = ([a-z]+)(\d+) [+-] ([a-z]+)(\d+) = ([a-z]+)(\d+)", line.strip())
        assert m, line
        name, x, op, y, x2, vx, y2, vy, name2, result = m.groups()
        # Every value is written right after its name.
        assert (x2, y2, name2) == (x, y, name)
        assert int(vx) == values[x]
        assert int(vy) == values[y]
        expected = (int(vx) + int(vy)) % 100 if op == "+" else (int(vx) - int(vy)) % 100
        assert int(result) == expected
        values[name] = expected
    assert task.answer == f"{values[cot[-1].split()[0]]:02d}"


@pytest.mark.parametrize("family", FAMILIES)
def test_format_is_regular(family: str) -> None:
    """Names follow NAMES order, values have two digits, chain-of-thought lines one shape."""
    task = make_task(family, 5, Difficulty(constants=7, steps=25))
    names = [re.match(r" ([a-z]+)", line)[1] for line in task.prompt.splitlines()[1:-1]]
    names = [n for n in names if n not in ("key", "code")]
    start = NAMES.index(names[0])
    assert names == [NAMES[(start + i) % len(NAMES)] for i in range(len(names))]
    assert all(len(n) == 2 for n in re.findall(r"\d+", task.text.split("\n", 1)[1]))
    trace = [line for line in task.target.split(END_THINK)[0].splitlines() if line.strip()]
    trace = [line for line in trace if not line.strip().startswith("key")]
    assert len({len(line) for line in trace}) == 1


def test_needles() -> None:
    gen = make_task("gen-needle", 4)
    assert gen.target.lstrip().startswith("key = ")
    assert gen.target.endswith(f"key{gen.answer}")
    for depth, where in ((0.0, 1), (1.0, -1)):
        task = make_task("prompt-needle", 4, Difficulty(depth=depth))
        lines = task.prompt.splitlines()[:-1]
        assert lines[where].strip() == f"code{task.answer}"


def test_extract_answer() -> None:
    assert extract_answer(f"a\n{END_THINK}\n ce 54") == "54"
    assert extract_answer(f"a\n{END_THINK}\n ce = 54") == "54"
    assert extract_answer(f"{END_THINK} x = 1 {END_THINK} y = 2") == "2"
    assert extract_answer("ce 54") is None
    assert extract_answer(f"{END_THINK} ce") is None


def test_bad_difficulty() -> None:
    with pytest.raises(ValueError, match=r"Difficulty\.steps=0"):
        Difficulty(steps=0)
    with pytest.raises(ValueError, match=f"must be in \\[1, {len(NAMES) - 12}\\]"):
        Difficulty(steps=len(NAMES))
    with pytest.raises(ValueError, match=r"Difficulty\.depth"):
        Difficulty(depth=1.5)
    with pytest.raises(ValueError, match="family='nope'"):
        make_task("nope", 1)
