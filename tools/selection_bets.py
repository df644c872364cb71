"""Development-seed check of two selection bets: lazy two-stage retention and
merging dropped values into kept ones, around any registered method.

- **lazy (F)**: the registered lazy retention (:mod:`kvllm.methods.lazy`,
  ``CompressionConfig.lazy``): a round keeps F times the budget of its window, and the
  next round's queries cut those candidates to the budget.
- **merge (TAU)**: before a round compacts, each dropped key's value is folded into the
  kept key of the same region, layer and KV head its key is most similar to (cosine),
  weighted by that similarity when it is above TAU, as in the merging methods (D2O,
  CaM): ``v_i <- (v_i + sum_j s_ij v_j) / (1 + sum_j s_ij)``. It changes what a round
  writes, not a window's score, so it runs here as a subclass of the reference
  backend's cache.

Each cell runs free on `reason` with `kara-reasoner-6l` (W=128, b=32, P=16) and prints
the statement grade (docs/guide/evaluation.md), the chains' length and the generated KV
held at the end.

    python tools/selection_bets.py [N] [R] [CELL,...] [FIRST_SEED] [OUT.jsonl]

A CELL is ``METHOD`` with modifiers: ``+lazyF`` (``CompressionConfig.lazy``), ``+keepA``
(its ``lazy_keep``: the second cut ranks by ``(1 - A) z(later) + A z(stage one's
score)``; 0 when not given) and ``+mergeTAU``; ``kara-retain`` reads the model's shipped
calibration file. FIRST_SEED defaults to the first development seed. Each cell prints
its pooled grade and its paired difference from the first cell's (a bootstrap over
problems); OUT.jsonl, when given, gets a row per problem and cell, and
completions.jsonl.gz beside it the completions' token ids.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib
import json
import statistics
import sys
from pathlib import Path
from unittest import mock

import torch
from torch import Tensor

from kvllm.assets import model_path
from kvllm.cli.evaluate import family_difficulty
from kvllm.cli.options import trained_op
from kvllm.config import CompressionConfig
from kvllm.eval.problems import task_problems
from kvllm.eval.statements import grade, program
from kvllm.eval.stats import paired_difference
from kvllm.hf import generate
from kvllm.hf.cache import CompressingCache
from kvllm.methods import Method, Selection, Window
from kvllm.policy import Region

DEV_SEEDS = 100_000  # the first development seed (kvllm eval --dev-seeds)
BATCH = 8
COMPLETION = ("cell", "retention", "uid", "token_ids")  # a stored completion's fields
CALIBRATION = "kvllm/assets/kara-reasoner-6l/calibration/kara-retain.safetensors"


@dataclasses.dataclass(frozen=True)
class Cell:
    """A registered method and what the round adds to it (the module's docstring)."""

    method: str
    lazy: int = 1  # stage one keeps lazy x budget; 1: a single stage
    merge: float | None = None  # fold dropped values with similarity above this; None: drop
    keep: float = 0.0  # stage two's weight on the stage-one score (lazy); 0: the later queries alone

    @property
    def label(self) -> str:
        """The cell as :meth:`parse` reads it."""
        mods = [f"lazy{self.lazy}"] if self.lazy > 1 else []
        mods += [f"keep{self.keep:g}"] if self.keep > 0 else []
        mods += [f"merge{self.merge:g}"] if self.merge is not None else []
        return "+".join([self.method, *mods])

    @classmethod
    def parse(cls, text: str) -> Cell:
        method, *mods = text.split("+")
        cell = cls(method)
        for mod in mods:
            if mod.startswith("lazy"):
                cell = dataclasses.replace(cell, lazy=int(mod[4:]))
            elif mod.startswith("merge"):
                cell = dataclasses.replace(cell, merge=float(mod[5:]))
            elif mod.startswith("keep"):
                cell = dataclasses.replace(cell, keep=float(mod[4:]))
            else:
                raise SystemExit(f"CELL modifier {mod!r} is invalid: must be lazyF, keepA or mergeTAU")
        if cell.lazy > 1 and cell.merge is not None:
            # Merging writes the area a method scores; a lazy round scores part of its area.
            raise SystemExit(f"CELL {text!r} is invalid: lazyF and mergeTAU do not combine")
        return cell


def merged_values(keys: Tensor, values: Tensor, kept: Tensor, tau: float) -> Tensor:
    """The kept keys' values ``[B, H, M, D]`` with every dropped value of the area folded in.

    ``keys``, ``values``: ``[B, H, C, D]``, the compressible area; ``kept``: ``[B, H, M]``.
    """
    b, h, c, d = keys.shape
    unit = torch.nn.functional.normalize(keys.float(), dim=-1)
    is_kept = torch.zeros(b, h, c, dtype=torch.bool, device=keys.device).scatter_(2, kept, True)
    kept_unit = unit.gather(2, kept[..., None].expand(-1, -1, -1, d))
    sim = unit @ kept_unit.transpose(-1, -2)  # [B, H, C, M]
    best, target = sim.max(-1)
    weight = torch.where(~is_kept & (best > tau), best, torch.zeros_like(best))
    v_kept = values.float().gather(2, kept[..., None].expand(-1, -1, -1, d))
    num = v_kept.scatter_add(2, target[..., None].expand(-1, -1, -1, d), weight[..., None] * values.float())
    den = torch.ones(b, h, kept.shape[-1], device=keys.device).scatter_add(2, target, weight)
    return (num / den[..., None]).to(values.dtype)


class Merging(Method):
    """A method's selection, with the dropped values of its area folded into the cache's
    kept slots before the round compacts them."""

    name = "merging"

    def __init__(self, inner: Method, cache: MergeCache) -> None:
        super().__init__(inner.params)
        self.inner, self.cache = inner, cache

    def select(self, window: Window, budget: int) -> Selection:
        selection = self.inner.select(window, budget)
        c, start = window.n_compress, self.cache.region_start
        for i, layer in enumerate(self.cache.layers):
            kept = selection.indices[:, i]
            values = merged_values(window.keys[:, i, :, :c], window.values[:, i, :, :c], kept, self.cache.tau)
            layer.values[:, :, start : start + c].scatter_(2, kept[..., None].expand_as(values), values)
        return selection


class MergeCache(CompressingCache):
    """The reference cache, its rounds merging with threshold :attr:`tau`."""

    tau = 0.5

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.region_start = 0
        self.method = Merging(self.method, self)

    def _compress(self, region: Region) -> None:
        self.region_start = region.start
        super()._compress(region)


def generate_cell(
    cell: Cell, model, tokenizer, prompts: list[str], config: CompressionConfig, max_new_tokens: int, **kw
):
    """:func:`kvllm.hf.generate` (``kw``: its keywords) of ``config`` with ``cell``'s changes:
    its lazy retention, and its cache swapped for a :class:`MergeCache` when it merges."""
    config = config.replace(lazy=cell.lazy, lazy_keep=cell.keep)
    if cell.merge is None:
        return generate(model, tokenizer, prompts, config, max_new_tokens, **kw)
    module = importlib.import_module("kvllm.hf.generate")
    with mock.patch.object(module, "CompressingCache", type("Cache", (MergeCache,), {"tau": cell.merge})):
        return generate(model, tokenizer, prompts, config, max_new_tokens, **kw)


def run_cell(cell: Cell, model, tokenizer, problems: list, retention: float) -> list[dict]:
    """One row per problem: its statement grade, chain length and KV held at the end."""
    params = {"calibration": CALIBRATION} if cell.method == "kara-retain" else {}
    config = CompressionConfig(method=cell.method, retention=retention, params=params)
    rows = []
    for lo in range(0, len(problems), BATCH):
        batch = problems[lo : lo + BATCH]
        cap = max(p.max_new_tokens for p in batch)
        out = generate_cell(cell, model, tokenizer, [p.prompt for p in batch], config, cap)
        for problem, text, ids, stats in zip(batch, out.texts, out.token_ids, out.stats, strict=True):
            g = grade(program(problem.prompt), text)
            rows.append(
                {
                    "cell": cell.label,
                    "retention": retention,
                    "uid": problem.uid,
                    "right": g.right,
                    "graded": g.statements + g.extra,
                    "program": len(program(problem.prompt)),
                    "stopped": g.stopped,
                    "tokens": len(ids),
                    "held_end": stats.held_end,
                    "token_ids": ids,
                }
            )
    return rows


def summary(rows: list[dict], first: list[dict]) -> str:
    """A cell's pooled grade, and its paired difference from the first cell's."""
    right, graded = [r["right"] for r in rows], [r["graded"] for r in rows]
    tokens, held = statistics.mean(r["tokens"] for r in rows), statistics.mean(r["held_end"] for r in rows)
    diff, lo, hi = paired_difference(right, graded, [r["right"] for r in first], [r["graded"] for r in first])
    return (
        f"{rows[0]['cell']} r={rows[0]['retention']:g}: statements right {sum(right) / sum(graded):.3f} "
        f"(of the program's {sum(right) / sum(r['program'] for r in rows):.3f}; {diff:+.3f} [{lo:+.3f}, {hi:+.3f}] "
        f"against {first[0]['cell']}), stopped {sum(r['stopped'] for r in rows)}/{len(rows)}, "
        f"chain {tokens:.0f} tokens, held {held:.3f}"
    )


def main(n: int, retention: float, cells: list[Cell], first_seed: int = DEV_SEEDS, out: Path | None = None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_path("kara-reasoner-6l")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    difficulty = family_difficulty("reason", None, None, 0.5, trained_op(path))
    problems = task_problems("reason", n, difficulty, tokenizer, first_seed=first_seed)
    first = None
    for cell in cells:
        rows = run_cell(cell, model, tokenizer, problems, retention)
        first = first or rows
        print(summary(rows, first), flush=True)
        if out is not None:  # the grades, and beside them the completions (gzipped, as kvllm eval's)
            with out.open("a") as f:
                f.writelines(json.dumps({k: v for k, v in r.items() if k != "token_ids"}) + "\n" for r in rows)
            with gzip.open(out.with_name("completions.jsonl.gz"), "at") as f:
                f.writelines(json.dumps({k: r[k] for k in COMPLETION}) + "\n" for r in rows)


if __name__ == "__main__":
    main(
        int(sys.argv[1]) if len(sys.argv) > 1 else 16,
        float(sys.argv[2]) if len(sys.argv) > 2 else 0.2,
        [Cell.parse(c) for c in sys.argv[3].split(",")] if len(sys.argv) > 3 else [Cell("kara"), Cell("kara", lazy=2)],
        int(sys.argv[4]) if len(sys.argv) > 4 else DEV_SEEDS,
        Path(sys.argv[5]) if len(sys.argv) > 5 else None,
    )
