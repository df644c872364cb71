"""Lazy two-stage retention: the second cut against a from-the-spec computation, and
the kept indices' invariants on random rounds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvllm import CompressionConfig
from kvllm.methods import Window, build
from kvllm.methods.lazy import LazyRound, lazy_select
from kvllm.methods.rope import Rope

D = 8


def lazy_window(candidates: int, window: int, buffer: int, seed: int = 0, position: int = 40) -> Window:
    """2 sequences x 2 layers x 2 KV heads (GQA group 2): the candidates' keys, then the
    new window's span, with the queries of the span's W + b tokens."""
    gen = torch.Generator().manual_seed(seed)
    n = candidates + window + buffer
    q = torch.randn(2, 2, 4, window + buffer, D, generator=gen)
    k = torch.randn(2, 2, 2, n, D, generator=gen)
    v = torch.randn(2, 2, 2, n, D, generator=gen)
    rope = Rope.from_inv_freq(1.0 / 10000 ** (torch.arange(0, D, 2) / D), position + n + 10)
    return Window(q, k, candidates + window, (1, 2), (position, position + 3), v, rope)


def later_reads(window: Window, n: int) -> torch.Tensor:
    """The spec: per KV head, the softmax attention every query pays each candidate,
    summed over its query-head group and the queries, with no causal mask."""
    q, k = window.queries, window.keys
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    attn = torch.softmax(q @ k.transpose(-1, -2) / D**0.5, dim=-1)  # [B, L, Hq, Nq, N]
    per_head = attn.sum(-2)[..., :n]
    return per_head.unflatten(2, (-1, group)).sum(3)


def z(x: torch.Tensor) -> torch.Tensor:
    return (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True)


@pytest.mark.parametrize("keep", [0.0, 0.5, 1.0])
def test_the_cut_ranks_the_candidates_by_later_reads_mixed_with_their_first_score(keep: float) -> None:
    n, m, first = 12, 4, 8
    window = lazy_window(n, 32, 8)
    carried = torch.randn(2, 2, 2, n, generator=torch.Generator().manual_seed(5))
    kara = build(CompressionConfig(method="kara-topk", window=32, buffer=8))
    selection, carry = lazy_select(kara, window, LazyRound(n, m, first, keep), carried)
    mixed = (1 - keep) * z(later_reads(window, n)) + keep * z(carried)
    expected_cut = mixed.topk(m, dim=-1).indices.sort(-1).values
    assert torch.equal(selection.indices[..., :m], expected_cut)
    # The new window: the method's own choice on the span without the candidates.
    keys, values = window.keys[..., n:, :], window.values[..., n:, :]
    new = Window(window.queries, keys, 32, window.seeds, (40 + n, 43 + n), values, window.rope)
    own = kara.select(new, first).indices
    assert torch.equal(selection.indices[..., m:], own + n)
    if keep > 0:
        torch.testing.assert_close(carry, z(kara.scores(new)).gather(-1, own))
    else:
        assert carry.shape[-1] == 0


def test_a_first_round_is_the_methods_selection_at_the_first_stage_budget() -> None:
    window = lazy_window(0, 32, 8, seed=3)
    kara = build(CompressionConfig(window=32, buffer=8))
    selection, carry = lazy_select(kara, window, LazyRound(0, 6, 12, 0.5), None)
    assert torch.equal(selection.indices, kara.select(window, 12).indices)
    assert carry.shape == (2, 2, 2, 12)


def test_the_new_window_sees_its_own_positions() -> None:
    """A method that undoes RoPE reads the new window's keys at their own positions: the
    candidates' count is added to the span's first position."""
    n = 10
    window = lazy_window(n, 32, 8, seed=4)
    seen: list[tuple[int, ...]] = []

    class Spy:
        name = "spy"

        def select(self, w: Window, budget: int):
            seen.append(w.positions)
            assert w.keys.shape[3] == 40 and w.n_compress == 32
            return build(CompressionConfig(method="kara-topk", window=32, buffer=8)).select(w, budget)

    lazy_select(Spy(), window, LazyRound(n, 4, 8, 0.0), None)
    assert seen == [(40 + n, 43 + n)]


def test_a_method_with_varying_counts_is_refused() -> None:
    pyramid = build(CompressionConfig(method="pyramidkv", window=32, buffer=8))
    with pytest.raises(ValueError, match="uniform method"):
        lazy_select(pyramid, lazy_window(0, 32, 8), LazyRound(0, 6, 12, 0.0), None)


@settings(max_examples=40, deadline=None)
@given(
    again=st.booleans(),
    m=st.integers(1, 8),
    factor=st.integers(1, 4),
    keep=st.sampled_from([0.0, 0.3, 1.0]),
    seed=st.integers(0, 2**16),
    method=st.sampled_from(["kara", "kara-topk", "kara-late"]),
)
def test_kept_indices_are_sorted_unique_and_split_at_the_candidates(
    again: bool, m: int, factor: int, keep: float, seed: int, method: str
) -> None:
    first = min(32, factor * m)
    n = first if again else 0  # a round after the first cuts the last one's candidates
    chosen = build(CompressionConfig(method=method, window=32, buffer=8))
    window = lazy_window(n, 32, 8, seed=seed)
    carried = torch.randn(2, 2, 2, n, generator=torch.Generator().manual_seed(seed)) if n else None
    selection, carry = lazy_select(chosen, window, LazyRound(n, m, first, keep), carried)
    idx = selection.indices
    kept = (m if n else 0) + first
    assert idx.shape == (2, 2, 2, kept)
    assert (idx[..., 1:] > idx[..., :-1]).all(), "ascending and unique"
    assert (idx[..., : kept - first] < n).all() and (idx[..., kept - first :] >= n).all()
    assert (idx < n + 32).all()
    assert carry.shape[-1] == (first if keep > 0 else 0)
