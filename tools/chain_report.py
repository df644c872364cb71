"""What each task family's chains of thought ask of a KV cache (docs/guide/evaluation.md, "The reason family").

Per family, over the reference completions of ``--n`` development-range seeds: chain
length in tokens, reads per chain, the share of reads from the prompt, the information
density (share of chain-of-thought tokens a later read needs) and the reuse-distance
histogram of generated and prompt reads (:mod:`kvllm.eval.chains`). Prints markdown.

Usage::

    python tools/chain_report.py                      # the shipped model's tokenizer
    python tools/chain_report.py --build-tokenizer    # the tokenizer train_reasoner.py builds
                                                      # for --families of all four families
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from transformers import AutoTokenizer

from kvllm.assets import model_path
from kvllm.eval.chains import EDGES, bucket_label, chain_stats
from kvllm.eval.tasks import FAMILIES, REASON_DIFFICULTY, Difficulty, make_task

# The development range of `kvllm eval --split dev`: these seeds score no method.
FIRST_SEED = 100_000
DIFFICULTIES = {"trace": Difficulty(steps=48), "reason": REASON_DIFFICULTY}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", type=Path, default=None, help="a tokenizer directory; default: the shipped model's")
    p.add_argument("--build-tokenizer", action="store_true", help="build train_reasoner.py's over all families")
    p.add_argument("--n", type=int, default=64)
    args = p.parse_args()
    if args.build_tokenizer:
        sys.path.insert(0, str(Path(__file__).parent))
        from train_reasoner import build_tokenizer

        tokenizer, label = build_tokenizer(512, 0, FAMILIES), "train_reasoner.build_tokenizer(512, 0, FAMILIES)"
    else:
        path = args.tokenizer or model_path()
        tokenizer, label = AutoTokenizer.from_pretrained(path), str(path)
    seeds = range(FIRST_SEED, FIRST_SEED + args.n)
    print(f"Tokenizer: {label}; {args.n} seeds from {FIRST_SEED}.\n")
    print("| family | difficulty | CoT tokens mean [min-max] | reads / chain | from the prompt | density |")
    print("| --- | --- | --- | --- | --- | --- |")
    stats = {}
    for family, d in DIFFICULTIES.items():
        stats[family] = s = chain_stats(tokenizer, [make_task(family, seed, d) for seed in seeds])
        m = s.summary()
        print(
            f"| {family} | {d.constants} constants, {d.steps} steps | {m['cot_tokens_mean']:.0f} "
            f"[{m['cot_tokens_min']}-{m['cot_tokens_max']}] | {m['reads_per_task']:.0f} | "
            f"{m['prompt_read_share']:.2f} | {m['density']:.3f} |"
        )
    labels = [bucket_label(i) for i in range(len(EDGES) - 1)]
    print("\nReuse distance in tokens, share of reads per bucket:\n")
    print("| family, source | " + " | ".join(labels) + " |")
    print("| --- |" + " --- |" * len(labels))
    for family, s in stats.items():
        for source in ("generated", "prompt"):
            shares = " | ".join(f"{x:.3f}" for x in s.histogram(source))
            print(f"| {family}, {source} | {shares} |")


if __name__ == "__main__":
    main()
