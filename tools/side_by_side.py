"""The side-by-side tables (docs/results/accuracy.md) from tools/reference_grid.sh's folders.

    python tools/side_by_side.py [ROOT] [--mode reference-forced] > ROOT/side-by-side.md

ROOT holds a folder per model (``tiny``, ``6l``), each a ``kvllm eval --out`` folder.
Reads only stored results: no model, a few seconds (the bootstrap intervals).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvllm.eval.side_by_side import columns, equal_memory_table, markdown

# The grid's methods (tools/reference_grid.sh), Kara and its ablations first.
METHODS = (
    "kara",
    "kara-causal",
    "kara-topk",
    "kara-vpool",
    "snapkv",
    "pyramidkv",
    "adakv",
    "chunkkv",
    "h2o",
    "streamingllm",
    "rkv",
    "noncausal-attn",
    "oracle",
)
# Claim (b)'s baselines, then (c)'s ablations.
BASELINES = ("snapkv", "pyramidkv", "adakv", "chunkkv", "kara-causal", "kara-topk")
RETENTIONS = (0.05, 0.1, 0.2, 0.3, 0.5)
# The frontier's other W/b points (tools/reference_grid.sh's frontier stage): equal-memory
# tables of their own, since each W/b point holds a different memory at the same r.
FRONTIER = ((64, 16), (256, 64))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("root", type=Path, nargs="?", default=Path("docs/results/data/accuracy/reference-forced"))
    parser.add_argument("--mode", default="reference-forced")
    args = parser.parse_args()
    folders = {d.name: d for d in sorted(args.root.iterdir()) if (d / "results.jsonl").exists()}
    # The shipped model first, then the second.
    folders = dict(sorted(folders.items(), key=lambda kv: kv[0] != "tiny"))
    print(markdown(columns(folders, args.mode), METHODS, BASELINES, RETENTIONS), end="")
    for window, buffer in FRONTIER:
        cols = columns(folders, args.mode, window, buffer)
        if cols:
            print(f"\n**Kara minus each baseline at equal memory, W={window}, b={buffer} [95% paired CI]**\n")
            print("\n".join(equal_memory_table(cols, BASELINES, RETENTIONS)))


if __name__ == "__main__":
    main()
