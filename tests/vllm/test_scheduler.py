"""The scheduler's shared-block invariant: a round rewrites only blocks its request alone
holds, unhashed, checked before every round."""

from __future__ import annotations

import logging
from functools import partial
from types import SimpleNamespace

import pytest

from kvllm.policy import Region
from kvllm.vllm.scheduler import STRICT_ENV, CompressingScheduler, CompressionTotals, unsafe_blocks


def _block(ref_cnt: int = 1, hashed: bool = False) -> SimpleNamespace:
    return SimpleNamespace(ref_cnt=ref_cnt, block_hash=b"h" if hashed else None)


def test_unsafe_blocks_are_the_shared_or_hashed_ones_the_span_touches() -> None:
    blocks = [_block(2, True), _block(1, True), _block(), _block(2), _block()]
    assert unsafe_blocks(blocks, 64, 160, 32) == [3]  # slots 64-159: blocks 2-4
    assert unsafe_blocks(blocks, 63, 96, 32) == [1]  # one slot of block 1 is enough
    assert unsafe_blocks(blocks, 0, 32, 32) == [0]
    assert unsafe_blocks(blocks, 128, 160, 32) == []
    assert unsafe_blocks(blocks, 64, 96, 32) == []


def _scheduler(blocks: list[SimpleNamespace]) -> SimpleNamespace:
    manager = SimpleNamespace(req_to_blocks={"r": blocks})
    coordinator = SimpleNamespace(single_type_managers=[manager])
    sched = SimpleNamespace(
        kv_cache_manager=SimpleNamespace(coordinator=coordinator), block_size=32, kv_totals=CompressionTotals()
    )
    sched._refuse = partial(CompressingScheduler._refuse, sched)
    return sched


def test_a_round_on_a_shared_block_is_refused_counted_and_logged_with_its_request(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(STRICT_ENV, "0")
    sched = _scheduler([_block(), _block(2), _block()])
    request = SimpleNamespace(request_id="r")
    region = Region(start=40, n_compress=32, span=40, n_queries=40, budget=6)
    with caplog.at_level(logging.WARNING, logger="kvllm.vllm.scheduler"):
        assert not CompressingScheduler._safe(sched, request, region, 80)
        assert not CompressingScheduler._safe(sched, request, region, 80)
    assert sched.kv_totals.rounds_refused == 2
    # Each is logged, naming the request (a refused request compresses no more, so at most once each).
    logged = [r.getMessage() for r in caplog.records if "shared or cached blocks [1]" in r.getMessage()]
    assert len(logged) == 2 and all(m.startswith("request r:") for m in logged)
    # The same round on blocks the request alone holds runs.
    assert CompressingScheduler._safe(_scheduler([_block(2), _block(), _block()]), request, region, 80)


def test_under_strict_a_refused_round_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STRICT_ENV, "1")
    sched = _scheduler([_block(), _block(1, hashed=True), _block()])
    region = Region(start=40, n_compress=32, span=40, n_queries=40, budget=6)
    with pytest.raises(AssertionError, match="shared or cached blocks"):
        CompressingScheduler._safe(sched, SimpleNamespace(request_id="r"), region, 80)


def test_after_a_refused_round_a_request_compresses_no_more_and_keeps_its_slots(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refused region would be planned again every period: the request stops
    compressing instead, counted once, and its slots dropped so far still reach the worker."""
    from kvllm.config import CompressionConfig
    from kvllm.vllm import scheduler as module
    from kvllm.vllm.engine import scheduler_of
    from tests.vllm.conftest import PROMPTS, engine, greedy

    monkeypatch.setenv(STRICT_ENV, "0")
    refuse = {"on": False}
    real = module.unsafe_blocks
    monkeypatch.setattr(module, "unsafe_blocks", lambda *a: [0] if refuse["on"] else real(*a))
    with engine(tiny_model, CompressionConfig(window=32, buffer=8, period=4, retention=0.2)) as llm:
        eng, sched = llm.llm.llm_engine, scheduler_of(llm)
        eng.add_request("0", PROMPTS[0], greedy(200))
        out = None
        while eng.has_unfinished_requests():
            refuse["on"] = sched.kv_totals.rounds >= 1
            for o in eng.step():
                out = o if o.finished else out
        assert sched.kv_totals.rounds == 1 and sched.kv_totals.rounds_refused == 1
    stats = out.kv_transfer_params["kvllm"]
    assert len(out.outputs[0].token_ids) == 200
    assert stats["compressions"] == 1 and stats["tokens_dropped"] > 0
    assert stats["physical_length"] == stats["logical_length"] - stats["tokens_dropped"]
