"""The baselines' budget rules and defaults, checked against their references."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvllm import CompressionConfig
from kvllm.methods.pyramidkv import pyramid_budgets
from tests.methods.test_references import BUFFER, SNAP, build, chunk_means, kept_mask, kvpress_snapkv, make_window

# ---------------------------------------------------------------- PyramidKV schedule


@settings(max_examples=300, deadline=None)
@given(
    n_layers=st.integers(1, 96),
    cap=st.integers(1, 512),
    share=st.floats(0.0, 1.0),
    beta=st.one_of(st.floats(1.0, 1000.0), st.sampled_from([1.0, 20.0, math.inf])),
)
@example(n_layers=8, cap=128, share=0.0, beta=20.0)  # m = 1: the old schedule kept 10, not 8
@example(n_layers=8, cap=128, share=99 / 127, beta=20.0)  # m = 100: it kept 680, not 800
def test_pyramid_budgets_sum_to_layers_times_m(n_layers: int, cap: int, share: float, beta: float) -> None:
    m = 1 + round(share * (cap - 1))
    per_layer = pyramid_budgets(n_layers, m, beta, cap)
    assert per_layer.dtype == torch.long and per_layer.shape == (n_layers,)
    assert int(per_layer.sum()) == n_layers * m
    assert (per_layer >= 1).all() and (per_layer <= cap).all()
    assert (per_layer[1:] <= per_layer[:-1]).all()
    # Where no clamp moves budget, each layer is within rounding of the linear pyramid.
    lo, hi = m / beta, 2 * m - m / beta
    if n_layers > 1 and lo >= 1 and hi <= cap:
        exact = hi - (hi - lo) * torch.arange(n_layers, dtype=torch.float64) / (n_layers - 1)
        assert ((per_layer - exact).abs() < 1 + 1e-9).all()


def test_pyramid_budgets_at_the_edges() -> None:
    assert pyramid_budgets(8, 1, 20.0, 128).tolist() == [1] * 8
    per_layer = pyramid_budgets(8, 100, 20.0, 128)
    assert int(per_layer.sum()) == 800 and int(per_layer.max()) == 128
    assert pyramid_budgets(8, 128, 20.0, 128).tolist() == [128] * 8
    assert pyramid_budgets(1, 26, 20.0, 128).tolist() == [26]


# --------------------------------------------------------------------------- ChunkKV


def kvpress_chunks(scores: torch.Tensor, size: int, m: int) -> list[int]:
    """The tokens kvpress's ``ChunkKVPress`` keeps from layer scores ``[C]``: whole chunks only."""
    c = len(scores)
    means = chunk_means(scores, size)
    n_kept = max(1, int(len(means) * (1 - (1 - m / c))))
    best = sorted(range(len(means)), key=lambda i: -means[i])[:n_kept]
    return sorted(t for i in best for t in range(i * size, min(c, (i + 1) * size)))


@pytest.mark.parametrize(
    ("chunk_size", "budget"),
    [(20, 13), (20, 20), (20, 26), (20, 40), (20, 47), (16, 16), (16, 32), (12, 24), (8, 40), (5, 3)],
)
def test_chunkkv_keeps_kvpress_whole_chunks_and_tops_up_to_m(chunk_size: int, budget: int) -> None:
    window = make_window(BUFFER, seed=chunk_size * 100 + budget)
    method = build("chunkkv", {**SNAP, "chunk_size": chunk_size}, window)
    mask = kept_mask(method.select(window, budget), window.n_compress)
    c = window.n_compress
    assert (mask.sum(-1) == budget).all()
    # Every head of a layer keeps the same tokens.
    assert (mask == mask[:, :, :1]).all()
    for bi in range(mask.shape[0]):
        for li in range(mask.shape[1]):
            layer = kvpress_snapkv(window, bi, li, BUFFER, method.params.pool_kernel).sum(0)
            theirs = kvpress_chunks(layer, chunk_size, budget)
            ours = mask[bi, li, 0].nonzero().flatten().tolist()
            if len(theirs) <= budget:
                assert set(theirs) <= set(ours)
            if c % chunk_size == 0 and budget % chunk_size == 0:
                assert theirs == ours


def test_chunkkv_head_picks_chunks_per_head() -> None:
    window = make_window(BUFFER, seed=3)
    shared = kept_mask(build("chunkkv", SNAP, window).select(window, 26), window.n_compress)
    per_head = kept_mask(build("chunkkv-head", SNAP, window).select(window, 26), window.n_compress)
    assert (shared == shared[:, :, :1]).all()
    assert not (per_head == per_head[:, :, :1]).all()


# ------------------------------------------------------------------ defaults and range


def test_defaults_follow_the_references() -> None:
    rkv = CompressionConfig(method="rkv").method_params
    assert (rkv.lam, rkv.obs_window, rkv.pool_kernel, rkv.sim_threshold) == (0.07, 8, 7, 0.5)
    assert CompressionConfig(method="chunkkv").method_params.chunk_size == 20
    assert CompressionConfig(method="chunkkv-head").method_params.chunk_size == 20
    snap = CompressionConfig(method="snapkv").method_params
    assert (snap.obs_window, snap.pool_kernel) == (32, 7)
    assert CompressionConfig(method="pyramidkv").method_params.beta == 20.0
    assert CompressionConfig(method="adakv").method_params.floor == 0.2


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        (dict(method="chunkkv", params={"chunk_size": 129}), "CompressionConfig.params.chunk_size=129"),
        (dict(method="chunkkv-head", params={"chunk_size": 0}), "CompressionConfig.params.chunk_size=0"),
        # The default chunk (20 tokens) does not fit a 16-token window.
        (
            dict(method="chunkkv", window=16, buffer=8, period=4, block_size=16, params={"obs_window": 8}),
            "CompressionConfig.params.chunk_size=20 is invalid: must be an integer in [1, 16]",
        ),
        (dict(method="rkv", params={"lam": 1.5}), "CompressionConfig.params.lam=1.5"),
        (dict(method="rkv", params={"lam": -0.01}), "CompressionConfig.params.lam=-0.01"),
        (dict(method="rkv", params={"sim_threshold": 1.5}), "CompressionConfig.params.sim_threshold=1.5"),
        (dict(method="rkv", params={"obs_window": 161}), "CompressionConfig.params.obs_window=161"),
        (dict(method="rkv", params={"pool_kernel": 6}), "CompressionConfig.params.pool_kernel=6"),
    ],
)
def test_out_of_range_params_fail_at_config_construction(config: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as err:
        CompressionConfig(**config)
    assert fragment in str(err.value)
    ranges = {"chunk_size": "[1, 1", "lam": "[0, 1]", "sim_threshold": "[-1, 1]", "obs_window": "[1, 160]"}
    for name, valid in ranges.items():
        if f".{name}=" in fragment:
            assert valid in str(err.value)
