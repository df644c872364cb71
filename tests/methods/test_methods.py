"""Invariants every method must keep, and the methods' behaviour on crafted inputs."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from kvllm import CompressionConfig
from kvllm.methods import Window, available, build, calibrated, method_class
from kvllm.methods.pyramidkv import pyramid_budgets
from kvllm.methods.qfilter import save_calibration
from kvllm.methods.rope import Rope


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
    v = torch.randn(b, layers, hkv, n, d, generator=gen)
    positions = tuple(draw(st.lists(st.integers(0, 100), min_size=b, max_size=b)))
    seeds = tuple(draw(st.lists(st.integers(0, 2**62), min_size=b, max_size=b)))
    # A table that may end anywhere past the spans, future positions cut short or not.
    rows = max(positions) + n + draw(st.integers(0, 600))
    rope = Rope.from_inv_freq(1.0 / 10000 ** (torch.arange(0, d, 2) / d), rows)
    return Window(q, k, c, seeds, positions, v, rope), budget


def _calibration_for(folder: Path, window: Window) -> str:
    """A calibration file of seeded random tensors for ``window``'s shape, one per shape:
    Q-Filters ``[L, Hkv, D]`` and retaining heads ``[L, Hkv, 2D + 1]`` (each method reads its own)."""
    from safetensors.torch import save_file

    _, layers, hkv, _, d = window.keys.shape
    path = folder / f"{layers}x{hkv}x{d}.safetensors"
    if not path.exists():
        gen = torch.Generator().manual_seed(d)
        tensors = {"q_filters": torch.randn(layers, hkv, d, generator=gen)}
        tensors["retain_weights"] = torch.randn(layers, hkv, 2 * d + 1, generator=gen)
        save_file(tensors, str(path))
    return str(path)


@pytest.mark.parametrize("name", available())
@settings(max_examples=40, deadline=None)
@given(case=windows())
def test_selection_invariants(name: str, case: tuple[Window, int], tmp_path_factory: pytest.TempPathFactory) -> None:
    window, budget = case
    params = {"calibration": _calibration_for(tmp_path_factory.getbasetemp(), window)} if calibrated(name) else {}
    selection = build(CompressionConfig(method=name, params=params)).select(window, budget)
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


@pytest.mark.parametrize("name", available())
def test_reads_values_says_whether_select_needs_the_values(name: str, tmp_path: Path) -> None:
    """The vLLM runner leaves the values out of a window when the method says it reads
    none: then it must select the same keys without them, else it must refuse to select."""
    window = _values_window()
    params = {"calibration": _calibration_for(tmp_path, window)} if calibrated(name) else {}
    method = build(CompressionConfig(method=name, params=params))
    without = dataclasses.replace(window, values=None)
    if method.reads_values:
        with pytest.raises(ValueError, match=f"method {name!r} needs Window.values"):
            method.select(without, 6)
    else:
        torch.testing.assert_close(method.select(without, 6).indices, method.select(window, 6).indices)


@pytest.mark.parametrize("name", [m for m in available() if method_class(m).has_scores()])
def test_select_scored_is_select_and_scores_at_once(name: str, tmp_path: Path) -> None:
    """Lazy retention carries the score a method ranked by: ``select_scored`` must give
    the selection ``select`` gives and the ``scores`` it ranked by, whichever computes them."""
    window = _values_window()
    params = {"calibration": _calibration_for(tmp_path, window)} if calibrated(name) else {}
    method = build(CompressionConfig(method=name, params=params))
    selection, scores = method.select_scored(window, 6)
    assert torch.equal(selection.indices, method.select(window, 6).indices)
    torch.testing.assert_close(scores, method.scores(window))
    assert scores.shape == (*window.keys.shape[:3], window.n_compress)


def _values_window() -> Window:
    gen = torch.Generator().manual_seed(7)
    b, layers, hkv, group, n, d = 2, 2, 2, 2, 24, 8
    q, k, v = (torch.randn(b, layers, h, n, d, generator=gen) for h in (hkv * group, hkv, hkv))
    rope = Rope.from_inv_freq(1.0 / 10000 ** (torch.arange(0, d, 2) / d), 200)
    return Window(q, k, 16, (1, 2), (0, 30), v, rope)


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


def _pick(name: str, window: Window, budget: int, **params: object) -> list[list[int]]:
    """The kept indices per KV head of a one-sequence, one-layer window."""
    config = CompressionConfig(method=name, params=params)
    return build(config).select(window, budget).indices[0, 0].tolist()


def _one_head(keys: torch.Tensor, queries: torch.Tensor, n_compress: int) -> Window:
    """One sequence, one layer, one KV head and query head: ``keys`` ``[N, D]``, ``queries`` ``[Nq, D]``."""
    return Window(queries[None, None, None], keys[None, None, None], n_compress)


def test_knorm_keeps_the_lowest_key_norms() -> None:
    """Norms 5, 4, 0.5, 3, 0.8, 6 in the area and 0.1 in the buffer: keys 2 and 4 stay."""
    norms = torch.tensor([5.0, 4.0, 0.5, 3.0, 0.8, 6.0, 0.1, 0.1])
    direction = torch.nn.functional.normalize(torch.randn(8, 4, generator=torch.Generator().manual_seed(0)), dim=-1)
    window = _one_head(norms[:, None] * direction, torch.zeros(8, 4), n_compress=6)
    assert _pick("knorm", window, 2) == [[2, 4]]


def test_keydiff_keeps_the_key_least_like_the_area_anchor() -> None:
    """Area: e1 three times, e3 twice, e2 once; the area's anchor is least like e2.

    The buffer's ten e2 keys would pull an anchor over the whole span toward e2, and e3
    would then be the least similar: the anchor must average the area only. Norms vary
    so that the choice is by direction, not length.
    """
    e1, e2, e3 = torch.eye(4)[:3]
    area = torch.stack([e1, 3 * e3, 0.5 * e1, 2 * e2, e3, 4 * e1])
    window = _one_head(torch.cat([area, e2.expand(10, 4)]), torch.zeros(16, 4), n_compress=6)
    assert _pick("keydiff", window, 1) == [[3]]


def test_tova_follows_the_last_query_averaged_over_all_heads() -> None:
    """Two KV heads (group 1). Every earlier query looks at key 0, which Kara keeps.

    The last query of head 0 looks only at key 2; that of head 1 gives key 4 about 0.41
    and key 2 about 0.25. Averaged over both heads key 2 wins, and TOVA keeps it in both
    KV heads, though head 1 alone would keep key 4.
    """
    n, d = 8, 4
    e1, e2 = torch.eye(d)[:2]
    keys = torch.zeros(2, n, d)
    keys[:, 0] = 8 * e2
    keys[0, 2] = 8 * e1
    keys[1, 4], keys[1, 2] = 4 * e1, 3 * e1
    queries = (8 * e2).repeat(2, n, 1)
    queries[0, -1], queries[1, -1] = 8 * e1, e1
    window = Window(queries[None, None], keys[None, None], n_compress=6)
    assert _pick("tova", window, 1) == [[2], [2]]
    assert _pick("kara-topk", window, 1)[0] == [0]


def _lagkv_window(keys: torch.Tensor, values: torch.Tensor) -> Window:
    """One head of 12 tokens, the area the first 8: with partitions of 4, the area is
    [0, 4) and [4, 8), the buffer [8, 12)."""
    return Window(torch.zeros(1, 1, 1, 12, 4), keys[None, None, None], 8, values=values[None, None, None])


def _lagkv_noise() -> torch.Tensor:
    """Twelve tokens near (1, 1, 1, 1); tokens 1 and 2, equal, leave the next partition's
    range far on both sides (a large spread of relative values across channels)."""
    x = 1 + 0.1 * torch.randn(12, 4, generator=torch.Generator().manual_seed(0))
    x[1] = x[2] = torch.tensor([3.0, -3.0, 3.0, -3.0])
    return x


def test_lagkv_keeps_keys_outside_the_next_partitions_range() -> None:
    """Equal values: every token's value share is the same 1/4, so the keys decide."""
    window = _lagkv_window(_lagkv_noise(), torch.ones(12, 4))
    # Ranked within partitions, each keeps its best: the outliers 1 and 2 tie on rank
    # with partition 1's best, so one of them stays.
    kept = _pick("lagkv", window, 2, lag_size=4)[0]
    assert len(set(kept) & {1, 2}) == 1 and len(set(kept) & set(range(4, 8))) == 1
    # Compared across partitions, the outliers' mean shares ((1/2 + 1/4) / 2 each) beat
    # every token of partition 1 (about (0.3 + 1/4) / 2 at most): both stay.
    assert _pick("lagkv", window, 2, lag_size=4, cross_scoring=True) == [[1, 2]]
    # Partitions of 8: the area's one has no whole partition after it in the 12-token
    # span, so it is tail and the most recent keys stay, outliers or not.
    assert _pick("lagkv", window, 3, lag_size=8) == [[5, 6, 7]]


