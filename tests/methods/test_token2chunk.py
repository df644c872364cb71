from __future__ import annotations

import itertools
import time

import numpy as np
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvllm.methods.token2chunk import token2chunk


def _scores(c: int, strong: dict[int, float]) -> torch.Tensor:
    s = torch.arange(c, dtype=torch.float32) * 1e-3  # distinct weak background
    for i, v in strong.items():
        s[i] = v
    return s


def test_fills_short_gap_between_strong_candidates_instead_of_isolated_token() -> None:
    # m = 4 -> K = 2 candidates {5, 8}; the gap {6, 7} fits the remaining budget.
    # Plain top-4 would keep the isolated third-best token 15 instead.
    s = _scores(20, {5: 10.0, 8: 9.0, 15: 8.0})
    kept = token2chunk(s, budget=4, rho=0.5, beta=1.0, max_gap=16).tolist()
    assert kept == [5, 6, 7, 8]
    assert 15 in s.topk(4).indices.tolist()


def test_budget_spent_exactly_after_partial_fill() -> None:
    # m = 6 -> K = 3 candidates {2, 4, 12}. Gap {3} (sigma high) is filled; gap 5..11
    # (7 tokens) exceeds the 2 slots left, so the best two remaining tokens are added.
    s = _scores(16, {2: 5.0, 4: 4.0, 12: 3.0, 14: 1.0, 9: 0.5})
    kept = token2chunk(s, budget=6, rho=0.5, beta=1.0, max_gap=16).tolist()
    assert kept == [2, 3, 4, 9, 12, 14]


def test_gap_fill_spends_whole_budget() -> None:
    s = _scores(12, {1: 5.0, 4: 4.0})
    kept = token2chunk(s, budget=4, rho=0.5, beta=1.0, max_gap=16).tolist()
    assert kept == [1, 2, 3, 4]


def test_gaps_longer_than_max_gap_are_not_filled() -> None:
    s = _scores(12, {1: 5.0, 4: 4.0})
    kept = token2chunk(s, budget=4, rho=0.5, beta=1.0, max_gap=1).tolist()
    assert kept == [1, 4, 10, 11]


def test_denser_chunk_wins_when_budget_allows_one() -> None:
    # Candidates {0, 3, 10}: gaps of 2 and 6 tokens; only one fits in m - K = 2 + ...
    s = _scores(16, {0: 5.0, 3: 5.0, 10: 5.0})
    kept = token2chunk(s, budget=6, rho=0.5, beta=1.0, max_gap=16).tolist()
    assert {0, 1, 2, 3, 10} <= set(kept) and len(kept) == 6


@st.composite
def random_rows(draw: st.DrawFn) -> tuple[torch.Tensor, int, float, float, int]:
    """Uniform scores ``[rows, C]`` with a budget and knobs across their ranges:
    ``(scores, m, rho, beta, max_gap)``."""
    c, rows = draw(st.integers(1, 64)), draw(st.integers(1, 4))
    m = draw(st.integers(1, c))
    rho = draw(st.floats(0.05, 1.0))
    beta = draw(st.floats(0.0, 3.0))
    max_gap = draw(st.integers(0, 20))
    seed = draw(st.integers(0, 2**16))
    return torch.rand(rows, c, generator=torch.Generator().manual_seed(seed)), m, rho, beta, max_gap


@settings(max_examples=200, deadline=None)
@given(case=random_rows())
def test_exactly_m_sorted_unique_and_candidates_kept(case: tuple[torch.Tensor, int, float, float, int]) -> None:
    s, m, rho, beta, max_gap = case
    rows, c = s.shape
    kept = token2chunk(s, m, rho, beta, max_gap)
    assert kept.shape == (rows, m)
    assert ((kept[:, 1:] - kept[:, :-1]) > 0).all()
    assert ((kept >= 0) & (kept < c)).all()
    k = min(m, max(1, round(rho * m)))
    for row, scores in zip(kept, s, strict=True):
        assert set(scores.topk(k).indices.tolist()) <= set(row.tolist())


def test_selection_for_a_full_model_window_is_fast() -> None:
    """Token2Chunk over 36 layers x 8 KV heads stays a small share of scoring.

    Not a timing target (those live in benchmarks): it guards against an accidental
    per-token Python loop, which would take seconds here.
    """
    s = torch.rand(36 * 8, 128)
    start = time.perf_counter()
    token2chunk(s, 64, 0.5, 1.0, 16)
    assert time.perf_counter() - start < 2.0


