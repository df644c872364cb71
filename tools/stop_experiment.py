"""Development-seed check: which kept roles let a compressed chain stop?

The free-running bound (`kvllm/eval/bound.py`) writes most of a `reason` program right
but never stops; the query that decides Full KV's stop reads the far statements' operand
values (`tools/stop_ablation.py`). This runs the bound free at retention R (0.2 by default) on
development seeds, as it is and with some roles scored above all others (so each window
keeps them first: `newlines`, every newline; `values`, every statement's value digits), and prints the
statement grade of each.

    python tools/stop_experiment.py [N] [R] [VARIANT,...] [FIRST_SEED]

FIRST_SEED defaults to the first development seed; 0 scores the test seeds.
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvllm.assets import model_path
from kvllm.cli.evaluate import family_difficulty
from kvllm.cli.options import trained_op
from kvllm.config import CompressionConfig
from kvllm.eval.bound import KINDS, PLACES, FreeRoleBound
from kvllm.eval.grid import _bound_inputs, reference_ids
from kvllm.eval.problems import task_problems
from kvllm.eval.statements import grade, program
from kvllm.hf import generate

DEV_SEEDS = 100_000  # the first development seed (kvllm eval --dev-seeds)
BATCH = 8


# Roles ranked above all others, per variant (a role is kind * PLACES + place from the line's end).
VARIANTS: dict[str, list[int]] = {
    "bound": [],
    # place 0 of every line kind: the newline
    "newlines": [kind * PLACES for kind in range(len(KINDS) + 1)],
    # a statement's digits, counted from its end `= ju36 : ci27 = je48`: the result's at
    # places 1-2, the operands' at 5-6 and 9-10 (tools/stop_ablation.py: the stop reads them)
    "values": [1, 2, 5, 6, 9, 10],
    # the same, with the result's name (place 3) after its digits, which later reads look up
    "results-values": [1, 2, 3, 5, 6, 9, 10],
}


def main(n: int, retention: float, variants: list[str], first_seed: int = DEV_SEEDS) -> None:
    if unknown := [v for v in variants if v not in VARIANTS]:
        raise SystemExit(f"VARIANT {', '.join(unknown)} is invalid: must be one of {', '.join(VARIANTS)}")
    path = model_path("kara-reasoner-6l")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    difficulty = family_difficulty("reason", None, None, 0.5, trained_op(path))
    problems = task_problems("reason", n, difficulty, tokenizer, first_seed=first_seed)
    prompts = [tokenizer(p.prompt)["input_ids"] for p in problems]
    references = reference_ids(tokenizer, problems)
    _, scores = _bound_inputs(model, tokenizer, prompts, references, 128)
    config = CompressionConfig(method="kara", retention=retention)
    for variant in variants:
        right = graded = stopped = 0
        for lo in range(0, n, BATCH):
            batch = problems[lo : lo + BATCH]
            mine = [s.clone() for s in scores[lo : lo + BATCH]]
            for s in mine:  # above every score, in the variant's order
                top = s.max()
                for i, role in enumerate(VARIANTS[variant]):
                    s[..., role] = top + len(VARIANTS[variant]) - i
            method = FreeRoleBound(tokenizer, [len(p) for p in prompts[lo : lo + BATCH]], mine)
            out = generate(
                model, tokenizer, [p.prompt for p in batch], config, max(p.max_new_tokens for p in batch), method=method
            )
            for problem, text in zip(batch, out.texts, strict=True):
                g = grade(program(problem.prompt), text)
                right, graded, stopped = right + g.right, graded + g.statements + g.extra, stopped + g.stopped
        share, of_program = right / graded, right / (len(program(problems[0].prompt)) * n)
        grade_line = f"statements right {share:.3f}, of the program's {of_program:.3f}, stopped {stopped}/{n}"
        print(f"r={retention:g}, {variant}: {grade_line}")


if __name__ == "__main__":
    main(
        int(sys.argv[1]) if len(sys.argv) > 1 else 16,
        float(sys.argv[2]) if len(sys.argv) > 2 else 0.2,
        sys.argv[3].split(",") if len(sys.argv) > 3 else list(VARIANTS),
        int(sys.argv[4]) if len(sys.argv) > 4 else DEV_SEEDS,
    )