def test_lagkv_reads_the_values_as_kvpress_does() -> None:
    """The same outliers in the values and equal keys: the values decide alike. With
    both, the halves are averaged before the ranking, as kvpress does."""
    noise = _lagkv_noise()
    by_values = _lagkv_window(torch.ones(12, 4), noise)
    by_keys = _lagkv_window(noise, torch.ones(12, 4))
    for params in ({"lag_size": 4}, {"lag_size": 4, "cross_scoring": True}):
        assert _pick("lagkv", by_values, 2, **params) == _pick("lagkv", by_keys, 2, **params)
    # Outliers 1 and 2 in the keys, token 5 in the values: partition 0 keeps one of 1
    # and 2, partition 1 keeps 5 (the keys alone would keep partition 1's noisiest key).
    values = 1 + 0.1 * torch.randn(12, 4, generator=torch.Generator().manual_seed(1))
    values[5] = torch.tensor([3.0, -3.0, 3.0, -3.0])
    both = _lagkv_window(noise, values)
    kept = _pick("lagkv", both, 2, lag_size=4)[0]
    assert 5 in kept and len(set(kept) & {1, 2}) == 1
    keys_only = _lagkv_window(noise, torch.ones(12, 4))
    assert 5 not in _pick("lagkv", keys_only, 2, lag_size=4)[0]


