"""Where Kara and the oracle disagree: kept tokens by kind, per layer and KV head.

Teacher-forces Full KV's completions of development-seed trace problems through a
compressing cache whose selector runs both Kara (whose choice is applied, so the
trajectory is Kara's) and the oracle on every window, and tallies what each keeps by
token role (the assigned name, the statement, the operand copies, the result, operators,
newlines). Development seeds only: what this finds may shape a method, so it must never
see the reported test seeds.

    python tools/oracle_gap.py --n 16 --steps 48 --retention 0.2
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvllm import CompressionConfig
from kvllm.assets import model_path
from kvllm.eval.oracle import Oracle, full_attention
from kvllm.eval.problems import task_problems
from kvllm.eval.tasks import Difficulty
from kvllm.hf import generate
from kvllm.methods import Method, Selection, Window, build

DEV_FIRST_SEED = 100_000


KINDS = ("lhs", "statement", "copy-name", "copy-digit", "result-name", "result-digit", "operator", "newline")


def kinds_of(pieces: list[str]) -> list[str]:
    """A role per token of a chain-of-thought line ``ca = bi + zi = bi21 + zi69 = ca90``:
    the assigned name (lhs), the statement's names, the operand copies' names and digits,
    the result's name and digits, operators, newlines; "other" elsewhere."""
    out, seg = [], 0
    for piece in pieces:
        p = piece.strip()
        if piece == "\n":
            out.append("newline")
            seg = 0
        elif p in ("+", "-", "="):
            seg += p == "="
            out.append("operator")
        elif p.isdigit():
            out.append({2: "copy-digit", 3: "result-digit"}.get(seg, "other"))
        elif p.isalpha():
            out.append({0: "lhs", 1: "statement", 2: "copy-name", 3: "result-name"}.get(seg, "other"))
        else:
            out.append("other")
    return out


class Both(Method):
    """Applies Kara's selection; records Kara's and the oracle's per (layer, KV head)."""

    name = "kara+oracle"

    def __init__(self, kara: Method, oracle: Oracle, kinds: list[list[str]]) -> None:
        super().__init__(Method.Params())
        self.kara, self.oracle, self.kinds = kara, oracle, kinds
        self.kept: dict[tuple[str, int, int], Counter] = defaultdict(Counter)
        self.overlap: dict[tuple[int, int], list[float]] = defaultdict(list)

    def select(self, window: Window, budget: int) -> Selection:
        mine = self.kara.select(window, budget).indices
        best = self.oracle.select(window, budget).indices
        for b, start in enumerate(window.positions):
            seq = self.kinds[b]
            for layer in range(mine.shape[1]):
                for head in range(mine.shape[2]):
                    k, o = set(mine[b, layer, head].tolist()), set(best[b, layer, head].tolist())
                    self.overlap[(layer, head)].append(len(k & o) / len(k | o))
                    for who, kept in (("kara", k), ("oracle", o)):
                        for i in kept:
                            if start + i < len(seq):
                                self.kept[(who, layer, head)][seq[start + i]] += 1
        return Selection(mine)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--retention", type=float, default=0.2)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--buffer", type=int, default=32)
    a = p.parse_args()
    tok = AutoTokenizer.from_pretrained(model_path())
    model = AutoModelForCausalLM.from_pretrained(model_path(), dtype=torch.float32).eval()
    problems = task_problems("trace", a.n, Difficulty(constants=8, steps=a.steps), tok, first_seed=DEV_FIRST_SEED)
    prompts = [q.prompt for q in problems]
    full = generate(model, tok, prompts, None, max(q.max_new_tokens for q in problems))
    seqs = [tok(q)["input_ids"] + ids for q, ids in zip(prompts, full.token_ids, strict=True)]
    kinds = [kinds_of([tok.decode([i]) for i in s]) for s in seqs]
    cfg = CompressionConfig(retention=a.retention, window=a.window, buffer=a.buffer)
    both = Both(build(cfg), Oracle(full_attention(model, seqs)), kinds)
    generate(model, tok, prompts, cfg, 1, forced=full.token_ids, method=both)
    all_kinds = (*KINDS, "other")
    print(f"share of kept tokens by kind, r={a.retention}, W={a.window}, b={a.buffer}, {a.n} dev problems")
    print("| layer | head | who | " + " | ".join(all_kinds) + " | Jaccard(kara, oracle) |")
    print("| ---: | ---: | --- |" + " ---: |" * (len(all_kinds) + 1))
    layers = sorted({(layer, head) for _, layer, head in both.kept})
    for layer, head in layers:
        jac = sum(both.overlap[(layer, head)]) / len(both.overlap[(layer, head)])
        for who in ("oracle", "kara"):
            c = both.kept[(who, layer, head)]
            total = sum(c.values())
            shares = " | ".join(f"{c[k] / total:.2f}" for k in all_kinds)
            print(f"| {layer} | {head} | {who} | {shares} | {jac:.2f} |")


if __name__ == "__main__":
    main()
