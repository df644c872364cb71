"""The statement grade on crafted chains: right, run past the program, stopped early,
out of order, and the answer line."""

from __future__ import annotations

import dataclasses

import pytest

from kvllm.eval.statements import grade, program
from kvllm.eval.tasks import END_THINK, REASON_DIFFICULTY, Difficulty, make_task


@pytest.fixture(params=["reason", "trace"])
def task(request: pytest.FixtureRequest):
    difficulty = dataclasses.replace(REASON_DIFFICULTY, op="shift") if request.param == "reason" else Difficulty()
    return make_task(request.param, 3, difficulty)


def _chain(task) -> tuple[list[str], str]:
    """The task's own chain lines and what follows its </think>."""
    chain, _, after = task.target.partition(END_THINK)
    return chain.split("\n"), END_THINK + after


def test_the_tasks_own_completion_is_right_throughout(task) -> None:
    prog = program(task.prompt)
    assert len(prog) == (84 if task.family == "reason" else 40)
    g = grade(prog, task.target)
    assert (g.right, g.extra, g.stopped) == (len(prog), 0, True)
    assert g.share == 1.0
    assert g.answered
    assert prog.answer == task.target.strip().split("\n")[-1].strip()


def test_a_chain_that_runs_past_the_program_is_charged_for_every_extra_line(task) -> None:
    prog = program(task.prompt)
    lines, end = _chain(task)
    invented = [" zz = ba + be = ba10 + be20 = zz30", lines[1]]  # an invented name, then a repeat
    g = grade(prog, "\n".join(lines + invented) + end)
    assert (g.right, g.extra, g.stopped) == (len(prog), 2, False)
    assert g.share == len(prog) / (len(prog) + 2)
    # Hitting the cap without </think>: not stopped, and nothing after it is an answer.
    capped = grade(prog, "\n".join(lines + invented))
    assert not capped.stopped and not capped.answered


def test_a_chain_that_stops_early_misses_the_rest(task) -> None:
    prog = program(task.prompt)
    lines, end = _chain(task)
    statement_rows = [i for i, line in enumerate(lines) if line.strip().startswith(prog.names[len(prog) - 5] + " =")]
    cut = lines[: statement_rows[0]]  # stops before the fifth-last statement
    g = grade(prog, "\n".join(cut) + end)
    assert (g.right, g.extra, g.stopped) == (len(prog) - 5, 0, False)


def test_out_of_order_and_wrong_values_count_as_wrong(task) -> None:
    prog = program(task.prompt)
    lines, end = _chain(task)
    rows = {line.strip().split(" =")[0]: i for i, line in enumerate(lines) if " = " in line and "check" not in line}
    a, b = rows[prog.names[2]], rows[prog.names[3]]
    swapped = list(lines)
    swapped[a], swapped[b] = lines[b], lines[a]
    g = grade(prog, "\n".join(swapped) + end)
    # Statement 3 first: statement 2 is missing; then statement 2 is an extra.
    assert (g.right, g.extra, g.stopped) == (len(prog) - 1, 1, True)
    wrong = list(lines)
    wrong[a] = wrong[a][:-2] + ("00" if not wrong[a].endswith("00") else "11")  # a wrong result
    g = grade(prog, "\n".join(wrong) + end)
    assert (g.right, g.extra) == (len(prog) - 1, 0)


def test_the_answer_is_the_first_line_after_the_first_end_of_thought() -> None:
    task = make_task("reason", 3, dataclasses.replace(REASON_DIFFICULTY, op="shift"))
    prog = program(task.prompt)
    chain, _, _ = task.target.partition(END_THINK)
    name, value = prog.answer[:2], prog.answer[2:]
    assert grade(prog, chain + END_THINK + f"\n {prog.answer}").answered
    other = "00" if value != "00" else "11"
    assert not grade(prog, chain + END_THINK + f"\n {name}{other}").answered
    # A chain that runs on and writes the right line only after a second </think> did not answer it.
    assert not grade(prog, chain + END_THINK + f"\n {name}{other}\n more\n {END_THINK}\n {prog.answer}").answered
