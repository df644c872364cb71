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


# A block-aligned prompt of four blocks, prefilled in chunks of 127 tokens: the first chunk
# ends one token short of the prompt.
ALIGNED = list(range(100, 100 + 4 * 32))
CHUNKED = {**CACHING, "enable_chunked_prefill": True, "max_num_batched_tokens": 127, "max_model_len": 1024}


def _compress_then_follow(llm: Any, follow: Any) -> list[list[int]]:
    """Request A (compressing, 240 tokens) on ALIGNED, then B (ALIGNED plus 20 tokens, ``follow``)."""
    from vllm.inputs import TokensPrompt

    llm.generate([TokensPrompt(prompt_token_ids=ALIGNED)], greedy(240))
    out = llm.generate([TokensPrompt(prompt_token_ids=ALIGNED + list(range(300, 320)))], follow)
    assert out[0].num_cached_tokens == len(ALIGNED)  # B read A's prompt blocks from the cache
    return token_ids(out)


def test_a_chunk_ending_one_token_short_of_the_prompt_never_rewrites_its_cached_blocks(tiny_model: str) -> None:
    """A chunk that ends at P - 1 leaves one prompt token for a one-token step, which
    looks like decoding; the prompt's last slot must stay protected all the same, or the
    round rewrites a hashed prompt block that B then reads."""
    with engine(tiny_model, None, plugin=False, **CHUNKED) as vanilla:
        expected = _compress_then_follow(vanilla, greedy(60))
    with engine(tiny_model, KARA, **CHUNKED) as llm:
        got = _compress_then_follow(llm, greedy(60, extra_args={"kvllm": {"off": True}}))
        assert scheduler(llm).kv_totals.rounds > 0
    assert got == expected


def test_a_recomputed_request_never_matches_cached_blocks_past_its_prompt(tiny_model: str) -> None:
    """Requests with compression off cache their generated blocks. A compressing request
    recomputed after preemption, with the same prompt and the same tokens (keep-all
    writes vanilla's), would match them and its catch-up rounds would rewrite them: its
    hit is capped at its prompt's full blocks."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from kvllm.vllm.scheduler import CONFIG, RECOMPUTE

    prompts = PROMPTS[:10]
    off = greedy(200, extra_args={"kvllm": {"off": True}})
    with engine(tiny_model, KEEP_ALL, num_gpu_blocks_override=40, **CACHING) as llm:
        sched = scheduler(llm)
        manager = sched.kv_cache_manager
        capped = type(manager).get_computed_blocks
        seen: list[tuple[int, int, int]] = []

        def recording(request: Any) -> Any:
            uncapped = KVCacheManager.get_computed_blocks(manager, request)[1]
            out = capped(manager, request)
            if getattr(request, RECOMPUTE, False) and getattr(request, CONFIG) is not None:
                seen.append((request.num_prompt_tokens, uncapped, out[1]))
            return out

        manager.get_computed_blocks = recording
        # Each prompt twice, its compression-off request first: the compressing ones come
        # later, so they are the ones preempted, while the off requests hold and cache theirs.
        outs = llm.generate([p for p in prompts for _ in range(2)], [off, greedy(200)] * len(prompts))
        assert sched.kv_totals.preemptions > 0 and sched.kv_totals.rounds > 0
    got = token_ids(outs)
    assert got[1::2] == got[0::2]
    # Some recomputations found the off requests' generated blocks; none was given them.
    assert any(uncapped > prompt for prompt, uncapped, _ in seen), seen
    assert all(hit <= prompt for prompt, _, hit in seen), seen
