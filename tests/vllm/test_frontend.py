"""Requests refused where vLLM's frontend builds them, whichever way they came."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvllm.config import CompressionConfig
from kvllm.vllm.engine import scheduler_of
from kvllm.vllm.frontend import RequestError, check_request
from tests.vllm.conftest import BASE, PROMPTS, engine, greedy

KARA = CompressionConfig(window=32, buffer=8, period=4, retention=0.2)


def _request(extra_args: dict | None = None, resumable: bool = False, prompt: int = 8) -> SimpleNamespace:
    return SimpleNamespace(
        prompt_token_ids=list(range(prompt)),
        sampling_params=SimpleNamespace(extra_args=extra_args),
        resumable=resumable,
    )


def test_check_request_names_what_it_refuses() -> None:
    check_request(KARA, _request({"kvllm": {"retention": 0.5}}))
    with pytest.raises(RequestError, match="retention=0"):
        check_request(KARA, _request({"kvllm": {"retention": 0}}))
    with pytest.raises(RequestError, match="unknown field"):
        check_request(KARA, _request({"kvllm": '{"window": 64}'}))  # vllm_xargs' JSON string form
    with pytest.raises(RequestError, match="streaming-input"):
        check_request(KARA, _request(resumable=True))
    check_request(KARA, _request({"kvllm": {"off": True}}, resumable=True))
    check_request(None, _request(resumable=True))
    with pytest.raises(RequestError, match="at least 5"):
        check_request(KARA, _request(prompt=4), min_prompt_tokens=5)
    # Not guarded: prompt embeddings (no ids) and a streaming session's pieces (its sentinel).
    embeds = _request(prompt=0)
    embeds.prompt_token_ids = None
    check_request(KARA, embeds, min_prompt_tokens=5)
    check_request(KARA, _request({"kvllm": {"off": True}}, resumable=True, prompt=1), min_prompt_tokens=5)
    # vLLM answers it with HTTP 400; Python callers catch a ValueError.
    assert issubclass(RequestError, ValueError)


def test_plain_vllm_with_the_plugin_refuses_a_bad_override(tiny_model: str) -> None:
    """``vllm.LLM`` with KvLLM's engine settings, no ``kvllm.LLM`` in between: the bad
    override fails the call instead of silently running the request uncompressed."""
    import vllm

    from kvllm.vllm.settings import engine_kwargs

    llm = vllm.LLM(tiny_model, **engine_kwargs(KARA, BASE))
    try:
        with pytest.raises(ValueError, match="retention=0"):
            llm.generate(PROMPTS[:1], greedy(8, extra_args={"kvllm": {"retention": 0}}))
        assert len(llm.generate(PROMPTS[:1], greedy(8, extra_args={"kvllm": {"retention": 0.5}}))) == 1
    finally:
        from kvllm.vllm.engine import shutdown

        shutdown(llm)


@pytest.fixture(scope="module")
def gptj_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from kvllm.testing import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("tiny-gptj"), arch="gptj", seed=2, hidden_size=128, heads=4))


def test_a_gptj_model_refuses_what_it_cannot_run_and_serves_the_rest(gptj_model: str) -> None:
    """A model whose RoPE rotates interleaved pairs (GPT-J): the methods that un-rotate keys
    are refused at start-up engine-wide and at the door per request, naming the reason,
    and the engine goes on serving; its KV memory is free for the next engine."""
    from kvllm.vllm.llm import LLM

    with pytest.raises(ValueError, match=r"kvllm.method='compactor' is invalid for this model: .*GPT-J"):
        LLM(gptj_model, compression=KARA.replace(method="compactor"), **BASE)
    prompts = PROMPTS[:3]
    plain = [greedy(48, extra_args={"kvllm": {"off": True}}), greedy(48), greedy(48)]
    with engine(gptj_model, KARA) as llm:
        for method in ("compactor", "expected-attention"):
            bad = greedy(48, extra_args={"kvllm": {"method": method}})
            with pytest.raises(ValueError, match=rf"kvllm.method='{method}' is invalid for this model"):
                llm.generate(prompts, [*plain[:2], bad])
            # The same check where vLLM's frontend builds the request (HTTP 400 in a server).
            with pytest.raises(RequestError, match=method):
                llm.llm.generate(prompts[:1], bad)
        outs = llm.generate(prompts, plain)
        assert [len(o.outputs[0].token_ids) for o in outs] == [48] * 3
        assert outs[0].compression["compressions"] == 0 and outs[1].compression["compressions"] > 0
        assert scheduler_of(llm).kv_totals.rounds_refused == 0