def token2chunk_spec(s: list[float], budget: int, rho: float, beta: float, max_gap: int) -> list[int]:
    """docs/design.md, "Token2Chunk", step by step in plain Python on one row of scores.

    Written from the spec, not from the package's vectorised code. Token scores are
    assumed distinct (the spec leaves their ties to ``torch.topk``).
    """
    c = len(s)
    m = min(budget, c)  # 1.
    k = min(m, max(1, round(rho * m)))
    best_first = sorted(range(c), key=lambda i: -s[i])
    cands = sorted(best_first[:k])
    kept = set(cands)
    remaining = m - k
    if k > 1 and m > k:
        chunks = []  # 2.-3. (sigma, left endpoint's rank among the candidates, gap)
        for rank, (lo, hi) in enumerate(itertools.pairwise(cands)):
            gap = hi - lo - 1
            if 0 < gap <= max_gap:
                sigma = float(np.float32(s[lo] + s[hi]) / np.float32((gap + 2) ** beta))
                chunks.append((sigma, rank, gap))
        # 4. By decreasing sigma, equal sigmas earlier gap first; whole chunks or none.
        for _, rank, gap in sorted(chunks, key=lambda chunk: (-chunk[0], chunk[1])):
            if gap <= remaining:
                kept.update(range(cands[rank] + 1, cands[rank + 1]))
                remaining -= gap
    for i in best_first:  # 5. The rest of the budget to the best tokens not yet kept.
        if remaining == 0:
            break
        if i not in kept:
            kept.add(i)
            remaining -= 1
    return sorted(kept)  # 6.


def test_spec_reference_on_the_worked_examples() -> None:
    """The reference itself against the hand-worked cases above."""
    assert token2chunk_spec(_scores(20, {5: 10.0, 8: 9.0, 15: 8.0}).tolist(), 4, 0.5, 1.0, 16) == [5, 6, 7, 8]
    s = _scores(16, {2: 5.0, 4: 4.0, 12: 3.0, 14: 1.0, 9: 0.5}).tolist()
    assert token2chunk_spec(s, 6, 0.5, 1.0, 16) == [2, 3, 4, 9, 12, 14]
    assert token2chunk_spec(_scores(12, {1: 5.0, 4: 4.0}).tolist(), 4, 0.5, 1.0, 1) == [1, 4, 10, 11]


def test_equal_chunk_scores_fill_the_earlier_gap_first() -> None:
    # m = 5, K = round(0.6 * 5) = 3 candidates {0, 3, 6}; both gaps hold 2 tokens and
    # score (5 + 4) / 4, and the 2 slots left take one of them: the earlier.
    s = _scores(12, {0: 5.0, 3: 4.0, 6: 5.0})
    assert token2chunk_spec(s.tolist(), 5, 0.6, 1.0, 16) == [0, 1, 2, 3, 6]
    assert token2chunk(s, 5, 0.6, 1.0, 16).tolist() == [0, 1, 2, 3, 6]


@settings(max_examples=200, deadline=None)
@given(c=st.integers(2, 48), data=st.data())
def test_matches_the_spec_with_tied_chunk_scores(c: int, data: st.DataObject) -> None:
    """Scores a permutation of 0..C-1 and an integer beta: the chunk scores are exact in
    fp32, so the visiting order is the spec's to the last tie (e.g. (3 + 5) / 4 ==
    (1 + 5) / 3). Tied chunks that compete for the last slots come up in about 2% of
    draws, so the tie-break itself is pinned by the case above."""
    s = [float(v) for v in data.draw(st.permutations(range(c)))]
    m = data.draw(st.integers(1, c + 3))
    rho = data.draw(st.sampled_from([0.25, 0.4, 0.5, 0.75, 1.0]))
    beta = data.draw(st.sampled_from([0.0, 1.0, 2.0]))
    max_gap = data.draw(st.integers(1, 12))
    got = token2chunk(torch.tensor([s]), m, rho, beta, max_gap)[0].tolist()
    assert got == token2chunk_spec(s, m, rho, beta, max_gap)


@settings(max_examples=200, deadline=None)
@given(case=random_rows())
def test_matches_the_spec_row_by_row(case: tuple[torch.Tensor, int, float, float, int]) -> None:
    """Random fp32 scores, any beta: every row of a batch is its own Token2Chunk."""
    s, m, rho, beta, max_gap = case
    c = s.shape[1]
    assume(all(len(set(row)) == c for row in s.tolist()))  # distinct token scores
    got = token2chunk(s, m, rho, beta, max_gap)
    for row, kept in zip(s.tolist(), got.tolist(), strict=True):
        assert kept == token2chunk_spec(row, m, rho, beta, max_gap)
