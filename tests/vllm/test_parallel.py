"""Tensor parallelism: KvLLM at TP=2 against vanilla vLLM at TP=2 and against itself at TP=1.

Each TP=2 engine spawns two worker processes (about 30 s of imports on two cores), so the
module starts three engines once and shares them: vanilla at TP=2, KvLLM at TP=2 (keep-all,
with Kara, random and ChunkKV as per-request overrides) and KvLLM at TP=1. The tests other
than the keep-all differential carry the ``tp`` marker; it is run by default.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from kvllm.config import CompressionConfig
from kvllm.vllm import engine as adapter
from kvllm.vllm.engine import block_pool_usage, ring_usage, scheduler_of
from tests.vllm.conftest import PROMPTS, engine, greedy, token_ids

KEEP_ALL = CompressionConfig(window=32, buffer=8, period=4, retention=1.0)
# Per-request overrides of KEEP_ALL: the same window, buffer and period.
SELECTIONS = {
    "kara": {"retention": 0.2},
    "random": {"method": "random", "retention": 0.2},
    "chunkkv": {"method": "chunkkv", "retention": 0.25, "params": {"chunk_size": 4}},
}
PROMPTS_TP = PROMPTS[:12]
TOKENS = 150
# An explicit KV cache size skips vLLM-CPU's warm-up pass and a 3 GiB allocation per worker.
TP_KWARGS = {"kv_cache_memory_bytes": 64 * 2**20}


@pytest.fixture(scope="module", autouse=True)
def _cpu_binding() -> Iterator[None]:
    """What kvllm.LLM does for a TP=2 engine, for the vanilla engine too."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(adapter.BIND, os.environ.get(adapter.BIND, ""))  # restored at teardown, also when unset
        if not os.environ[adapter.BIND]:
            mp.delenv(adapter.BIND)
            adapter.bind_cpu_threads(2)
        yield


def _generate(llm: Any, override: dict | None) -> list[Any]:
    extra = {} if override is None else {"extra_args": {"kvllm": override}}
    return llm.generate(PROMPTS_TP, greedy(TOKENS, **extra), use_tqdm=False)


@pytest.fixture(scope="module")
def vanilla_tp2(tiny_model: str) -> list[list[int]]:
    with engine(tiny_model, None, plugin=False, tensor_parallel_size=2, **TP_KWARGS) as llm:
        return token_ids(_generate(llm, None))


@pytest.fixture(scope="module")
def tp1(tiny_model: str) -> dict[str, list[Any]]:
    with engine(tiny_model, KEEP_ALL, **TP_KWARGS) as llm:
        return {name: _generate(llm, override) for name, override in SELECTIONS.items()}


@pytest.fixture(scope="module")
def tp2(tiny_model: str, vanilla_tp2: list[list[int]], tp1: dict[str, list[Any]]) -> Iterator[Any]:
    # After the other two engines are gone: idle workers of a live engine would share the two cores.
    with engine(tiny_model, KEEP_ALL, tensor_parallel_size=2, **TP_KWARGS) as llm:
        yield llm


def test_keep_all_at_tp2_matches_vanilla_at_tp2(tp2: Any, vanilla_tp2: list[list[int]]) -> None:
    outs = _generate(tp2, None)
    assert token_ids(outs) == vanilla_tp2
    assert all(o.compression["compressions"] >= 3 and o.compression["tokens_dropped"] == 0 for o in outs)


@pytest.mark.tp
@pytest.mark.parametrize("method", list(SELECTIONS))
def test_selection_at_tp2_is_the_selection_at_tp1(tp2: Any, tp1: dict[str, list[Any]], method: str) -> None:
    """Each rank holds Hkv/2 KV heads and Hq/2 query heads; a round gathers all heads, so
    every method selects exactly what one rank would (random draws per (layer, head) from
    one stream; chunkkv ranks chunks by a layer-wide score)."""
    outs = _generate(tp2, SELECTIONS[method])
    assert token_ids(outs) == token_ids(tp1[method])
    for got, ref in zip(outs, tp1[method], strict=True):
        assert got.compression["compressions"] == ref.compression["compressions"] >= 3
        assert got.compression["physical_length"] == ref.compression["physical_length"]
        assert got.compression["blocks_freed"] == ref.compression["blocks_freed"] > 0


@pytest.mark.tp
def test_tp2_frees_blocks_and_leaks_nothing(tp2: Any) -> None:
    eng, sched = tp2.llm.llm_engine, scheduler_of(tp2)
    freed_before = sched.kv_totals.blocks_freed
    params = greedy(TOKENS, extra_args={"kvllm": SELECTIONS["kara"]})
    for i, prompt in enumerate(PROMPTS[:8]):
        eng.add_request(f"leak-{i}", prompt, params)
    step = peak = 0
    while eng.has_unfinished_requests():
        eng.step()
        step += 1
        peak = max(peak, block_pool_usage(sched)[0])
        if step in (3, 60):
            eng.abort_request([f"leak-{step % 7}"])
    assert sched.kv_totals.blocks_freed > freed_before
    assert block_pool_usage(sched)[0] == 0 < peak
    assert sched.kv_requests == {}
    eng.step()  # deliver the last finish notices to the workers
    assert ring_usage(tp2) == [(0, 64), (0, 64)]  # both ranks released every query-ring slot


def test_tp_that_does_not_divide_the_kv_heads_fails_before_start_up(tiny_model: str) -> None:
    from kvllm.vllm.llm import LLM

    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 .* must divide the model's 2 KV heads"):
        LLM(tiny_model, compression=KEEP_ALL, tensor_parallel_size=4)
