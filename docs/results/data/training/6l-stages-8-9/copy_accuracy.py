"""Teacher-forced: does a model copy each statement of the prompt's program, and stop after the last?

    .venv/bin/python docs/results/data/training/6l-stages-8-9/copy_accuracy.py MODEL FAMILY OP [N]

On the first N test seeds (default 8) of FAMILY at its default difficulty with operator
OP, the model reads the task's own target and predicts each next token greedily. Prints
the share of right predictions for each statement line's name (which statement comes
next), its first and its second operand name (copied from the prompt's line that defines
the name); check lines are left out: their statement is a random earlier one, not a
copy. Then the decision to stop: the first token of the line `` </think>`` (a space),
where the target has it, and right after the program's last statement, which is where a
greedy chain decides (it writes no restatements or hedges: each is less likely than the
next statement); for each, how often it is the prediction and its mean probability.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from kvllm.eval.lookup import STATEMENT
from kvllm.eval.tasks import END_THINK, default_difficulty, make_task


def main(model_dir: str, family: str, op: str, n: int = 8) -> None:
    tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    difficulty = dataclasses.replace(default_difficulty(family), op=op)
    end_line = tok(f"\n {END_THINK}")["input_ids"]
    stop = end_line[-2]  # the space before </think>: the token that decides to stop
    right, total, probability = Counter(), Counter(), Counter()
    for seed in range(n):
        task = make_task(family, seed, difficulty)
        encoded = tok(task.text, return_offsets_mapping=True)
        ids = encoded["input_ids"]
        token_at = {start: i for i, (start, _) in enumerate(encoded["offset_mapping"])}
        with torch.no_grad():
            probabilities = model(torch.tensor([ids])).logits[0].softmax(-1)
        predicted = probabilities.argmax(-1).tolist()
        offset, last = len(task.prompt), 0
        for line in task.target.split("\n"):
            if m := STATEMENT.match(line):
                last = offset + len(line) + 1
                # A name's token starts at the space before it.
                for kind, group in (("name", 1), ("first operand", 2), ("second operand", 4)):
                    i = token_at[offset + m.start(group) - 1]
                    right[kind] += predicted[i - 1] == ids[i]
                    total[kind] += 1
            offset += len(line) + 1
        end = task.text.index(END_THINK) - 1
        after_last = tok(task.text[:last])["input_ids"]
        with torch.no_grad():
            after = model(torch.tensor([after_last])).logits[0, -1].softmax(-1)
        for kind, p in (
            ("stop at the end line", probabilities[token_at[end] - 1]),
            ("stop after the last statement", after),
        ):
            right[kind] += int(p.argmax()) == stop
            total[kind] += 1
            probability[kind] += float(p[stop])
    print(f"{model_dir} {family} --op {op}, test seeds 0-{n - 1}, teacher-forced:")
    for kind in total:
        mean = f", mean probability {probability[kind] / total[kind]:.3f}" if kind in probability else ""
        print(f"  {kind}: {right[kind] / total[kind]:.3f} right of {total[kind]}{mean}")


if __name__ == "__main__":
    main(*sys.argv[1:4], *map(int, sys.argv[4:5]))
