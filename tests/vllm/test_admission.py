"""Projected admission: the arithmetic on synthetic footprints, then inside vLLM."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvllm.config import CompressionConfig
from kvllm.policy import physical_growth
from kvllm.vllm.admission import Footprint, admissible, project
from kvllm.vllm.engine import held_blocks, scheduler_of
from tests.vllm.conftest import PROMPTS, engine, greedy, token_ids

BS = 4


def _blocks(slots: np.ndarray) -> np.ndarray:
    return -(-slots // BS)


def _flat(base: int, steps: int, compressing: bool = True) -> Footprint:
    """A request that holds ``base`` slots and grows by one per step (no compression)."""
    return Footprint(_blocks(base + np.arange(1, steps + 1)), compressing)


def _run_blocks(*footprints: Footprint) -> list[np.ndarray]:
    return [f.blocks for f in footprints]


def test_admits_in_order_until_a_future_step_overflows() -> None:
    running = _run_blocks(_flat(8, 12))  # 3 blocks for 4 steps, 5 at its last step
    waiting = [_flat(8, 4), _flat(8, 4), _flat(8, 4), _flat(1, 1)]
    # Two fit (3 + 3 + 3 = 9 blocks for 4 steps), the third would make 12; the fourth
    # would fit but waits behind it: admission keeps the queue's order, as FCFS does.
    assert admissible(running, waiting, capacity=11) == 2
    assert admissible(running, waiting, capacity=8) == 1
    assert admissible(running, waiting, capacity=4) == 0


def test_a_request_that_ends_soon_makes_room_later() -> None:
    # Running: 8 blocks, but only for 2 more steps; the newcomer holds 2 blocks then and
    # 5 at its end. Their peaks never overlap, so both fit a 10-block pool; beside a
    # request that keeps its 8 blocks, it does not.
    short = _blocks(30 + np.arange(1, 3))
    long = _blocks(np.full(16, 31))
    assert admissible([short], [_flat(4, 16)], capacity=10) == 1
    assert admissible([long], [_flat(4, 16)], capacity=10) == 0


def test_an_idle_engine_admits_one_request_even_if_it_cannot_fit() -> None:
    assert admissible([], [_flat(100, 10), _flat(1, 1)], capacity=4) == 1


def test_requests_without_compression_are_left_to_vllm_but_reserved() -> None:
    running = _run_blocks(_flat(8, 12))
    waiting = [_flat(40, 4, compressing=False), _flat(1, 1)]
    # The uncompressed one is admitted whatever it needs (vLLM decides); its growth then
    # leaves no room for the compressing one behind it.
    assert admissible(running, waiting, capacity=12) == 1


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 40), st.integers(1, 30)), max_size=6),
    st.lists(st.tuples(st.integers(1, 40), st.integers(1, 30)), min_size=1, max_size=6),
    st.integers(1, 40),
)
def test_what_is_admitted_fits_at_every_step(
    running: list[tuple[int, int]], waiting: list[tuple[int, int]], capacity: int
) -> None:
    run = [_flat(b, s).blocks for b, s in running]
    wait = [_flat(b, s) for b, s in waiting]
    n = admissible(run, wait, capacity)
    profiles = run + [f.blocks for f in wait[:n]]
    usage = np.zeros(max(len(p) for p in profiles), dtype=np.int64)
    for p in profiles:
        usage[: len(p)] += p
    if n and (run or n > 1):
        # Admission answers for the steps an admitted request lives through; running
        # requests may overflow later on their own (vLLM preempts then, as before).
        first = 0 if run else 1
        assert all(usage[: len(f.blocks)].max() <= capacity for f in wait[first:n])
    if n < len(wait) and (run or n):
        # The next one would not have fitted.
        nxt = wait[n].blocks
        top = np.zeros(max(len(usage), len(nxt)), dtype=np.int64)
        top[: len(usage)] += usage
        top[: len(nxt)] += nxt
        assert top.max() > capacity


KARA = CompressionConfig(window=32, buffer=8, period=4, retention=0.2, admission="projected")
SMALL = {"num_gpu_blocks_override": 24}


def _run(llm: Any, prompts: list[str], params: Any, check: bool = True) -> dict[str, Any]:
    """Step the engine; after each step, check (with ``check``) every running request's
    blocks against the projection the scheduler made when it started decoding."""
    eng, sched = llm.llm.llm_engine, scheduler_of(llm)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    seen: dict[str, tuple[int, np.ndarray]] = {}
    mismatches = checked = steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
        for request in sched.running:
            rid = request.request_id
            if not check or rid not in sched.kv_requests:
                continue  # not checking, or still prefilling
            held = held_blocks(sched, rid)
            if rid not in seen:
                # Projected now, for the step that just ran (one step back). Between
                # steps the scheduler's cached slice lags a step (its state syncs when it
                # plans), so project from the request's own counts, as the cache was.
                entry = sched.kv_requests[rid]
                f = project(request, entry.config, entry.state.prompt_len, sched.max_model_len, sched.block_size)
                seen[rid] = (steps, np.concatenate([[held], f.blocks]))
            first, projected = seen[rid]
            checked += 1
            mismatches += held != projected[steps - first]
    return {"steps": steps, "checked": checked, "mismatches": mismatches, "sched": sched}


def test_projection_is_exact_and_projected_admission_never_preempts(tiny_model: str) -> None:
    params = greedy(200)
    with engine(tiny_model, KARA, **SMALL) as llm:
        got = _run(llm, PROMPTS[:16], params)
        assert got["checked"] > 1000 and got["mismatches"] == 0
        assert got["sched"].kv_totals.preemptions == 0
        assert got["sched"].kv_totals.rounds > 16
    with engine(tiny_model, KARA.replace(admission="vllm"), **SMALL) as llm:
        assert _run(llm, PROMPTS[:16], params, check=False)["sched"].kv_totals.preemptions > 0


def test_a_waiting_request_is_projected_conservatively_around_its_prefill() -> None:
    """Its prefill step holds the prompt; decode step k runs one step later (or more,
    under chunked prefill): both alignments are covered, so a round's drop is never
    projected a step early."""
    from types import SimpleNamespace

    config = CompressionConfig(window=32, buffer=8, period=4, retention=0.25)
    request = SimpleNamespace(max_tokens=200, num_output_tokens=0, num_tokens=20, num_computed_tokens=0)
    got = project(request, config, None, max_model_len=512, block_size=BS).blocks
    growth = 20 + physical_growth(config, 200)
    early, late = _blocks(growth), _blocks(np.concatenate([[20], growth[:-1]]))
    assert (got >= early).all() and (got >= late).all()
    assert (got == np.maximum(early, late)).all() and (early > late).any() and (late > early).any()


def test_keep_all_under_projected_admission_matches_vanilla(tiny_model: str) -> None:
    keep_all = CompressionConfig(window=32, buffer=8, period=4, retention=1.0, admission="projected")
    with engine(tiny_model, None, plugin=False, **SMALL) as vanilla:
        expected = token_ids(vanilla.generate(PROMPTS[:16], greedy(160)))
    with engine(tiny_model, keep_all, **SMALL) as llm:
        got = token_ids(llm.generate(PROMPTS[:16], greedy(160)))
        assert scheduler_of(llm).kv_totals.preemptions == 0
    assert got == expected
