"""What a family's chains of thought ask of a KV cache: length, reuse distances, density.

For a set of tasks and a tokenizer, from the reference completions (what a perfect model
writes): how many tokens a chain of thought has, how far back each read reaches (the
reuse-distance histogram, in tokens, per source), and the **information density**, the
share of chain-of-thought tokens that some later read needs (the ``name`` + two digits
of each result read again, by a later line or by the answer). docs/guide/evaluation.md compares
``reason`` with ``trace`` on these.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvllm.eval import lookup
from kvllm.eval.tasks import END_THINK, THINK, Task

#: Reuse-distance buckets in tokens: [edge_i, edge_i+1).
EDGES: tuple[float, ...] = (0, 32, 64, 128, 256, 512, 1024, 2048, float("inf"))


def bucket_label(i: int) -> str:
    lo, hi = EDGES[i], EDGES[i + 1]
    return f">={int(lo)}" if hi == float("inf") else f"{int(lo)}-{int(hi) - 1}"


@dataclass
class ChainStats:
    """Totals over tasks; shares come from :meth:`summary`."""

    tasks: int = 0
    cot_tokens: list[int] = field(default_factory=list)
    needed_tokens: int = 0
    reads: dict[str, list[int]] = field(default_factory=lambda: {"prompt": [], "generated": []})

    def histogram(self, source: str) -> list[float]:
        """Share of ``source``'s reads in each :data:`EDGES` bucket."""
        distances = self.reads[source]
        counts = [sum(EDGES[i] <= d < EDGES[i + 1] for d in distances) for i in range(len(EDGES) - 1)]
        return [c / len(distances) if distances else 0.0 for c in counts]

    def summary(self) -> dict[str, float]:
        total = sum(self.cot_tokens)
        n_reads = sum(len(v) for v in self.reads.values())
        return {
            "tasks": self.tasks,
            "cot_tokens_mean": total / self.tasks,
            "cot_tokens_min": min(self.cot_tokens),
            "cot_tokens_max": max(self.cot_tokens),
            "reads_per_task": n_reads / self.tasks,
            "prompt_read_share": len(self.reads["prompt"]) / n_reads,
            "density": self.needed_tokens / total,
        }


def chain_stats(tokenizer, tasks: Sequence[Task]) -> ChainStats:
    """:class:`ChainStats` of the tasks' reference completions under ``tokenizer``."""
    stats = ChainStats()
    for task in tasks:
        text, owner = lookup.char_to_token(tokenizer, tokenizer(task.target)["input_ids"])
        prompt_ids = tokenizer(task.prompt)["input_ids"]
        _, prompt_owner = lookup.char_to_token(tokenizer, prompt_ids)
        n_prompt = len(prompt_ids)
        reads = lookup.reads(task.prompt, text, owner, prompt_owner, n_prompt)
        # The token of each generated read's source digits: the writes that are needed.
        sources = {n_prompt + owner[r.start] - r.distance for r in reads if r.source == "generated"}
        asked = lookup.answer_source(task.prompt, text)
        needed = {
            token
            for _, name_start, digits_start in lookup.results(text)
            if n_prompt + owner[digits_start] in sources or digits_start == asked
            for token in range(owner[name_start], owner[digits_start + 1] + 1)  # the name and two digits
        }
        body_start = text.index(THINK) + len(THINK) if THINK in text else 0
        body = text[body_start : text.index(END_THINK)]
        first, last = owner[body_start], owner[body_start + len(body) - 1]
        stats.tasks += 1
        stats.cot_tokens.append(last - first + 1)
        stats.needed_tokens += len(needed)
        for r in reads:
            stats.reads[r.source].append(r.distance)
    return stats
