"""Associative-recall probe: does the name-to-value lookup form, and how fast?

Trains the shipped model's shape on pure recall (records ``name VV``, then queries of
those names, each followed by its value; names unscored) and prints the teacher-forced
accuracy of the first (``d1``) and second (``d2``) value digit every 30 seconds. The
lookup every task needs is ``d1``; ``docs/appendix/training-record.md`` (runs 7-11)
records what each setting gave.

``--text probe`` uses a vocabulary of its own (names, digits, ``\\n``, ``|``);
``--text trainer`` uses ``tools/train_reasoner.py``'s tokenizer and recall text.

Usage::

    python tools/probe_recall.py --text probe --minutes 5
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from train_reasoner import SHAPE, _recall, build_tokenizer, model_config, name_token_ids

from kvllm.eval.tasks import NAMES

FIRST, SECOND = 1, 2  # kinds of scored target


class ProbeText:
    """Own vocabulary: ``bo 4 1 \\n`` per record, ``|``, then the queries."""

    def __init__(self, split_digits: bool, extra: int, replacement: bool) -> None:
        digits = list("0123456789")
        vocab = NAMES + digits + ["\n", "|"] + [f"d{d}" for d in digits] + [f"x{i}" for i in range(extra)]
        self.id = {t: i for i, t in enumerate(vocab)}
        self.vocab_size = len(vocab)
        self.first = "d" if split_digits else ""
        self.replacement = replacement

    def example(self, rng: random.Random, pairs: int) -> tuple[list[int], list[int], list[int]]:
        names = rng.sample(NAMES, pairs)
        values = {n: rng.randrange(100) for n in names}

        def record(n: str) -> list[int]:
            v = values[n]
            return [self.id[n], self.id[f"{self.first}{v // 10}"], self.id[str(v % 10)], self.id["\n"]]

        ids = [t for n in names for t in record(n)] + [self.id["|"]]
        labels, kinds = [-100] * len(ids), [0] * len(ids)
        queries = [rng.choice(names) for _ in names] if self.replacement else rng.sample(names, pairs)
        for n in queries:
            r = record(n)
            ids += r
            labels += [-100, *r[1:]]
            kinds += [0, FIRST, SECOND, 0]
        return ids, labels, kinds


class TrainerText:
    """``train_reasoner._recall`` text through ``train_reasoner.build_tokenizer``."""

    def __init__(self, bare: bool = False) -> None:
        self.bare = bare
        self.tok = build_tokenizer(512, 0)
        self.vocab_size = len(self.tok)
        self.names = set(name_token_ids(self.tok).tolist())
        self.digits = set(self.tok.convert_tokens_to_ids(list("0123456789")))

    def example(self, rng: random.Random, pairs: int) -> tuple[list[int], list[int], list[int]]:
        prompt, target = _recall(rng, pairs, pairs)
        if self.bare:
            records = prompt.split("\n ")[:-1]  # the first keeps its leading space
            prompt = "\n ".join(records) + "\n |"
            target = "\n " + "\n ".join(target.split("\n ")[1 : pairs + 1])
        p, t = self.tok(prompt)["input_ids"], self.tok(target)["input_ids"]
        labels = [-100] * len(p) + [-100 if i in self.names else i for i in t]
        ids = p + t
        # A value's first digit follows its name, the second follows the first.
        kinds = [
            0 if j < len(p) or i not in self.digits else FIRST if ids[j - 1] in self.names else SECOND
            for j, i in enumerate(ids)
        ]
        return ids, labels, kinds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", choices=("probe", "trainer"), default="probe")
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-replacement", action="store_true", help="probe text: queries without replacement")
    p.add_argument("--split-digits", action="store_true", help="probe text: first digits get tokens of their own")
    p.add_argument("--bare", action="store_true", help="trainer text: records and queries only")
    p.add_argument("--extra-vocab", type=int, default=0, help="probe text: unused tokens added")
    args = p.parse_args()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    text = (
        TrainerText(args.bare)
        if args.text == "trainer"
        else ProbeText(args.split_digits, args.extra_vocab, not args.no_replacement)
    )
    model = Qwen3ForCausalLM(model_config(text.vocab_size, **SHAPE))
    model.config._attn_implementation = "sdpa"
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    start = last = time.perf_counter()
    step, hits, counts = 0, [0, 0], [0, 0]
    while time.perf_counter() - start < 60 * args.minutes:
        rows = [text.example(rng, args.pairs) for _ in range(args.batch)]
        width = max(len(r[0]) for r in rows)
        ids = torch.tensor([r[0] + [0] * (width - len(r[0])) for r in rows])
        labels = torch.tensor([r[1] + [-100] * (width - len(r[1])) for r in rows])
        kinds = torch.tensor([r[2] + [0] * (width - len(r[2])) for r in rows])
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / 100)
        out = model(input_ids=ids, labels=labels)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        with torch.no_grad():
            right = out.logits[:, :-1].argmax(-1) == labels[:, 1:]
            for j, kind in enumerate((FIRST, SECOND)):
                scored = kinds[:, 1:] == kind
                hits[j] += int((right & scored).sum())
                counts[j] += int(scored.sum())
        if time.perf_counter() - last > 30:
            d1, d2 = (h / max(1, c) for h, c in zip(hits, counts, strict=True))
            minutes = (time.perf_counter() - start) / 60
            print(f"{minutes:4.1f} min step {step} loss {out.loss.item():.3f} d1 {d1:.3f} d2 {d2:.3f}", flush=True)
            hits, counts, last = [0, 0], [0, 0], time.perf_counter()


if __name__ == "__main__":
    main()
