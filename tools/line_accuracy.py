"""Teacher-forced accuracy by position in a chain-of-thought line, for a trained model.

A line is ``ce = bo + ku = bo41 + ku13 = ce54``, 18 tokens: 0 the next name, 2 and 4
the operand names copied from the prompt, 3 the operator, 7-8 and 11-12 the operand
values read back, 15-16 the result. Also prints how often the final answer's two digits
are both right. 12 held-out tasks per family (seeds 0-11).

Usage::

    python tools/line_accuracy.py kvllm/assets/kara-reasoner-tiny --constants 8 --steps 28
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvllm.eval.tasks import END_THINK, FAMILIES, Difficulty, make_task

LINE = 18  # tokens per chain-of-thought line, line break included


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--constants", type=int, default=8)
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--tasks", type=int, default=12, help="held-out tasks per family")
    args = p.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    newline = tok.convert_tokens_to_ids("Ċ")
    hits, counts, answers = [0] * LINE, [0] * LINE, 0
    for family in FAMILIES:
        for seed in range(args.tasks):
            task = make_task(family, seed, Difficulty(args.constants, args.steps))
            ids = tok(task.text)["input_ids"]
            with torch.no_grad():
                pred = model(torch.tensor([ids])).logits[0].argmax(-1).tolist()
            # Lines run from after "<think>\n" to "</think>"; the gen-needle fact line has
            # another length and is skipped.
            start = len(tok(task.prompt)["input_ids"]) + 1
            end = ids.index(tok.convert_tokens_to_ids(END_THINK))
            while start < end - 1:
                stop = ids.index(newline, start) + 1
                if stop - start == LINE:
                    for k in range(LINE):
                        hits[k] += pred[start + k - 1] == ids[start + k]
                        counts[k] += 1
                start = stop
            answers += all(pred[q - 1] == ids[q] for q in (len(ids) - 2, len(ids) - 1))
    print(" ".join(f"{k}:{h / max(1, c):.2f}" for k, (h, c) in enumerate(zip(hits, counts, strict=True))))
    print(f"answer digits both right: {answers / (len(FAMILIES) * args.tasks):.2f}")


if __name__ == "__main__":
    main()
