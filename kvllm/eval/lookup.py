"""Retrieval grades: does the chain of thought read back what was written?

Decoding-time compression endangers one thing above all: re-reading a value that the
model itself wrote earlier in its chain of thought. The generated tasks
(:mod:`kvllm.eval.tasks`) write every operand as ``name`` + two digits, so each read can
be checked against the value the model itself last wrote for that name, whatever the
model's arithmetic:

- **lookup fidelity**: the share of operand reads that equal that value, split by where
  the value came from (the prompt's constants, or a line the model generated) and by how
  many tokens back it was written (:data:`BUCKETS`, in multiples of the window W);
- **non-modal fidelity**: the same share over the generated reads whose value is not the
  chain's modal one (the value its generated reads read most often). A writer of one
  constant value scores the rest, the **floor**, for free: the shipped model writes
  ``00`` for 56% of its trace results, and a second model that wrote ``00`` everywhere
  met fidelity bars with no lookup at all (docs/appendix/training-record.md, "Stage 4, and why its bars were hollow").
  The **modal result share** (results equal to the chain's most common result) says
  whether a model computes distinct values at all;
- **self-recall** (gen-needle): the final answer equals the value the model wrote for
  ``key`` in its first line; **answer recall** (reason): the final answer equals the
  value the model last wrote for the asked variable, about 2,000 tokens back.

``reason``'s check lines (``check ce = bo + ku = bo41 + ku13 = ce54``) re-read three
values, the result included, and write none; its restatements (``so ce is 54.``) and
hedges are well-formed lines that read and write nothing.

A read whose name the model never wrote (and the prompt never defined) has no source and
is not counted; neither are lines out of format.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvllm.eval.tasks import END_THINK, HEDGES, answer_span, extract_answer

# `ce = bo + ku = bo41 + ku13 = ce54` (or a shift, `:`): the statement, its two reads, its result.
STATEMENT = re.compile(r"^ ?(\w+) = (\w+) ([-+:]) (\w+) = ([a-z]+)(\d{2}) ([-+:]) ([a-z]+)(\d{2}) = ([a-z]+)(\d{2})$")
# `check ce = bo + ku = bo41 + ku13 = ce54`: a statement re-derived, with the same groups.
CHECK = re.compile(r"^ ?check " + STATEMENT.pattern.removeprefix("^ ?"))
RESTATE = re.compile(r"^ ?so [a-z]+ is \d{2}\.$")
HEDGE = re.compile("^ ?(" + "|".join(re.escape(h) for h in HEDGES) + ")$")
_HEADER = re.compile(r"report (\w+)\.")
_CONSTANT = re.compile(r"^ ?([a-z]+)(\d{2})$")
_KEY = re.compile(r"^ ?key = \d{2} [-+:] \d{2} = key(\d{2})$")
#: Distance buckets, as (label, low, high) in multiples of W: [low * W, high * W).
BUCKETS: tuple[tuple[str, float, float], ...] = (
    ("<W", 0, 1),
    ("W-2W", 1, 2),
    ("2W-4W", 2, 4),
    (">4W", 4, float("inf")),
)


@dataclass(frozen=True)
class Read:
    """One operand read of the chain of thought.

    Attributes
    ----------
    name
        The variable read.
    start
        Character offset of the read's two digits in the completion.
    right
        Whether the digits equal the value last written for ``name``.
    expected
        That value.
    source
        ``"prompt"`` (a constant) or ``"generated"`` (a line of the completion).
    distance
        Tokens between the read's digits and the source's digits (``None`` without offsets).
    """

    name: str
    start: int
    right: bool
    expected: int
    source: str
    distance: int | None = None


@dataclass
class LookupTally:
    """Counts of one completion: reads and right reads per source and per distance bucket
    of generated reads; generated reads of the chain's modal value (the floor) and the
    right ones among them; statement results and those equal to the most common one."""

    reads: dict[str, int] = field(default_factory=lambda: {"prompt": 0, "generated": 0})
    right: dict[str, int] = field(default_factory=lambda: {"prompt": 0, "generated": 0})
    bucket_reads: dict[str, int] = field(default_factory=lambda: {b[0]: 0 for b in BUCKETS})
    bucket_right: dict[str, int] = field(default_factory=lambda: {b[0]: 0 for b in BUCKETS})
    malformed_lines: int = 0
    modal_reads: int = 0
    modal_right: int = 0
    results: int = 0
    modal_results: int = 0

    def add(self, read: Read, window: int, modal: int | None = None) -> None:
        """Count ``read``; a generated read of ``modal`` (the chain's modal value) also
        counts toward the floor."""
        self.reads[read.source] += 1
        self.right[read.source] += read.right
        if read.source != "generated":
            return
        if read.expected == modal:
            self.modal_reads += 1
            self.modal_right += read.right
        if read.distance is not None:
            label = bucket(read.distance, window)
            self.bucket_reads[label] += 1
            self.bucket_right[label] += read.right


def modal_value(values: Sequence[int]) -> int | None:
    """The most common of ``values`` (the smallest among ties), ``None`` if there are none."""
    counts = Counter(values)
    return min(counts, key=lambda v: (-counts[v], v)) if counts else None


def _tally(graded: Sequence[Read], completion: str, window: int) -> LookupTally:
    """A :class:`LookupTally` of one completion's graded reads, the floor included."""
    t = LookupTally()
    modal = modal_value([r.expected for r in graded if r.source == "generated"])
    for read in graded:
        t.add(read, window, modal)
    t.malformed_lines = malformed_lines(completion)
    values = [int(completion[d : d + 2]) for _, _, d in results(completion)]
    t.results = len(values)
    t.modal_results = values.count(modal_value(values))  # 0 for no results (mode None)
    return t


def bucket(distance: int, window: int) -> str:
    """The :data:`BUCKETS` label of a distance in tokens."""
    for label, lo, hi in BUCKETS:
        if lo * window <= distance < hi * window:
            return label
    raise ValueError(f"distance={distance} is invalid: must be >= 0")


def prompt_constants(prompt: str) -> dict[str, tuple[int, int]]:
    """The constants a prompt defines (``bo41`` lines; the needle ``code`` too): name ->
    (value, character offset of its digits)."""
    out = {}
    offset = 0
    for line in prompt.split("\n"):
        if m := _CONSTANT.match(line):
            out[m.group(1)] = (int(m.group(2)), offset + m.start(2))
        offset += len(line) + 1
    return out


def reads(
    prompt: str,
    completion: str,
    token_of: Sequence[int] | None = None,
    prompt_token_of: Sequence[int] | None = None,
    n_prompt: int | None = None,
) -> list[Read]:
    """Every operand read of ``completion``'s chain of thought, graded.

    Parameters
    ----------
    prompt, completion
        The task's prompt and the model's completion (text after the prompt).
    token_of, prompt_token_of
        Per character of the completion and of the prompt, the index of its token
        (:func:`char_to_token`); with both, each read gets its distance in tokens.
    n_prompt
        The prompt's length in tokens. Give it: read off ``prompt_token_of`` it misses
        trailing tokens that decode to no text (a special ``<think>``, say).
    """
    if n_prompt is None:
        n_prompt = (prompt_token_of[-1] + 1) if prompt_token_of else 0
    positioned = token_of is not None and prompt_token_of is not None

    def position(start: int) -> int | None:
        return n_prompt + token_of[start] if positioned else None

    constants = {
        name: (value, prompt_token_of[c] if positioned else None)
        for name, (value, c) in prompt_constants(prompt).items()
    }
    written: dict[str, tuple[int, int | None]] = {}  # name -> (value, position of its digits)
    out: list[Read] = []

    def grade(name: str, value: int, start: int) -> None:
        if name in written:
            (expected, src), source = written[name], "generated"
        elif name in constants:
            (expected, src), source = constants[name], "prompt"
        else:
            return
        here = position(start)
        distance = here - src if here is not None and src is not None else None
        out.append(Read(name, start, value == expected, expected, source, distance))

    offset = 0
    for line in completion.split(END_THINK)[0].split("\n"):
        if m := STATEMENT.match(line):
            for name_group, digits_group in ((5, 6), (8, 9)):
                grade(m.group(name_group), int(m.group(digits_group)), offset + m.start(digits_group))
            written[m.group(10)] = (int(m.group(11)), position(offset + m.start(11)))
        elif c := CHECK.match(line):
            for name_group, digits_group in ((5, 6), (8, 9), (10, 11)):
                grade(c.group(name_group), int(c.group(digits_group)), offset + c.start(digits_group))
        elif k := _KEY.match(line):
            written["key"] = (int(k.group(1)), position(offset + k.start(1)))
        offset += len(line) + 1
    return out


def malformed_lines(completion: str) -> int:
    """Chain-of-thought lines of no family's format (statements, key, check, restatement, hedge lines)."""
    body = completion.split(END_THINK)[0]
    lines = [line for line in body.split("\n") if line.strip()]
    well_formed = (STATEMENT, _KEY, CHECK, RESTATE, HEDGE)
    return sum(1 for line in lines if not any(pattern.match(line) for pattern in well_formed))


def self_recall(completion: str) -> bool:
    """gen-needle: the final answer equals the value the model wrote for ``key`` first."""
    for line in completion.split("\n"):
        if m := _KEY.match(line):
            return extract_answer(completion) == m.group(1)
        if line.strip():
            return False  # the first line is not the key line
    return False


def results(completion: str) -> list[tuple[str, int, int]]:
    """Each statement's result in the chain of thought: (name, character offset of the
    name, character offset of its two digits)."""
    out, offset = [], 0
    for line in completion.split(END_THINK)[0].split("\n"):
        if m := STATEMENT.match(line):
            out.append((m.group(10), offset + m.start(10), offset + m.start(11)))
        offset += len(line) + 1
    return out


def answer_source(prompt: str, completion: str) -> int | None:
    """Character offset of the digits the model last wrote for the variable the prompt's
    first line asks for (``report NAME.``), or ``None`` if it wrote none."""
    header = _HEADER.search(prompt.split("\n", 1)[0])
    if header is None:
        raise ValueError("the prompt's first line names no variable to report ('... report NAME.')")
    written = [digits for name, _, digits in results(completion) if name == header.group(1)]
    return written[-1] if written else None


def answer_recall(prompt: str, completion: str) -> bool:
    """reason: the final answer equals the value the model last wrote for the asked
    variable, whatever its arithmetic; ``False`` if it wrote none."""
    source = answer_source(prompt, completion)
    return source is not None and extract_answer(completion) == completion[source : source + 2]


def tally(
    prompt: str,
    completion: str,
    window: int,
    token_of: Sequence[int] | None = None,
    prompt_token_of: Sequence[int] | None = None,
    n_prompt: int | None = None,
) -> LookupTally:
    """A :class:`LookupTally` of one completion."""
    return _tally(reads(prompt, completion, token_of, prompt_token_of, n_prompt), completion, window)


def char_to_token(tokenizer, ids: Sequence[int]) -> tuple[str, list[int]]:
    """The decoded text of ``ids`` and, per character, the index of its token.

    Token by token when the pieces add up to the whole decoding (they do for the shipped
    tokenizer), else by decoding prefixes, which holds for any prefix-stable tokenizer.
    """
    ids = list(ids)
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    pieces = [tokenizer.decode([i], skip_special_tokens=True) for i in ids]
    if "".join(pieces) == whole:
        return whole, [i for i, piece in enumerate(pieces) for _ in piece]
    text, owner = "", []
    for i in range(len(ids)):
        prefix = tokenizer.decode(ids[: i + 1], skip_special_tokens=True)
        owner += [i] * (len(prefix) - len(text))
        text = prefix
    return text, owner


def forced_tally(
    tokenizer, prompt: str, text: str, owner: Sequence[int], predictions: Sequence[int], window: int
) -> LookupTally:
    """Teacher-forced lookup fidelity: a read of the forced completion is right when the
    model's argmax at its digit tokens spells the value last written for its name. The
    floor and the modal result share are the forced text's, so every method is graded on
    the same non-modal reads. ``text`` and ``owner`` are the forced ids' :func:`char_to_token`,
    decoded once for this and :func:`forced_recall`."""
    prompt_ids = tokenizer(prompt)["input_ids"]
    _, prompt_owner = char_to_token(tokenizer, prompt_ids)
    graded = []
    for read in reads(prompt, text, owner, prompt_owner, len(prompt_ids)):
        digits = sorted({owner[read.start], owner[read.start + 1]})
        spelled = tokenizer.decode([predictions[i] for i in digits], skip_special_tokens=True).strip()
        graded.append(dataclasses.replace(read, right=spelled == f"{read.expected:02d}"))
    return _tally(graded, text, window)


def forced_recall(
    tokenizer, prompt: str, family: str, text: str, owner: Sequence[int], predictions: Sequence[int]
) -> bool | None:
    """Forced self-recall (gen-needle) or answer recall (reason): the model's argmax at the
    forced answer's digits spells the value the forced chain wrote for ``key`` or for the
    asked variable; ``None`` for the other families. (The forced text's own answer says
    nothing of the cache it was forced through.) ``text`` and ``owner`` are as for
    :func:`forced_tally`."""
    if family not in ("gen-needle", "reason"):
        return None
    if family == "reason":
        source = answer_source(prompt, text)
        expected = None if source is None else text[source : source + 2]
    else:
        key = next((m for line in text.split("\n") if (m := _KEY.match(line))), None)
        expected = None if key is None else key.group(1)
    answer = answer_span(text)
    if expected is None or answer is None:
        return False
    digits = sorted({owner[i] for i in range(*answer)})
    return tokenizer.decode([predictions[i] for i in digits], skip_special_tokens=True).strip() == expected
