"""Policies on simulated sequences: what is compressed, when, and what never is."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from kvllm import CompressionConfig
from kvllm.policy import PeriodicWindowPolicy, SeqState, ThresholdPolicy, build_policy, physical_growth


def _simulate(cfg: CompressionConfig, prompt: int, steps: int) -> tuple[SeqState, list[int], list[int]]:
    """Decode ``steps`` tokens, applying every planned round to a list of token ids.

    Keeps the *last* ``budget`` tokens of each compressible area (any choice works:
    the policy must not care which). Returns the state, the slot->token list and the
    steps at which rounds ran.
    """
    policy = build_policy(cfg)
    state = SeqState(prompt_len=prompt)
    slots = list(range(prompt))
    compressed: set[int] = set()
    rounds = []
    for step in range(1, steps + 1):
        slots.append(prompt + step - 1)
        state.append()
        region = policy.plan(state)
        if region is None:
            continue
        rounds.append(step)
        area = slots[region.start : region.start + region.n_compress]
        buffer = slots[region.start + region.n_compress : region.start + region.span]
        assert region.start >= prompt, "the prompt is never compressed"
        assert region.start + region.span <= len(slots)
        if isinstance(policy, PeriodicWindowPolicy):
            assert not compressed & set(area), "each window is compressed once"
            assert len(buffer) == cfg.buffer
        compressed |= set(area)
        kept = area[len(area) - region.budget :]
        slots[region.start : region.start + region.n_compress] = kept
        policy.commit(state, region)
        assert set(buffer) <= set(slots), "the buffer is never dropped"
        assert len(slots) == state.length
    assert slots[:prompt] == list(range(prompt))
    return state, slots, rounds


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.integers(1, 50),
    steps=st.integers(0, 600),
    window=st.sampled_from([32, 64]),
    buffer=st.integers(0, 31),
    period=st.integers(1, 32),
    retention=st.floats(0.05, 1.0),
)
def test_periodic_lengths(prompt: int, steps: int, window: int, buffer: int, period: int, retention: float) -> None:
    cfg = CompressionConfig(window=window, buffer=buffer, period=period, retention=retention)
    state, _, rounds = _simulate(cfg, prompt, steps)
    assert state.logical_length == prompt + steps
    kept_history = state.rounds * cfg.budget
    assert state.length == prompt + kept_history + state.tail
    assert state.tail_start == prompt + kept_history
    assert all(step % period == 0 for step in rounds)
    # The policy keeps up: after the last check, the tail is short of a window.
    last_check = steps - steps % period
    assert state.tail - (steps - last_check) < window + buffer


def test_periodic_first_round_waits_for_window_plus_buffer() -> None:
    cfg = CompressionConfig(window=32, buffer=8, period=4, retention=0.25)
    _, _, rounds = _simulate(cfg, prompt=10, steps=80)
    # Tail reaches 40 at step 40 (a multiple of 4); the next window starts at the
    # buffer: 8 + 32 more tokens are needed, reached at step 72.
    assert rounds == [40, 72]


@settings(max_examples=40, deadline=None)
@given(prompt=st.integers(1, 40), steps=st.integers(0, 800), interval=st.integers(1, 64))
def test_threshold_recompresses_generated_region_to_budget(prompt: int, steps: int, interval: int) -> None:
    cfg = CompressionConfig(policy="threshold", window=32, buffer=8, threshold_budget=100, threshold_interval=interval)
    assert isinstance(build_policy(cfg), ThresholdPolicy)
    state, _, rounds = _simulate(cfg, prompt, steps)
    generated = state.length - prompt
    assert generated < cfg.threshold_budget + interval
    if rounds:
        # Each round leaves `budget` generated slots, then `interval` more trigger it.
        assert all(b - a == interval for a, b in itertools.pairwise(rounds))
    assert state.logical_length == prompt + steps


@settings(max_examples=40, deadline=None)
@given(
    prompt=st.integers(1, 50),
    steps=st.integers(0, 500),
    period=st.integers(1, 32),
    threshold=st.booleans(),
)
def test_physical_growth_is_the_simulated_length(prompt: int, steps: int, period: int, threshold: bool) -> None:
    """Admission's projection replays the policy: at decode step k a sequence holds the
    slots left after that step's round, plus the one its new token is written to."""
    if threshold:
        cfg = CompressionConfig(policy="threshold", window=32, buffer=8, threshold_budget=100, threshold_interval=40)
    else:
        cfg = CompressionConfig(window=32, buffer=8, period=period, retention=0.25)
    growth = physical_growth(cfg, steps + 1)
    assert len(growth) == steps + 1 and not growth.flags.writeable
    state, _, _ = _simulate(cfg, prompt, steps)
    assert growth[steps] == state.length - prompt + 1


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.integers(1, 50),
    steps=st.integers(0, 600),
    buffer=st.integers(0, 31),
    period=st.integers(1, 32),
    retention=st.floats(0.05, 1.0),
    lazy=st.integers(2, 4),
)
def test_lazy_rounds_cut_the_last_candidates_and_keep_the_new_windows(
    prompt: int, steps: int, buffer: int, period: int, retention: float, lazy: int
) -> None:
    """Under lazy retention a round's area is the previous round's candidates, then a
    window no round has seen; the candidates end at m slots, the window at min(W, F m),
    and every other round's kept slots stay where they are."""
    cfg = CompressionConfig(window=32, buffer=buffer, period=period, retention=retention, lazy=lazy)
    m, first = cfg.budget, cfg.lazy_first
    policy = build_policy(cfg)
    state = SeqState(prompt_len=prompt)
    slots = list(range(prompt))
    seen: set[int] = set()
    candidates: list[int] = []
    for step in range(1, steps + 1):
        slots.append(prompt + step - 1)
        state.append()
        region = policy.plan(state)
        if region is None:
            continue
        area = slots[region.start : region.start + region.n_compress]
        assert region.candidates == len(candidates) and area[: len(candidates)] == candidates
        window = area[len(candidates) :]
        assert len(window) == cfg.window and not seen & set(window), "a window is new to every round"
        assert region.span - region.n_compress == buffer and region.n_queries == cfg.window + buffer
        seen |= set(window)
        before = slots[: region.start]
        # Any choice works: the policy must not care which.
        kept = candidates[len(candidates) - m :] + window[cfg.window - first :]
        assert region.budget == len(kept)
        slots[region.start : region.start + region.n_compress] = kept
        policy.commit(state, region)
        assert slots[: region.start] == before and len(slots) == state.length
        candidates = window[cfg.window - first :]
        assert state.pending == first and state.tail_start == len(slots) - state.tail
    if state.rounds:
        assert state.length == prompt + (state.rounds - 1) * m + first + state.tail
    assert state.logical_length == prompt + steps


def test_lazy_growth_holds_the_newest_candidates_over_the_budget() -> None:
    """Admission's projection replays the lazy policy: F m - m more slots once rounds run."""
    plain = CompressionConfig(window=32, buffer=8, period=4, retention=0.25)
    lazy = plain.replace(lazy=2)
    g_plain, g_lazy = physical_growth(plain, 400), physical_growth(lazy, 400)
    first_round = 40  # the tail reaches W + b at step 40, a multiple of P
    assert (g_lazy[:first_round] == g_plain[:first_round]).all()
    assert (g_lazy[first_round:] - g_plain[first_round:] == lazy.lazy_first - lazy.budget).all()
