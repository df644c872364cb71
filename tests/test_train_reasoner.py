"""tools/train_reasoner.py's training-only recall examples: a query reads a name's latest value."""

from __future__ import annotations

import random

from kvllm.eval.tasks import END_THINK, THINK
from tools.train_reasoner import _recall


def _parse(prompt: str, target: str) -> tuple[list[str], list[str]]:
    records = [line.strip() for line in prompt.split(THINK)[0].split("\n") if line.strip()]
    queries = [line.strip() for line in target.split(END_THINK)[0].split("\n") if line.strip()]
    return records, queries


def test_recall_without_rewrites_is_unchanged_and_has_distinct_names() -> None:
    # rewrites=0 draws nothing extra: earlier stages' commands reproduce their examples.
    assert _recall(random.Random(3), 8, 8) == _recall(random.Random(3), 8, 8, 0.0)
    records, queries = _parse(*_recall(random.Random(3), 8, 8))
    assert len({r[:-2] for r in records}) == len(records) == 8
    assert all(q in records for q in queries)


def test_recall_with_rewrites_reads_the_latest_value() -> None:
    rewritten = 0
    for seed in range(50):
        records, queries = _parse(*_recall(random.Random(seed), 10, 20, 0.5))
        latest = {r[:-2]: r for r in records}
        rewritten += len(records) - len(latest)
        assert len(records) == 10 and len(queries) == 20
        assert all(q == latest[q[:-2]] for q in queries)
    # About half of the 9 records after each first rewrite a name; a broken draw gives none.
    assert 150 < rewritten < 300
