from __future__ import annotations

import re

import pytest

from kvllm.eval import lookup
from kvllm.eval.tasks import (
    END_THINK,
    FAMILIES,
    HEDGES,
    NAMES,
    REASON,
    REASON_DIFFICULTY,
    THINK,
    Difficulty,
    ReasonStyle,
    answer_span,
    extract_answer,
    grade,
    make_task,
)


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
def test_a_shift_task_is_its_add_twins_program_with_the_other_operator(family: str) -> None:
    """The op is not in the difficulty's repr, which seeds the draws: the same seed gives the
    same program, and every ``add`` task is what it was before the knob existed."""
    add = make_task(family, 9, Difficulty(constants=6, steps=20))
    shift = make_task(family, 9, Difficulty(constants=6, steps=20, op="shift"))
    assert repr(Difficulty(op="shift")) == repr(Difficulty())
    assert " : " not in add.prompt and re.sub(r" [+-] ", " : ", add.prompt) == shift.prompt
    assert add.target != shift.target


def test_shift_lines_step_the_copied_digits() -> None:
    task = make_task("trace", 11, Difficulty(constants=5, steps=30, op="shift"))
    values = {m[1]: m[2] for line in task.prompt.splitlines() if (m := re.fullmatch(r" ([a-z]+)(\d{2})", line))}
    cot = task.target.split(END_THINK)[0].strip().splitlines()
    assert len(cot) == 30
    for line in cot:
        m = re.fullmatch(r"(\w+) = (\w+) : (\w+) = \2(\d{2}) : \3(\d{2}) = \1(\d{2})", line.strip())
        assert m, line
        name, x, y, vx, vy, result = m.groups()
        assert (vx, vy) == (values[x], values[y])
        # One more than x's tens digit, one more than y's units digit, each mod 10.
        assert result == f"{(int(vx[0]) + 1) % 10}{(int(vy[1]) + 1) % 10}"
        values[name] = result
    assert task.answer == values[cot[-1].split()[0]]


@pytest.mark.parametrize("family", FAMILIES)
def test_format_is_regular(family: str) -> None:
    """Names follow NAMES order, values have two digits, chain-of-thought lines one shape."""
    task = make_task(family, 5, Difficulty(constants=7, steps=25))
    names = [re.match(r" ([a-z]+)", line)[1] for line in task.prompt.splitlines()[1:-1]]
    names = [n for n in names if n not in ("key", "code")]
    start = NAMES.index(names[0])
    assert names == [NAMES[(start + i) % len(NAMES)] for i in range(len(names))]
    assert all(len(n) == 2 for n in re.findall(r"\d+", task.text.split("\n", 1)[1]))
    if family == "reason":  # its lines are of several kinds: test_reason_lines
        return
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
    text = f"a\n{END_THINK}\n ce 54"
    assert answer_span(text) == (len(text) - 2, len(text))
    assert extract_answer(text) == "54"
    assert extract_answer(f"a\n{END_THINK}\n ce = 54") == "54"
    assert extract_answer(f"{END_THINK} x = 1 {END_THINK} y = 2") == "2"
    assert extract_answer("ce 54") is None is answer_span("ce 54")
    assert extract_answer(f"{END_THINK} ce") is None is answer_span(f"{END_THINK} ce")


def test_bad_difficulty() -> None:
    with pytest.raises(ValueError, match=r"Difficulty\.steps=0"):
        Difficulty(steps=0)
    with pytest.raises(ValueError, match=f"must be in \\[1, {len(NAMES) - 12}\\]"):
        Difficulty(steps=len(NAMES))
    with pytest.raises(ValueError, match=r"Difficulty\.depth"):
        Difficulty(depth=1.5)
    with pytest.raises(ValueError, match=r"Difficulty\.op='mul' is invalid: must be one of add, shift"):
        Difficulty(op="mul")
    with pytest.raises(ValueError, match="family='nope'"):
        make_task("nope", 1)


STATEMENT = re.compile(r"(\w+) = (\w+) ([+-]) (\w+) = ([a-z]+)(\d+) [+-] ([a-z]+)(\d+) = ([a-z]+)(\d+)")


def _reason_lines(task) -> tuple[dict[str, int], list[tuple[str, re.Match | None, str]]]:
    """The prompt's constants, and each chain-of-thought line as (kind, statement match, text)."""
    constants = {m[1]: int(m[2]) for line in task.prompt.splitlines() if (m := re.fullmatch(r" ([a-z]+)(\d+)", line))}
    out = []
    for line in task.target.split(END_THINK)[0].strip().splitlines():
        line = line.strip()
        if line.startswith("check "):
            out.append(("check", STATEMENT.fullmatch(line.removeprefix("check ")), line))
        elif (m := STATEMENT.fullmatch(line)) is not None:
            out.append(("step", m, line))
        else:
            out.append(("restate" if re.fullmatch(r"so [a-z]+ is \d{2}\.", line) else "hedge", None, line))
    return constants, out


