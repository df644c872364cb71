"""The oracle selector: keeps everything at r=1 and what later queries attend to."""

from __future__ import annotations

import pytest
import torch

from kvllm.eval.oracle import Oracle
from kvllm.methods import Window


def _window(t: int, start: int, span: int, c: int) -> Window:
    g = torch.Generator().manual_seed(0)
    return Window(
        queries=torch.randn(1, 2, 2, span, 8, generator=g),
        keys=torch.randn(1, 2, 1, span, 8, generator=g),
        n_compress=c,
        positions=(start,),
    )


def test_oracle_keeps_what_later_queries_attend_to() -> None:
    t, start, span, c = 64, 10, 20, 16
    attention = torch.zeros(2, 1, t, t)
    # Queries after the span look only at keys 13 and 21 (offsets 3 and 11 of the area);
    # queries inside the span look at key 12, which the oracle must ignore.
    attention[:, :, start + span :, 13] = 1.0
    attention[:, :, start + span :, 21] = 0.5
    attention[:, :, start : start + span, 12] = 5.0
    window = _window(t, start, span, c)
    kept = Oracle([attention]).select(window, 2).indices
    assert kept.flatten().tolist() == [3, 11, 3, 11]


@pytest.mark.parametrize("budget", [1, 5, 12])
def test_oracle_keeps_the_top_keys_by_later_attention_in_every_row(budget: int) -> None:
    """Random Full-KV attention, two sequences at different positions, 2 layers x 2 KV
    heads: each row keeps the top-m of ``sum_{j >= start + span} A[j, start + i]``,
    summed here query by query, whatever the window's own queries and keys."""
    span, c, starts, lengths = 20, 16, (5, 12), (60, 50)
    g = torch.Generator().manual_seed(budget)
    attention = [torch.rand(2, 2, t, t, generator=g) for t in lengths]
    expected = torch.zeros(2, 2, 2, budget, dtype=torch.long)
    for b, (att, start, t) in enumerate(zip(attention, starts, lengths, strict=True)):
        for layer in range(2):
            for head in range(2):
                score = [sum(float(att[layer, head, j, start + i]) for j in range(start + span, t)) for i in range(c)]
                best = sorted(range(c), key=lambda i, score=score: -score[i])[:budget]
                expected[b, layer, head] = torch.tensor(sorted(best))
    for seed in (0, 1):  # the window's tensors do not matter to the oracle
        g = torch.Generator().manual_seed(seed)
        window = Window(
            queries=torch.randn(2, 2, 4, span, 8, generator=g),
            keys=torch.randn(2, 2, 2, span, 8, generator=g),
            n_compress=c,
            positions=starts,
        )
        assert torch.equal(Oracle(attention).select(window, budget).indices, expected)


def test_oracle_at_full_budget_keeps_every_key() -> None:
    t, start, span, c = 40, 4, 20, 16
    window = _window(t, start, span, c)
    kept = Oracle([torch.rand(2, 1, t, t)]).select(window, c).indices
    assert (kept == torch.arange(c)).all()


def test_oracle_needs_positions() -> None:
    window = _window(40, 0, 20, 16)
    with pytest.raises(ValueError, match="positions"):
        Oracle([torch.rand(2, 1, 40, 40)]).select(Window(window.queries, window.keys, 16), 4)