def test_lagkv_params_follow_kvpress_and_fail_out_of_range() -> None:
    params = CompressionConfig(method="lagkv").method_params
    assert (params.lag_size, params.cross_scoring) == (32, False)
    for bad, valid in [({"lag_size": 1}, "[2, 128]"), ({"lag_size": 129}, "[2, 128]"), ({"cross_scoring": 1}, "")]:
        with pytest.raises(ValueError) as err:
            CompressionConfig(method="lagkv", params=bad)
        field = next(iter(bad))
        assert f"CompressionConfig.params.{field}=" in str(err.value) and valid in str(err.value)


def _qfilter(path: Path, filters: torch.Tensor, **metadata: str) -> str:
    save_calibration(path, filters, metadata)
    return str(path)


def test_qfilter_keeps_the_keys_along_the_queries_direction(tmp_path: Path) -> None:
    """The file holds ``-e1``, the authors' form of a direction e1 that the queries favour:
    the keys of largest projection on e1 stay, whatever their other channels."""
    e1, e2 = torch.eye(4)[:2]
    keys = torch.stack([e1, -2 * e1, 3 * e1 - 5 * e2, 0.5 * e1, -e1 + 9 * e2, 2 * e1, 10 * e1, 10 * e1])
    window = _one_head(keys, torch.zeros(8, 4), n_compress=6)
    favoured = _qfilter(tmp_path / "favoured.safetensors", -e1.view(1, 1, 4))
    assert _pick("qfilter", window, 2, calibration=favoured) == [[2, 5]]
    # The opposite filter keeps the opposite end: the sign is the file's, not guessed.
    opposite = _qfilter(tmp_path / "opposite.safetensors", e1.view(1, 1, 4))
    assert _pick("qfilter", window, 2, calibration=opposite) == [[1, 4]]


def test_qfilter_names_a_missing_or_foreign_calibration_file(tmp_path: Path) -> None:
    field = "CompressionConfig.params.calibration="
    for params, why in [
        ({}, "must be the path (a str) of a `kvllm calibrate` file"),
        ({"calibration": str(tmp_path / "none.safetensors")}, "cannot be read"),
    ]:
        with pytest.raises(ValueError) as err:
            CompressionConfig(method="qfilter", params=params)
        assert field in str(err.value) and why in str(err.value)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    other = tmp_path / "other.safetensors"
    save_file({"weights": torch.zeros(2, 2, 4)}, str(other))
    for path, why in [(garbage, "is not a safetensors file"), (other, "holds no [L, Hkv, ...] tensor 'q_filters'")]:
        with pytest.raises(ValueError) as err:
            CompressionConfig(method="qfilter", params={"calibration": str(path)})
        assert f"{field}{str(path)!r}" in str(err.value) and why in str(err.value)


