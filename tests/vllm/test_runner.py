"""A compression round that fails, in the worker or in the scheduler, is contained to its request."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

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


@pytest.fixture(scope="module")
def llm(tiny_model: str) -> Iterator[Any]:
    """One Kara engine for the module, not strict (strict mode raises on any refusal)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("KVLLM_STRICT", raising=False)
        with engine(tiny_model, KARA) as llm:
            yield llm


def test_a_failing_round_is_refused_for_its_request_and_the_engine_goes_on(
    llm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of plain, Kara and faulty requests: every plain and Kara request writes what
    it writes without the faulty ones, each faulty request is refused once (counted and
    logged) and runs on to its length uncompressed, and no block leaks."""
    monkeypatch.setitem(base._REGISTRY, Faulty.name, Faulty)
    prompts = PROMPTS[:6]
    kinds = ["off", "kara", "faulty", "kara", "faulty", "off"]
    extra = {"off": {"off": True}, "kara": {}, "faulty": {"method": "faulty"}}
    params = [greedy(96, extra_args={"kvllm": extra[k]}) for k in kinds]
    sched = scheduler(llm)
    before = sched.kv_totals.rounds_refused
    mixed = llm.generate(prompts, params)
    assert sched.kv_totals.rounds_refused - before == 2
    assert block_pool_usage(sched)[0] == 0
    rest = [i for i, k in enumerate(kinds) if k != "faulty"]
    alone = token_ids(llm.generate([prompts[i] for i in rest], [params[i] for i in rest]))
    again = llm.generate(prompts[:1], greedy(96))  # the engine still serves
    assert [token_ids(mixed)[i] for i in rest] == alone
    for out, kind in zip(mixed, kinds, strict=True):
        assert len(out.outputs[0].token_ids) == 96
        if kind == "faulty":  # its one round failed; it compressed no more
            assert out.compression["compressions"] == 1
        elif kind == "kara":
            assert out.compression["compressions"] > 1
    assert again[0].compression["compressions"] > 1


def test_a_policy_that_fails_to_plan_is_refused_before_anything_is_freed(
    llm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler's side: a policy that raises while planning one request's round
    refuses that round; the request runs on uncompressed and the others as before."""
    from kvllm.policy import PeriodicWindowPolicy

    odd = "zz " * 40 + PROMPTS[0]  # a prompt length no other prompt here has
    prompts = [PROMPTS[0], odd, PROMPTS[1]]
    expected = token_ids(llm.generate([PROMPTS[0], PROMPTS[1]], greedy(96)))
    odd_len = len(llm.llm.get_tokenizer()(odd)["input_ids"])
    plan = PeriodicWindowPolicy.plan

    def failing(self: PeriodicWindowPolicy, state: Any) -> Any:
        if state.prompt_len == odd_len:
            raise RuntimeError("injected planning fault")
        return plan(self, state)

    monkeypatch.setattr(PeriodicWindowPolicy, "plan", failing)
    sched = scheduler(llm)
    before = sched.kv_totals.rounds_refused
    outs = llm.generate(prompts, greedy(96))
    assert sched.kv_totals.rounds_refused - before == 1
    assert block_pool_usage(sched)[0] == 0
    assert outs[1].compression["compressions"] == 0 and len(outs[1].outputs[0].token_ids) == 96
    assert [token_ids(outs)[i] for i in (0, 2)] == expected