def test_reason_lines() -> None:
    """Steps follow the prompt's program with the latest values; restatements repeat the
    step's result; checks re-derive an earlier step exactly; hedges come from HEDGES; the
    answer is the first step's result, and the grader finds every read right."""
    task = make_task("reason", 11)
    values, lines = _reason_lines(task)
    program = [line.strip() for line in task.prompt.splitlines() if " = " in line]
    steps, seen = [], {}
    for i, (kind, m, text) in enumerate(lines):
        if kind == "step":
            name, x, op, y, x2, vx, y2, vy, name2, result = m.groups()
            assert f"{name} = {x} {op} {y}" == program[len(steps)]
            assert (x2, y2, name2) == (x, y, name) and (int(vx), int(vy)) == (values[x], values[y])
            values[name] = (values[x] + values[y]) % 100 if op == "+" else (values[x] - values[y]) % 100
            assert int(result) == values[name]
            steps.append(name)
            seen[name] = text
        elif kind == "check":
            assert m is not None and seen[m[1]] == text.removeprefix("check "), text
        elif kind == "restate":
            assert lines[i - 1][0] == "step" and text == f"so {steps[-1]} is {values[steps[-1]]:02d}."
        else:
            assert text in HEDGES
    assert len(steps) == REASON_DIFFICULTY.steps and task.answer == f"{values[steps[0]]:02d}"
    assert task.prompt.splitlines()[0] == f"reason: evaluate and report {steps[0]}."
    got = lookup.reads(task.prompt, task.target)
    assert got and all(r.right for r in got) and lookup.malformed_lines(task.target) == 0
    assert lookup.answer_recall(task.prompt, task.target)


def _operands(style: ReasonStyle, seed: int = 5) -> tuple[list[str], list[list[str]], list[str]]:
    """The constants, each step's two operands, and the step names, of one task."""
    task = make_task("reason", seed, Difficulty(constants=8, steps=60), style)
    constants, lines = _reason_lines(task)
    steps = [m for kind, m, _ in lines if kind == "step"]
    return list(constants), [[m[2], m[4]] for m in steps], [m[1] for m in steps]


def test_reason_operands_come_from_their_pools() -> None:
    constants, operands, names = _operands(ReasonStyle(recent=1.0, anchor=0.0, prompt=0.0))
    for i, pair in enumerate(operands[1:], start=1):  # step 0 has no earlier result yet
        assert set(pair) <= set(names[max(0, i - REASON.recent_steps) : i]), (i, pair)
    style = ReasonStyle(recent=0.0, anchor=1.0, prompt=0.0, anchor_every=5, live_anchors=2)
    constants, operands, names = _operands(style)
    fixed = {x for pair in operands[:5] for x in pair}  # no milestone before step 5
    assert fixed <= set(constants) and len(fixed) <= style.prompt_anchors
    for i, pair in enumerate(operands):
        live = names[4:i:5][-2:]  # the last two milestones written before step i
        assert set(pair) <= fixed | set(live), (i, pair)
    assert {x for pair in operands for x in pair} - fixed  # milestones are read too
    constants, operands, _ = _operands(ReasonStyle(recent=0.0, anchor=0.0, prompt=1.0))
    assert {x for pair in operands for x in pair} <= set(constants)


def test_reason_locality_moves_reuse_distances() -> None:
    """recent=1 reads nearer than far=1 (everything earlier), by a wide margin."""
    near = _distances(ReasonStyle(recent=1.0, anchor=0.0, prompt=0.0, check_every=1000))
    far = _distances(ReasonStyle(recent=0.0, anchor=0.0, prompt=0.0, check_every=1000))
    assert sum(far) / len(far) > 4 * sum(near) / len(near)


def _distances(style: ReasonStyle) -> list[int]:
    """Character distances from each generated read back to the write it reads."""
    task = make_task("reason", 2, Difficulty(constants=8, steps=60), style)
    text = task.target
    writes: dict[str, int] = {}
    out = []
    offset = 0
    for line in text.split(END_THINK)[0].split("\n"):
        if m := STATEMENT.search(line):
            for name, digits in ((5, 6), (7, 8)):
                if m[name] in writes:
                    out.append(offset + m.start(digits) - writes[m[name]])
            writes[m[1]] = offset + m.start(10)
        offset += len(line) + 1
    return out


def test_reason_redundancy_knobs() -> None:
    d = Difficulty(constants=8, steps=60)

    def kinds(style: ReasonStyle) -> list[str]:
        return [kind for kind, _, _ in _reason_lines(make_task("reason", 9, d, style))[1]]

    none = kinds(ReasonStyle(restate=0.0, hedge=0.0, check_every=1000))
    assert none == ["step"] * 60
    every = kinds(ReasonStyle(restate=1.0, hedge=1.0, check_every=5, check_lines=2))
    assert every.count("restate") == every.count("hedge") == 60
    assert every.count("check") == 2 * (60 // 5)


def test_bad_reason_style() -> None:
    with pytest.raises(ValueError, match=r"ReasonStyle\.hedge=1\.5 is invalid: must be in \[0, 1\]"):
        ReasonStyle(hedge=1.5)
    with pytest.raises(ValueError, match=r"recent \+ anchor \+ prompt = 1\.2"):
        ReasonStyle(recent=0.6, anchor=0.4, prompt=0.2)
    with pytest.raises(ValueError, match=r"ReasonStyle\.check_every=0"):
        ReasonStyle(check_every=0)
