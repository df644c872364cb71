"""A compression round that fails in the worker is contained to its request."""

from __future__ import annotations

import pytest

from kvllm.config import CompressionConfig
from kvllm.methods import Method, Selection, Window, base
from kvllm.vllm.engine import block_pool_usage
from kvllm.vllm.engine import scheduler_of as scheduler
from tests.vllm.conftest import PROMPTS, engine, greedy, token_ids

KARA = CompressionConfig(window=32, buffer=8, period=4, retention=0.2)


class Faulty(Method):
    """A method whose selection raises, as a bug or a model it cannot run would."""

    name = "faulty"

    def select(self, window: Window, budget: int) -> Selection:
        raise RuntimeError("injected fault")


def test_a_failing_round_is_refused_for_its_request_and_the_engine_goes_on(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of plain, Kara and faulty requests: every plain and Kara request writes what
    it writes without the faulty ones, each faulty request is refused once (counted and
    logged) and runs on to its length uncompressed, and no block leaks."""
    monkeypatch.setitem(base._REGISTRY, Faulty.name, Faulty)
    monkeypatch.delenv("KVLLM_STRICT", raising=False)  # strict mode raises on any refusal
    prompts = PROMPTS[:6]
    kinds = ["off", "kara", "faulty", "kara", "faulty", "off"]
    extra = {"off": {"off": True}, "kara": {}, "faulty": {"method": "faulty"}}
    params = [greedy(96, extra_args={"kvllm": extra[k]}) for k in kinds]
    with engine(tiny_model, KARA) as llm:
        mixed = llm.generate(prompts, params)
        sched = scheduler(llm)
        refused = sched.kv_totals.rounds_refused
        assert block_pool_usage(sched)[0] == 0
        rest = [i for i, k in enumerate(kinds) if k != "faulty"]
        alone = token_ids(llm.generate([prompts[i] for i in rest], [params[i] for i in rest]))
        again = llm.generate(prompts[:1], greedy(96))  # the engine still serves
    assert refused == 2
    assert [token_ids(mixed)[i] for i in rest] == alone
    for out, kind in zip(mixed, kinds, strict=True):
        assert len(out.outputs[0].token_ids) == 96
        if kind == "faulty":  # its one round failed; it compressed no more
            assert out.compression["compressions"] == 1
        elif kind == "kara":
            assert out.compression["compressions"] > 1
    assert again[0].compression["compressions"] > 1
