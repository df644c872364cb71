"""Requests refused where vLLM's frontend builds them, whichever way they came (issue 40)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvllm.config import CompressionConfig
from kvllm.vllm.frontend import RequestError, check_request
from tests.vllm.conftest import BASE, PROMPTS, greedy

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
