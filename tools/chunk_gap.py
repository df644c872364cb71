"""Why plain top-m keeps more than Token2Chunk on `reason`: what the chunks' fill keeps.

Token2Chunk (docs/design.md) spends K = round(rho m) of a window's budget m on its
top-scoring tokens (the endpoints) and the other m - K on whole gaps between endpoints
(then top-ups); plain top-m (`kara-topk`) spends them on the next-ranked tokens. This
forces the tasks' reference chains of development-seed `reason` problems through
`kara-reasoner-6l` with Kara's selection applied (W=128, b=32, r=0.2) and, on every
window, per (layer, KV head), compares the m - K tokens each spends past the endpoints:

- how many the oracle also keeps (the window's keys that later queries read most);
- what they are: value digits, names, operators and separators, spaces, newlines.

    python tools/chunk_gap.py [N] [OUT.json]

OUT.json, when given, gets the tallies (docs/results/data/accuracy/chunk-gap.json is rendered
in docs/results/accuracy.md).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvllm.assets import model_path
from kvllm.cli.evaluate import family_difficulty
from kvllm.cli.options import trained_op
from kvllm.config import CompressionConfig
from kvllm.eval.grid import reference_ids
from kvllm.eval.oracle import Oracle, full_attention
from kvllm.eval.problems import task_problems
from kvllm.hf import generate
from kvllm.methods import Method, Selection, Window, build
from kvllm.methods.scoring import attention_scores

DEV_SEEDS = 100_000  # the first development seed (kvllm eval --dev-seeds)
KINDS = ("digit", "name", "operator", "space", "newline")


def kind(piece: str) -> str:
    """A token's kind, from its text."""
    if piece == "\n" or piece.endswith("\n"):
        return "newline"
    text = piece.strip()
    if not text:
        return "space"
    if text.isdigit():
        return "digit"
    return "name" if text.isalpha() else "operator"


class Compare(Method):
    """Applies Kara's selection; tallies the tokens Kara and top-m keep past the endpoints."""

    name = "kara-vs-topm"

    def __init__(self, kara: Method, oracle: Oracle, kinds: list[list[str]]) -> None:
        super().__init__(kara.params)
        self.kara, self.oracle, self.kinds = kara, oracle, kinds
        self.tally: dict[str, Counter] = {who: Counter() for who in ("endpoints", "kara", "top-m")}

    def select(self, window: Window, budget: int) -> Selection:
        c = window.n_compress
        m = min(budget, c)
        k = min(m, max(1, round(self.kara.params.rho * m)))
        mine = self.kara.select(window, budget).indices
        order = attention_scores(window, causal=False)[..., :c].argsort(-1, descending=True)
        best = self.oracle.select(window, budget).indices
        for b, start in enumerate(window.positions):
            for layer in range(mine.shape[1]):
                for head in range(mine.shape[2]):
                    ends = set(order[b, layer, head, :k].tolist())
                    sets = {
                        "endpoints": ends,
                        "kara": set(mine[b, layer, head].tolist()) - ends,
                        "top-m": set(order[b, layer, head, k:m].tolist()),
                    }
                    read = set(best[b, layer, head].tolist())
                    for who, kept in sets.items():
                        for i in kept:
                            self.tally[who]["tokens"] += 1
                            self.tally[who]["oracle"] += i in read
                            self.tally[who][self.kinds[b][start + i]] += 1
        return Selection(mine)


def main(n: int, out: Path | None = None) -> None:
    path = model_path("kara-reasoner-6l")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    difficulty = family_difficulty("reason", None, None, 0.5, trained_op(path))
    problems = task_problems("reason", n, difficulty, tok, first_seed=DEV_SEEDS)
    prompts = [p.prompt for p in problems]
    forced = reference_ids(tok, problems)
    seqs = [tok(p)["input_ids"] + f for p, f in zip(prompts, forced, strict=True)]
    kinds = [[kind(tok.decode([i])) for i in s] for s in seqs]
    config = CompressionConfig(method="kara", retention=0.2)
    compare = Compare(build(config), Oracle(full_attention(model, seqs)), kinds)
    generate(model, tok, prompts, config, 1, forced=forced, method=compare)
    print(f"r=0.2, W=128, b=32, {n} development problems, reference chains forced")
    print("| kept | tokens | oracle keeps them | " + " | ".join(KINDS) + " |")
    print("| --- | ---: | ---: |" + " ---: |" * len(KINDS))
    for who, c in compare.tally.items():
        shares = " | ".join(f"{c[k] / c['tokens']:.2f}" for k in KINDS)
        print(f"| {who} | {c['tokens']} | {c['oracle'] / c['tokens']:.3f} | {shares} |")
    if out is not None:
        record = {"n": n, "retention": 0.2, "window": 128, "buffer": 32, "kinds": KINDS, "tally": compare.tally}
        out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 16, Path(sys.argv[2]) if len(sys.argv) > 2 else None)