def test_qfilter_refuses_filters_of_another_shape_at_select(tmp_path: Path) -> None:
    """A file of another model passes the config (it is a calibration file) and fails at
    the first round, naming the file, both shapes and the model it was written for."""
    path = _qfilter(tmp_path / "other.safetensors", torch.randn(3, 1, 4), model="some/other-model")
    config = CompressionConfig(method="qfilter", params={"calibration": path})
    window = _one_head(torch.randn(8, 4), torch.zeros(8, 4), n_compress=6)
    with pytest.raises(ValueError) as err:
        build(config).select(window, 2)
    message = str(err.value)
    assert f"CompressionConfig.params.calibration={path!r}" in message
    assert "[3, 1, 4]" in message and "[1, 1, 4]" in message and "some/other-model" in message


def _qwen3(**overrides: int) -> Any:
    """A small Qwen3 config: 2 layers, 4 query / 2 KV heads of 8."""
    from transformers import Qwen3Config

    shape = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    return Qwen3Config(**{"hidden_size": 32, "vocab_size": 100, **shape, **overrides})


def test_qfilter_checks_the_model_before_it_serves(tmp_path: Path) -> None:
    """``check_model`` (run at start-up by both backends) compares the filters' shape and
    what ``kvllm calibrate`` recorded of the model, and names every difference."""
    from kvllm.methods.qfilter import model_signature

    model = _qwen3()
    good = _qfilter(tmp_path / "good.safetensors", torch.randn(2, 2, 8), model="here", **model_signature(model))
    build(CompressionConfig(method="qfilter", params={"calibration": good})).check_model(model)
    # A file without metadata (an older one) is checked on its shape alone.
    bare = _qfilter(tmp_path / "bare.safetensors", torch.randn(2, 2, 8))
    build(CompressionConfig(method="qfilter", params={"calibration": bare})).check_model(model)
    cases = [
        (_qwen3(num_hidden_layers=3), "num_layers 2 (this model: 3)"),
        (_qwen3(num_key_value_heads=4), "num_kv_heads 2 (this model: 4)"),
        # The same [L, Hkv, D] filters, but the file recorded another vocabulary.
        (_qwen3(vocab_size=101), "vocab_size 100 (this model: 101)"),
    ]
    for other, why in cases:
        with pytest.raises(ValueError) as err:
            build(CompressionConfig(method="qfilter", params={"calibration": good})).check_model(other)
        message = str(err.value)
        assert f"CompressionConfig.params.calibration={good!r}" in message and why in message, message
        assert "another model (here)" in message


def test_hf_cache_checks_the_calibration_file_before_the_first_forward(tmp_path: Path) -> None:
    from kvllm.hf.cache import CompressingCache

    path = _qfilter(tmp_path / "three-layers.safetensors", torch.randn(3, 2, 8))
    config = CompressionConfig(method="qfilter", params={"calibration": path})
    with pytest.raises(ValueError, match=r"num_layers 3 \(this model: 2\)"):
        CompressingCache(_qwen3(), config, pad_lengths=[0])


def test_qfilter_reads_a_file_written_again(tmp_path: Path) -> None:
    """The file is cached by path, but not past a rewrite (its size or time changes):
    the new filters count."""
    e1 = torch.eye(4)[0]
    keys = torch.stack([e1, -e1, 2 * e1, -2 * e1, e1, e1])
    window = _one_head(keys, torch.zeros(6, 4), n_compress=4)
    path = _qfilter(tmp_path / "q_filters.safetensors", -e1.view(1, 1, 4))
    assert _pick("qfilter", window, 1, calibration=path) == [[2]]
    _qfilter(tmp_path / "q_filters.safetensors", e1.view(1, 1, 4), model="rewritten, with metadata")
    assert _pick("qfilter", window, 1, calibration=path) == [[3]]


def _twoway_window() -> Window:
    """Eight tokens, the area the first six. Every query is 0 (uniform attention) except
    token 1's, which spreads its attention evenly over keys 2-7.

    Received attention: 7/8 for keys 0 and 1, 7/8 + 1/6 for keys 2-7, so Kara keeps one
    of 2-5. Given to later tokens: (7 - i)/8 for token i, but all of token 1's query,
    so token 1 scores 7/8 + 1 both ways, above token 0 (7/8 + 7/8) and key 2 (25/24 + 5/8).
    """
    n, d = 8, 4
    e1 = torch.eye(d)[0]
    keys = torch.zeros(n, d)
    keys[2:] = 8 * e1
    queries = torch.zeros(n, d)
    queries[1] = 8 * e1
    return _one_head(keys, queries, n_compress=6)


