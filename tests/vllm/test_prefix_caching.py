"""Prefix caching with compression: prompt blocks shared as vLLM shares them, rewritten
blocks never cached, and nothing else changes (docs/design.md, "Prefix caching")."""

from __future__ import annotations

from typing import Any

from kvllm.config import CompressionConfig
from kvllm.vllm.engine import block_pool_usage
from kvllm.vllm.engine import scheduler_of as scheduler
from tests.vllm.conftest import PROMPTS, engine, greedy, token_ids
from tests.vllm.test_engine import _step_all

KEEP_ALL = CompressionConfig(window=32, buffer=8, period=4, retention=1.0)
KARA = CompressionConfig(window=32, buffer=8, period=4, retention=0.2)
CACHING = {"enable_prefix_caching": True}
# A shared system prompt of several 32-token blocks, then each request's own question.
SYSTEM = "you are a careful solver: read every value, write each step, check the sum. " * 6
SHARED = [SYSTEM + p for p in PROMPTS[:12]]


def _twice(llm: Any, n: int) -> tuple[list[Any], list[Any]]:
    """The shared-prefix prompts together (the first fills the cache), then again (all hit)."""
    return llm.generate(SHARED, greedy(n)), llm.generate(SHARED, greedy(n))


def _hits(outputs: list[Any]) -> int:
    return sum(o.num_cached_tokens or 0 for o in outputs)


def test_keep_all_with_prefix_caching_matches_vanilla_with_prefix_caching(tiny_model: str) -> None:
    with engine(tiny_model, None, plugin=False, **CACHING) as vanilla:
        first, again = _twice(vanilla, 120)
    with engine(tiny_model, KEEP_ALL, **CACHING) as llm:
        got_first, got_again = _twice(llm, 120)
        assert scheduler(llm).kv_totals.rounds > 0
    assert token_ids(got_first) == token_ids(first)
    assert token_ids(got_again) == token_ids(again)
    # The second pass reads every full block of the shared prompt from the cache.
    assert _hits(got_again) >= len(SHARED) * (len(got_again[0].prompt_token_ids) // 32 - 1) * 32
    assert _hits(got_again) == _hits(again)


def test_a_request_that_hits_the_cache_compresses_as_one_that_computed_its_prompt(tiny_model: str) -> None:
    with engine(tiny_model, KARA) as llm:
        cold_first, cold_again = _twice(llm, 160)
    with engine(tiny_model, KARA, **CACHING) as llm:
        warm_first, warm_again = _twice(llm, 160)
    assert _hits(warm_again) > 0 and _hits(cold_again) == 0
    for cold, warm in ((cold_first, warm_first), (cold_again, warm_again)):
        assert token_ids(warm) == token_ids(cold)
        stats = [(o.compression["compressions"], o.compression["physical_length"]) for o in warm]
        assert stats == [(o.compression["compressions"], o.compression["physical_length"]) for o in cold]
        assert all(s[0] >= 3 for s in stats)


def test_rounds_never_rewrite_a_cached_block(tiny_model: str) -> None:
    """After every step: no block past a compressing request's full prompt blocks is
    hashed, and every hashed block is a prompt block of some request."""
    with engine(tiny_model, KARA, **CACHING) as llm:
        eng, sched = llm.llm.llm_engine, scheduler(llm)
        blocks = sched.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks
        for i, p in enumerate(SHARED):
            eng.add_request(str(i), p, greedy(160))
        checked = 0
        while eng.has_unfinished_requests():
            eng.step()
            for request in sched.running:
                prompt_blocks = request.num_prompt_tokens // sched.block_size
                held = blocks.get(request.request_id, [])
                assert all(b.block_hash is None for b in held[prompt_blocks:])
                checked += len(held[prompt_blocks:])
        assert sched.kv_totals.rounds > 0 and checked > 0


def test_no_leaks_with_a_shared_prefix_under_aborts_and_preemption(tiny_model: str) -> None:
    with engine(tiny_model, KARA, num_gpu_blocks_override=40, **CACHING) as llm:
        result = _step_all(llm, SHARED + PROMPTS[:8], greedy(200), abort_at={0: 3, 5: 40, 9: 90, 15: 150})
        sched = scheduler(llm)
        assert sched.kv_totals.preemptions > 0 and sched.kv_totals.rounds > 0
        assert _hits(list(result["outputs"].values())) > 0
        # Cached blocks no request holds are free (vLLM evicts them on demand).
        assert block_pool_usage(sched)[0] == 0
        assert sched.kv_requests == {}
