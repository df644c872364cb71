"""Invariants every method must keep, and Kara's behaviour on crafted inputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvllm import CompressionConfig
from kvllm.methods import Window, available, build, method_class
from kvllm.methods.pyramidkv import pyramid_budgets


@st.composite
def windows(draw: st.DrawFn) -> tuple[Window, int]:
    b, layers = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    hkv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    d = draw(st.sampled_from([4, 8]))
    n = draw(st.integers(2, 40))
    c = draw(st.integers(1, n))
    nq = draw(st.integers(1, n))
    budget = draw(st.integers(1, c))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q = torch.randn(b, layers, hkv * group, nq, d, generator=gen)
    k = torch.randn(b, layers, hkv, n, d, generator=gen)
    return Window(q, k, c), budget


@pytest.mark.parametrize("name", available())
@settings(max_examples=40, deadline=None)
@given(case=windows())
def test_selection_invariants(name: str, case: tuple[Window, int]) -> None:
    window, budget = case
    selection = build(CompressionConfig(method=name)).select(window, budget)
    idx, c = selection.indices, window.n_compress
    b, layers, hkv = window.keys.shape[:3]
    assert idx.dtype == torch.long and idx.shape[:3] == (b, layers, hkv)
    valid = selection.valid if selection.valid is not None else torch.ones_like(idx, dtype=torch.bool)
    assert ((idx >= 0) & (idx < c)).all()
    for row, row_valid in zip(idx.reshape(-1, idx.shape[-1]), valid.reshape(-1, idx.shape[-1]), strict=True):
        kept = row[row_valid]
        count = int(row_valid.sum())
        # Valid entries first, strictly increasing (sorted and unique).
        assert row_valid[:count].all()
        assert (kept[1:] > kept[:-1]).all()
    counts = selection.counts
    if method_class(name).uniform:
        assert selection.valid is None
        assert idx.shape[-1] == budget
    else:
        # Budgets move between layers or heads, but the mean stays m, and no row keeps
        # more than the area holds.
        assert (counts.sum((-1, -2)) == layers * hkv * budget).all()
        assert (counts <= c).all() and (counts >= 0).all()


def test_pyramid_budgets_decrease_and_average_to_budget() -> None:
    per_layer = pyramid_budgets(8, 26, 20.0, 128)
    assert per_layer.sum() == 8 * 26
    assert (per_layer[1:] <= per_layer[:-1]).all()
    assert per_layer[0] > 26 > per_layer[-1]


def _lookahead_window() -> Window:
    """Queries of tokens 0-2 point at key 3; the later queries point elsewhere.

    Causally, nothing before token 3 can see key 3, so its column mass is small and
    key 0 (seen by every query) wins. Bidirectionally, key 3 collects the attention of
    tokens 0-2 and wins.
    """
    n, d = 8, 4
    e1, e2 = torch.eye(d)[0] * 8, torch.eye(d)[1] * 8
    k = torch.zeros(n, d)
    k[3] = e1
    q = torch.stack([e1 if j < 3 else e2 for j in range(n)])
    return Window(q.view(1, 1, 1, n, d), k.view(1, 1, 1, n, d), n_compress=6)


def test_bidirectional_and_causal_scoring_pick_different_tokens() -> None:
    window = _lookahead_window()
    cfg = CompressionConfig(method="kara")
    bidirectional = build(cfg).select(window, 1).indices.flatten().tolist()
    causal = build(cfg.replace(method="kara-causal")).select(window, 1).indices.flatten().tolist()
    assert bidirectional == [3]
    assert causal == [0]
    assert build(cfg.replace(method="kara-topk")).select(window, 1).indices.flatten().tolist() == [3]


def test_kara_keeps_gqa_groups_per_kv_head() -> None:
    """Each KV head is scored by its own group of query heads only."""
    base = _lookahead_window()
    n, d = base.keys.shape[-2:]
    # KV head 1 holds a key at token 1 that only its own group (query heads 2-3) seeks.
    other_keys = torch.zeros(1, 1, 1, n, d)
    other_keys[..., 1, :] = torch.eye(d)[2] * 8
    other_q = (torch.eye(d)[2] * 8).expand(1, 1, 1, n, d)
    q = base.queries
    queries = torch.cat([q, q, other_q, other_q], dim=2)
    keys = torch.cat([base.keys, other_keys], dim=2)
    sel = build(CompressionConfig(method="kara-topk")).select(Window(queries, keys, 6), 1)
    assert sel.indices.flatten().tolist() == [3, 1]
