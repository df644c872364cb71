"""Stage 7's free reason chains: where their reads go wrong.

    .venv/bin/python docs/training-attempts/second-model-session18/reassigned_reads.py \
        docs/training-attempts/second-model-session18/checkpoint \
        docs/training-attempts/second-model-session18/eval-reason

A read is right when it gives the latest value written to its name (a prompt constant or
an earlier statement of the model's own chain); a check line's three values are reads,
and it writes nothing. Reads are counted by whether their statement lies within the
program's length or past it (the chain overran the program), and by whether the name was
written once or again. Also prints, per problem, the asked name against the answered
one, the chain's statements against the program's, and the first statement whose
(name, operands) differ from the program's.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections import Counter

from transformers import PreTrainedTokenizerFast

from kvllm.eval.tasks import END_THINK, default_difficulty, make_task

CONSTANT = re.compile(r"\s*([a-z]{2})(\d\d)\s*")
# name = x : y = xVV : yVV = nameVV, as a check line or a statement.
STATEMENT = re.compile(
    r"\s*(check )?([a-z]{2}) = ([a-z]{2}) : ([a-z]{2}) = ([a-z]{2})(\d\d) : ([a-z]{2})(\d\d) = ([a-z]{2})(\d\d)\s*"
)


def main(model: str, folder: str) -> None:
    tok = PreTrainedTokenizerFast.from_pretrained(model)
    cell = json.loads(open(f"{folder}/results.jsonl").readline())
    difficulty = dataclasses.replace(default_difficulty("reason"), op="shift")
    counts: Counter = Counter()
    for problem in cell["problems"]:
        task = make_task("reason", int(problem["uid"]), difficulty)
        program = [tuple(re.findall(r"[a-z]{2}", line)) for line in task.prompt.split("\n") if " = " in line]
        text = tok.decode(problem["ids"])
        values: dict[str, str] = {}
        writes: Counter = Counter()
        for line in task.prompt.split("\n"):
            if m := CONSTANT.fullmatch(line):
                values[m[1]], writes[m[1]] = m[2], 1
        own: list[tuple[str, ...]] = []
        for line in text.split(END_THINK)[0].split("\n"):
            if not (m := STATEMENT.fullmatch(line)):
                continue
            where = "within" if len(own) < len(program) else "past"
            check = bool(m[1])
            for name, value in ((m[5], m[6]), (m[7], m[8]), *([(m[9], m[10])] if check else [])):
                if name not in values:
                    counts[where, "unwritten"] += 1
                else:
                    counts[where, "again" if writes[name] > 1 else "once", values[name] == value] += 1
            if not check:
                values[m[9]] = m[10]
                writes[m[9]] += 1
                own.append((m[2], m[3], m[4]))
        drift = next((i for i, (a, b) in enumerate(zip(own, program, strict=False)) if a != b), None)
        asked = task.prompt.split("\n")[0].rstrip(".").split()[-1]
        answered = text.split("\n")[-1].strip().removesuffix(tok.eos_token)
        print(
            f"problem {problem['uid']}: asked {asked}, answered {answered}, "
            f"{len(own)} statements (program {len(program)}), first off the program: {drift}"
        )
    print("reads (within or past the program's length, name written once or again, right):")
    for key, n in sorted(counts.items(), key=str):
        print(f"  {key}: {n}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
