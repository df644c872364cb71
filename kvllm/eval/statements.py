"""The statement grade: a free-running chain graded on the program it was asked to run.

Lookup fidelity grades the reads a chain makes, so a chain that leaves the program and
invents statements is graded on reads of its own invention, and each method on a
different set of reads. This grade takes the program's statements from the prompt (the
trace-format families write one ``name = x op y`` line per statement, in order) and asks,
of every method, the same question about the same statements:

- **statements right**: the program's statements that the chain writes right, in order,
  over the program's statements plus the chain's extra ones. A statement is right when
  the chain's line for it is the line the task's generator writes (its operands' values
  and its result included: ``ce = bo + ku = bo41 + ku13 = ce54``). Lines are aligned by
  name: a statement line for the next expected statement grades it; one for a later
  statement grades that one and counts those skipped as missing (wrong); any other
  statement line (a repeat, an invented statement, one past the program's end) is an
  extra, which counts against the share. ``check`` lines, restatements and hedges are
  not statements. Only what comes before the first ``</think>`` is the chain.
- **stopped right**: the chain writes ``</think>`` and its last statement line is the
  program's last statement: it neither stopped early nor ran past the end.
- **answer right**: the first line after the first ``</think>`` is exactly the asked name
  followed by its value (``du31``), as the task's own answer line is. The older grade
  (:func:`kvllm.eval.tasks.grade`: the first number after the *last* ``</think>``) reads
  a number wherever a chain that ran on happens to write one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvllm.eval.tasks import CHECK, END_THINK, apply, statement_line

_CONSTANT = re.compile(r"^\s*([a-z]{2})(\d\d)\s*$")
_STATEMENT = re.compile(r"^\s*([a-z]{2}) = ([a-z]{2}) (\S) ([a-z]{2})\s*$")
# A chain's statement line: ``name = ...``; whatever follows is compared whole.
_LINE = re.compile(r"^\s*([a-z]{2}) = ")
_ASK = re.compile(r"evaluate and report ([a-z]+)\.")


@dataclass(frozen=True)
class Program:
    """A prompt's program: the lines a right chain writes, and the answer line."""

    names: tuple[str, ...]
    lines: tuple[str, ...]  # the generator's chain line for each statement, stripped
    answer: str | None  # the answer line (``du31``), when the prompt asks for a variable

    def __len__(self) -> int:
        return len(self.names)


@dataclass(frozen=True)
class StatementGrade:
    """One chain's statement grade (:mod:`kvllm.eval.statements`)."""

    right: int  # program statements written right, in order
    statements: int  # the program's statements
    extra: int  # statement lines that align to no program statement
    stopped: bool
    answered: bool

    @property
    def share(self) -> float:
        """Statements right over the program's statements plus the extra ones."""
        return self.right / (self.statements + self.extra) if self.statements + self.extra else 0.0


def program(prompt: str) -> Program:
    """The program of a trace-format prompt (trace, reason and the needle families)."""
    values: dict[str, int] = {}
    names, lines = [], []
    for raw in prompt.splitlines():
        if m := _CONSTANT.match(raw):
            values[m[1]] = int(m[2])
        elif m := _STATEMENT.match(raw):
            name, x, op, y = m.groups()
            if x not in values or y not in values:
                raise ValueError(f"statement {raw.strip()!r} reads an undefined variable")
            values[name] = apply(values[x], op, values[y])
            names.append(name)
            lines.append(statement_line(values, name, x, op, y))
    ask = _ASK.search(prompt)
    answer = f"{ask[1]}{values[ask[1]]:02d}" if ask and ask[1] in values else None
    return Program(tuple(names), tuple(lines), answer)


def grade(prog: Program, completion: str) -> StatementGrade:
    """Grade ``completion`` (what followed the prompt) against ``prog``."""
    end = completion.find(END_THINK)
    chain = completion if end < 0 else completion[:end]
    index = {name: i for i, name in enumerate(prog.names)}
    right = extra = 0
    expected = 0  # the next program statement the chain should write
    last = None  # the program statement the last statement line was aligned to
    for raw in chain.splitlines():
        line = raw.strip()
        m = _LINE.match(line)
        if m is None or line.startswith(CHECK + " "):
            continue
        k = index.get(m[1], -1)
        if k < expected:  # a repeat, an invented name, or past the program's end
            extra += 1
            last = None
            continue
        right += line == prog.lines[k]
        expected, last = k + 1, k
    stopped = end >= 0 and len(prog) > 0 and last == len(prog) - 1
    answered = False
    if end >= 0 and prog.answer is not None:
        after = [line.strip() for line in completion[end + len(END_THINK) :].splitlines() if line.strip()]
        answered = bool(after) and after[0] == prog.answer
    return StatementGrade(right, len(prog), extra, stopped, answered)