def test_kara_twoway_keeps_a_token_whose_query_looks_ahead() -> None:
    window = _twoway_window()
    assert _pick("kara-twoway", window, 1) == [[1]]
    assert _pick("kara", window, 1)[0][0] in range(2, 6)


def test_kara_twoway_token_without_a_query_gives_nothing() -> None:
    """With queries for the last six tokens only (all uniform), token 1 has none and only
    receives, 6/8 like every key; token 2, the first with a query, gives 5/8 the most."""
    full = _twoway_window()
    window = Window(full.queries[..., 2:, :], full.keys, full.n_compress)
    assert _pick("kara-twoway", window, 1) == [[2]]


# ------------------------------------------------ the value- and RoPE-aware scorers


def _carrying(keys: torch.Tensor, queries: torch.Tensor, n_compress: int, **fields: object) -> Window:
    """:func:`_one_head`'s window with values (unit norms unless given), a stream seed,
    position 0 and a RoPE table that does not rotate (pre-RoPE is post-RoPE), unless given."""
    n, d = keys.shape
    values = fields.pop("values", torch.eye(d)[0].expand(n, d))
    window = Window(
        queries[None, None, None],
        keys[None, None, None],
        n_compress,
        seeds=(7,),
        positions=fields.pop("positions", (0,)),
        values=values[None, None, None],
        rope=fields.pop("rope", Rope.from_inv_freq(torch.zeros(d // 2), 64)),
    )
    assert not fields
    return window


def test_noncausal_attn_keeps_a_key_among_heavy_values() -> None:
    """Uniform attention (zero queries), value norms 1, 5, 1, 4, 4, 4 in the area: the
    pooled value-weighted mass is highest at key 4, in the middle of the run of fours,
    not at the lone 5 that an unpooled value norm would keep."""
    norms = torch.tensor([1.0, 5.0, 1.0, 4.0, 4.0, 4.0, 1.0, 1.0])
    values = norms[:, None] * torch.eye(4)[0]
    window = _carrying(torch.zeros(8, 4), torch.zeros(8, 4), 6, values=values)
    assert _pick("noncausal-attn", window, 1) == [[4]]
    assert _pick("kara-vnorm", window, 1) == [[1]]


def test_kara_vnorm_keeps_a_key_with_a_large_value_that_kara_drops() -> None:
    """Key 2 draws e / (e + 7) of each query's attention, the others 1 / (e + 7); key 4's
    value is ten times the others', so its weighted mass, 10 / (e + 7), is the largest."""
    e1 = torch.eye(4)[0]
    keys = torch.zeros(8, 4)
    keys[2] = e1
    norms = torch.ones(8)
    norms[4] = 10.0
    window = _carrying(keys, (2 * e1).expand(8, 4), 6, values=norms[:, None] * e1)
    assert _pick("kara", window, 1) == [[2]]
    assert _pick("kara-vnorm", window, 1) == [[4]]


def test_kara_pool_keeps_a_run_of_keys_over_a_lone_spike() -> None:
    """Logits 1.5 for key 0 and 1 for keys 3-5, 0 elsewhere: Kara keeps the spike; pooled
    over 3 (zeros padded), key 4 (e, e, e) beats key 1 (e^1.5, 1, 1) and key 0."""
    e1 = torch.eye(4)[0]
    keys = torch.zeros(9, 4)
    keys[0], keys[3:6] = 1.5 * e1, e1
    window = _carrying(keys, (2 * e1).expand(9, 4), 7)
    assert _pick("kara", window, 1) == [[0]]
    assert _pick("kara-pool", window, 1) == [[4]]
    assert _pick("kara-vpool", window, 1) == [[4]]


def test_compactor_keeps_a_geometric_outlier_that_attention_drops() -> None:
    """Seven area keys along e1 and one, key 3, along e2; the queries read e1. Non-causal
    attention ranks key 3 last; its leverage is the largest, and with the leverage
    weighted up it is kept. At blending 0 compactor is noncausal-attn."""
    e1, e2 = torch.eye(4)[:2]
    keys = e1.expand(10, 4).clone() * torch.linspace(1.0, 1.2, 10)[:, None]
    keys[3] = 3 * e2
    window = _carrying(keys, (2 * e1).expand(10, 4), 8)
    assert 3 not in _pick("noncausal-attn", window, 2)[0]
    assert 3 in _pick("compactor", window, 2, blending=4.0)[0]
    assert _pick("compactor", window, 2, blending=0.0) == _pick("noncausal-attn", window, 2)


def test_compactor_blends_by_the_fraction_removed_by_default() -> None:
    window = _carrying(torch.randn(12, 4, generator=torch.Generator().manual_seed(1)), torch.randn(12, 4), 10)
    for budget in (2, 5, 9):
        assert _pick("compactor", window, budget) == _pick("compactor", window, budget, blending=1 - budget / 10)


def test_expected_attention_reads_the_queries_spread() -> None:
    """The queries are +-3 e2: mean 0, variance 9 along e2. Without the covariance term
    every expected logit is 0 and the largest value (key 1) wins; with it key 4, along
    e2, expects exp(4 * 9 / 8) times the others' attention."""
    e1, e2 = torch.eye(4)[:2]
    keys = torch.zeros(8, 4)
    keys[4] = 2 * e2
    queries = 3 * e2 * torch.tensor([1.0, -1.0]).repeat(4)[:, None]
    norms = torch.ones(8)
    norms[1] = 2.0
    window = _carrying(keys, queries, 6, values=norms[:, None] * e1)
    assert _pick("expected-attention", window, 1) == [[4]]
    assert _pick("expected-attention", window, 1, use_covariance=False) == [[1]]


def test_expected_attention_looks_at_the_next_position() -> None:
    """RoPE turning a quarter per position; every query is e1 before RoPE. The span covers
    positions 10-17. Key 1 is 3 e1 rotated to 18, the next position; key 3 is 3 e1
    rotated to 17, the last query's: at 18 the queries meet key 1 head on and key 3 at a
    right angle, so with one future position key 1 is kept."""
    rope = Rope.from_inv_freq(torch.tensor([torch.pi / 2]), 64)
    e1 = torch.eye(2)[0]
    keys = torch.zeros(8, 2)
    keys[1] = rope.rotate(3 * e1[None], torch.tensor([18]))[0]
    keys[3] = rope.rotate(3 * e1[None], torch.tensor([17]))[0]
    queries = rope.rotate(e1.expand(8, 2), torch.arange(10, 18))
    window = _carrying(keys, queries, 6, positions=(10,), rope=rope)
    assert _pick("expected-attention", window, 1, n_future_positions=1) == [[1]]


@pytest.mark.parametrize(
    ("name", "missing"),
    [
        ("noncausal-attn", "values"),
        ("compactor", "seeds"),
        ("expected-attention", "rope"),
        ("kara-vnorm", "values"),
        ("lagkv", "values"),
    ],
)
def test_a_scorer_names_what_the_backend_omits(name: str, missing: str) -> None:
    full = _carrying(torch.randn(8, 4), torch.randn(8, 4), 6)
    window = dataclasses.replace(full, **{missing: None})
    with pytest.raises(ValueError, match=f"method {name!r} needs Window.{missing}"):
        build(CompressionConfig(method=name)).select(window, 2)


@pytest.mark.parametrize(
    ("name", "bad", "valid"),
    [
        ("compactor", {"sketch_dimension": 0}, "[1, inf]"),
        ("compactor", {"blending": -0.5}, ">= 0"),
        ("expected-attention", {"n_future_positions": 0}, "[1, inf]"),
        ("expected-attention", {"use_vnorm": 1}, "true or false"),
        ("expected-attention", {"epsilon": -1.0}, ">= 0"),
        ("kara-pool", {"pool_kernel": 2}, "odd integer >= 1"),
        ("kara-vpool", {"rho": 0.0}, "(0, 1]"),
    ],
)
def test_scorer_params_fail_out_of_range(name: str, bad: dict[str, object], valid: str) -> None:
    with pytest.raises(ValueError) as err:
        CompressionConfig(method=name, params=bad)
    field = next(iter(bad))
    assert f"CompressionConfig.params.{field}=" in str(err.value) and valid in str(err.value)
