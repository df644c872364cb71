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
``reason``
    The trace's program and line format, shaped like a reasoning model's chain of
    thought (:class:`ReasonStyle`, docs/guide/evaluation.md, "The reason family"): operands come
    mostly from the last few steps, some from a few re-read anchors, some from the
    prompt's data and some from anywhere; lines restate results in words, hedge
    (``wait, let me double-check that.``) and re-check earlier results (``check ce = bo
    + ku = bo41 + ku13 = ce54``); chains run for about 2,000 tokens; the answer recalls
    the first step's result, written near the chain's start.

Every family takes the statements' operator from :attr:`Difficulty.op`: ``add`` (above,
the default) or ``shift`` (``ce = bo : ku = bo41 : ku13 = ce54``, each result digit one
more than a digit copied from an operand), the same programs with a result that a model
too small to add can compute.

The format is regular on purpose, so that a model of a few million parameters trained
for minutes on a CPU can learn it (``docs/appendix/training-record.md``): variables are named
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
from dataclasses import dataclass, field

FAMILIES: tuple[str, ...] = ("trace", "gen-needle", "prompt-needle", "reason")
# The trace-format families, which the shipped model was trained on: the commands'
# defaults. ``reason`` is asked for by name: its chains are three times as long.
TRACE_FAMILIES: tuple[str, ...] = ("trace", "gen-needle", "prompt-needle")
#: Statement operators. ``add``: ``+`` or ``-`` mod 100, the shipped model's tasks.
#: ``shift`` (``ce = bo : ku = bo41 : ku13 = ce54``): one more than the first operand's tens
#: digit, and one more than the second's units digit (mod 10), for a model that cannot learn
#: the arithmetic (docs/appendix/training-record.md, "Stage 5"). Each result digit is one digit
#: copied from a fixed place and stepped, not a 10 x 10 table; the step keeps the values as
#: varied as ``add``'s (a plain copy of the two digits lets a few values take over a chain).
OPS: tuple[str, ...] = ("add", "shift")
SHIFT = ":"
TEST_SEEDS = range(0, 1_000_000)
TRAIN_SEEDS = range(1_000_000, 2**31)
THINK, END_THINK = "<think>", "</think>"
#: The shipped models' chat template: a chat turn is a task prompt without its thinking
#: marker, and the template adds it back on a line of its own. The newline sits inside an
#: expression because transformers renders with ``trim_blocks``, which drops a newline
#: written right after a block tag (the prompt would end ``... <think>``, unlike training).
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ '\\n " + THINK + "' }}"
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
    op
        The statements' operator, one of :data:`OPS`. It is left out of the repr, which
        seeds a task's draws, so a ``shift`` task is its ``add`` twin's program with the
        other operator, and every ``add`` task is what it was before the knob existed.
    """

    constants: int = 12
    steps: int = 40
    depth: float = 0.5
    op: str = field(default="add", repr=False)

    def __post_init__(self) -> None:
        if self.constants < 2:
            raise ValueError(f"Difficulty.constants={self.constants} is invalid: must be >= 2")
        if not 1 <= self.steps <= len(NAMES) - self.constants:
            raise ValueError(f"Difficulty.steps={self.steps} is invalid: must be in [1, {len(NAMES) - self.constants}]")
        if not 0.0 <= self.depth <= 1.0:
            raise ValueError(f"Difficulty.depth={self.depth} is invalid: must be in [0, 1]")
        if self.op not in OPS:
            raise ValueError(f"Difficulty.op={self.op!r} is invalid: must be one of {', '.join(OPS)}")


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
        op = draw_operator(rng, d.op)
        x, y = rng.choice(defined), rng.choice(defined)
        prompt.append(f"{name} = {x} {op} {y}")
        cot.append(_evaluate(values, name, x, op, y))
    return prompt, cot, names[-1], values


def draw_operator(rng: random.Random, op: str) -> str:
    """A statement's operator symbol; ``+`` or ``-`` is drawn either way, so that both ops
    make the same program from the same seed."""
    symbol = rng.choice("+-")
    return SHIFT if op == "shift" else symbol


def apply(a: int, op: str, b: int) -> int:
    """``a op b`` for an operator symbol: ``+`` and ``-`` mod 100, or the shift (:data:`OPS`)."""
    if op == SHIFT:
        return (a // 10 + 1) % 10 * 10 + (b + 1) % 10
    return (a + b) % 100 if op == "+" else (a - b) % 100


def _evaluate(values: dict[str, int], name: str, x: str, op: str, y: str) -> str:
    """Evaluate ``name = x op y`` into ``values``; returns its chain-of-thought line."""
    values[name] = apply(values[x], op, values[y])
    return statement_line(values, name, x, op, y)


def statement_line(values: dict[str, int], name: str, x: str, op: str, y: str) -> str:
    """``ce = bo + ku = bo41 + ku13 = ce54``: the statement with every value after its name."""
    return f"{name} = {x} {op} {y} = {x}{values[x]:02d} {op} {y}{values[y]:02d} = {name}{values[name]:02d}"


@dataclass(frozen=True)
class ReasonStyle:
    """The ``reason`` family's knobs, fixed before any method was scored on it.

    Each default and why it resembles real reasoning traces is in docs/guide/evaluation.md ("The
    reason family"); they must not move to change a score. An operand is drawn from one
    of four pools, with these probabilities (while no step has a result yet, ``recent``
    falls through to the anchors, and ``far`` to the prompt's other constants):

    Attributes
    ----------
    recent, recent_steps
        Share of operands read from the results of the last ``recent_steps`` steps
        (locality: most reads are of what was just written).
    anchor, prompt_anchors, anchor_every, live_anchors
        Share read from the anchors: ``prompt_anchors`` of the prompt's constants (the
        question's data), re-read over the whole chain, and the last ``live_anchors``
        milestones, every ``anchor_every``-th step's result (key intermediate results:
        re-read for a stretch, then superseded by newer ones).
    prompt
        Share read from the prompt's other constants.
    far
        The rest, ``1 - recent - anchor - prompt``: uniform over every earlier value
        (the heavy tail).
    restate
        Chance that a step restates its result in words (``so ce is 54.``).
    hedge
        Chance that a step is followed by a hedging line from :data:`HEDGES`.
    check_every, check_lines
        Every ``check_every`` steps a check pass re-derives ``check_lines`` earlier
        steps, chosen uniformly, re-reading their operands and results.
    """

    recent: float = 0.55
    recent_steps: int = 4
    anchor: float = 0.2
    prompt_anchors: int = 2
    anchor_every: int = 12
    live_anchors: int = 3
    prompt: float = 0.12
    restate: float = 0.25
    hedge: float = 0.4
    check_every: int = 20
    check_lines: int = 3

    def __post_init__(self) -> None:
        for name in ("recent", "anchor", "prompt", "restate", "hedge"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"ReasonStyle.{name}={value} is invalid: must be in [0, 1]")
        if self.recent + self.anchor + self.prompt > 1.0:
            raise ValueError(
                f"ReasonStyle.recent + anchor + prompt = {self.recent + self.anchor + self.prompt} is invalid: "
                "must be <= 1 (the rest is far)"
            )
        for name in ("recent_steps", "prompt_anchors", "anchor_every", "live_anchors", "check_every", "check_lines"):
            if getattr(self, name) < 1:
                raise ValueError(f"ReasonStyle.{name}={getattr(self, name)} is invalid: must be >= 1")

    @property
    def far(self) -> float:
        return 1.0 - self.recent - self.anchor - self.prompt


REASON = ReasonStyle()
#: ``reason``'s default difficulty: 6 constants and 84 steps, about 2,200 chain-of-thought tokens.
REASON_DIFFICULTY = Difficulty(constants=6, steps=84)
#: Hedging lines: no value in them, as "Wait, let me double-check." carries none.
HEDGES = (
    "wait, let me double-check that.",
    "hmm, that looks right.",
    "ok, on to the next one.",
    "let me keep going.",
    "so far so good.",
)
RESTATE, CHECK = "so", "check"


def _reason(rng: random.Random, d: Difficulty, style: ReasonStyle) -> tuple[list[str], list[str], str, int]:
    """Prompt lines, chain-of-thought lines, the asked variable and its value."""
    start = rng.randrange(len(NAMES))
    names = [NAMES[(start + i) % len(NAMES)] for i in range(d.constants + d.steps)]
    constants, steps = names[: d.constants], names[d.constants :]
    values = {name: rng.randrange(100) for name in constants}
    fixed = rng.sample(constants, min(style.prompt_anchors, len(constants)))
    milestones: list[str] = []
    others = [c for c in constants if c not in fixed] or constants
    prompt = [f"{name}{values[name]:02d}" for name in constants]
    cot: list[str] = []
    done: list[tuple[str, str, str, str]] = []  # (name, x, op, y) of every step so far

    def operand() -> str:
        draw = rng.random()
        written = [step[0] for step in done]
        if draw < style.recent and written:
            return rng.choice(written[-style.recent_steps :])
        if draw < style.recent + style.anchor:
            return rng.choice(fixed + milestones[-style.live_anchors :])
        if draw < style.recent + style.anchor + style.prompt or not written:
            return rng.choice(others)
        return rng.choice(constants + written)

    for i, name in enumerate(steps, start=1):
        x, op, y = operand(), draw_operator(rng, d.op), operand()
        prompt.append(f"{name} = {x} {op} {y}")
        cot.append(_evaluate(values, name, x, op, y))
        done.append((name, x, op, y))
        if i % style.anchor_every == 0:
            milestones.append(name)
        if rng.random() < style.restate:
            cot.append(f"{RESTATE} {name} is {values[name]:02d}.")
        if rng.random() < style.hedge:
            cot.append(rng.choice(HEDGES))
        if i % style.check_every == 0:
            for step in rng.sample(done[:-1], min(style.check_lines, len(done) - 1)):
                cot.append(f"{CHECK} {statement_line(values, *step)}")
    ask = steps[0]
    return prompt, cot, ask, values[ask]


def default_difficulty(family: str) -> Difficulty:
    """The difficulty a family's tasks get when none is given: :data:`REASON_DIFFICULTY`
    for ``reason``, :class:`Difficulty`'s defaults for the trace families."""
    return REASON_DIFFICULTY if family == "reason" else Difficulty()


def make_task(family: str, seed: int, difficulty: Difficulty | None = None, style: ReasonStyle = REASON) -> Task:
    """The task of ``family`` for ``seed`` (deterministic); ``style`` shapes ``reason`` only."""
    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is invalid: must be one of {', '.join(FAMILIES)}")
    d = difficulty or default_difficulty(family)
    if family == "reason":
        rng = random.Random(f"{family}:{seed}:{d}:{style}")
        prompt, cot, ask, answer = _reason(rng, d, style)
        return _assemble(family, seed, prompt, cot, ask, answer)
    rng = random.Random(f"{family}:{seed}:{d}")
    prompt, cot, last, values = _program(rng, d)
    ask, answer = last, values[last]
    if family == "gen-needle":
        a, b = rng.randrange(100), rng.randrange(100)
        op = "+" if d.op == "add" else SHIFT
        ask, answer = "key", apply(a, op, b)
        prompt.insert(0, f"key = {a:02d} {op} {b:02d}")
        cot.insert(0, f"key = {a:02d} {op} {b:02d} = key{answer:02d}")
    elif family == "prompt-needle":
        ask, answer = "code", rng.randrange(100)
        prompt.insert(round(d.depth * len(prompt)), f"code{answer:02d}")
    return _assemble(family, seed, prompt, cot, ask, answer)


def _assemble(family: str, seed: int, prompt: list[str], cot: list[str], ask: str, answer: int) -> Task:
    # Every line starts with a space, so a name is the same token wherever it appears.
    lines = [f"{family}: evaluate and report {ask}.", *prompt, THINK, *cot, END_THINK, f"{ask}{answer:02d}"]
    text = "\n ".join(lines)
    split = text.index(THINK) + len(THINK)
    return Task(family=family, seed=seed, prompt=text[:split], target=text[split:], answer=f"{answer:02d}")


_ANSWER = re.compile(r"\d+")


def answer_span(completion: str) -> tuple[int, int] | None:
    """Where the first number after the last ``</think>`` is, if any: (start, end)."""
    end = completion.rfind(END_THINK)
    match = _ANSWER.search(completion, end + len(END_THINK)) if end >= 0 else None
    return match.span() if match else None


def extract_answer(completion: str) -> str | None:
    """The first number after the last ``</think>``, if any."""
    span = answer_span(completion)
    return completion[slice(*span)] if span else None


def grade(task: Task, completion: str) -> bool:
    """Exact match of the final answer."""
    return extract_answer(completion) == task.answer
