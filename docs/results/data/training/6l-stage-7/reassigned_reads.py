"""Stage 7's free reason chains: where their reads go wrong.

    .venv/bin/python docs/results/data/training/6l-stage-7/reassigned_reads.py \
        docs/results/data/training/6l-stage-7/checkpoint \
        docs/results/data/training/6l-stage-7/eval-reason

Reads are graded as ``kvllm eval`` grades them (:func:`kvllm.eval.lookup.reads`: right
when they give the latest value written to their name; a check line's three values are
reads, and it writes nothing), plus the reads of never-written names it skips. They are
counted by whether they come before or after the result of the program's last statement
(the chain overran the program) and by whether the name was written once or again. Also
prints, per problem, the asked name against the answered one, the chain's statements
against the program's, and the first statement whose (name, operands) differ from the
program's.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections import Counter

from transformers import PreTrainedTokenizerFast

from kvllm.eval import lookup
from kvllm.eval.tasks import END_THINK, default_difficulty, make_task


def operands(completion: str) -> tuple[list[int], list[tuple[str, str, str]]]:
    """Character offsets of every operand's digits (a check line's result too), which is
    what :func:`lookup.reads` grades plus the reads of never-written names it skips; and
    each statement's (name, operand, operand), to set beside the program's."""
    starts, statements, offset = [], [], 0
    for line in completion.split(END_THINK)[0].split("\n"):
        if m := lookup.STATEMENT.match(line):
            starts += [offset + m.start(6), offset + m.start(9)]
            statements.append((m[1], m[2], m[4]))
        elif c := lookup.CHECK.match(line):
            starts += [offset + c.start(6), offset + c.start(9), offset + c.start(11)]
        offset += len(line) + 1
    return starts, statements


def main(model: str, folder: str) -> None:
    tok = PreTrainedTokenizerFast.from_pretrained(model)
    cell = json.loads(open(f"{folder}/results.jsonl").readline())
    difficulty = dataclasses.replace(default_difficulty("reason"), op="shift")
    counts: Counter = Counter()
    for problem in cell["problems"]:
        task = make_task("reason", int(problem["uid"]), difficulty)
        program = [tuple(re.findall(r"[a-z]{2}", line)) for line in task.prompt.split("\n") if " = " in line]
        text = tok.decode(problem["ids"])
        statements = lookup.results(text)  # (name, offset of the name, offset of its digits)
        # A read is past the program when it follows the result of the program's last statement.
        end = statements[len(program) - 1][2] if len(statements) >= len(program) else len(text)
        constants = lookup.prompt_constants(task.prompt)
        graded = lookup.reads(task.prompt, text)
        for read in graded:
            writes = (read.name in constants) + sum(n == read.name and d < read.start for n, _, d in statements)
            counts["past" if read.start > end else "within", "again" if writes > 1 else "once", read.right] += 1
        starts, own = operands(text)
        seen = {read.start for read in graded}
        for start in starts:
            if start not in seen:
                counts["past" if start > end else "within", "unwritten"] += 1
        drift = next((i for i, (a, b) in enumerate(zip(own, program, strict=False)) if a != b), None)
        asked = task.prompt.split("\n")[0].rstrip(".").split()[-1]
        answered = text.split("\n")[-1].strip().removesuffix(tok.eos_token)
        print(
            f"problem {problem['uid']}: asked {asked}, answered {answered}, "
            f"{len(statements)} statements (program {len(program)}), first off the program: {drift}"
        )
    print("reads (within or past the program's length, name written once or again, right):")
    for key, n in sorted(counts.items(), key=str):
        print(f"  {key}: {n}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
