"""The oracle selector: keeps everything at r=1 and what later queries attend to."""

from __future__ import annotations

import pytest
import torch

from kvllm.config import CompressionConfig
from kvllm.eval.oracle import Oracle
from kvllm.methods import Window, build


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
    # Random keeps them both in few draws.
    cfg = CompressionConfig(method="random")
    hits = 0
    for seed in range(50):
        w = Window(window.queries, window.keys, c, seeds=(seed,))
        hits += set(build(cfg).select(w, 2).indices[0, 0, 0].tolist()) == {3, 11}
    assert hits < 10


def test_oracle_at_full_budget_keeps_every_key() -> None:
    t, start, span, c = 40, 4, 20, 16
    window = _window(t, start, span, c)
    kept = Oracle([torch.rand(2, 1, t, t)]).select(window, c).indices
    assert (kept == torch.arange(c)).all()


def test_oracle_needs_positions() -> None:
    window = _window(40, 0, 20, 16)
    with pytest.raises(ValueError, match="positions"):
        Oracle([torch.rand(2, 1, 40, 40)]).select(Window(window.queries, window.keys, 16), 4)
