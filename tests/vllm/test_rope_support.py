"""Which models' RoPE the vLLM runner can hand to the methods that un-rotate keys."""

from __future__ import annotations

import pytest
from transformers import GPT2Config, GPTJConfig, LlamaConfig, Qwen2VLConfig, Qwen3Config

from kvllm.config import CompressionConfig
from kvllm.methods import available, method_class
from kvllm.vllm.rope_support import rope_problem
from kvllm.vllm.settings import ModelCheck, check_model


def test_neox_models_pass_and_others_are_named() -> None:
    assert rope_problem(Qwen3Config()) is None
    assert rope_problem(LlamaConfig()) is None
    assert "GPT-J-style" in rope_problem(GPTJConfig())
    assert "no RoPE" in rope_problem(GPT2Config())
    # Qwen2-VL's text model, as its published config gives its RoPE.
    vl = Qwen2VLConfig().get_text_config()
    vl.rope_parameters = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}
    assert "M-RoPE" in rope_problem(vl)


def test_only_the_methods_that_unrotate_keys_are_refused_on_gptj() -> None:
    readers = {name for name in available() if method_class(name).reads_rope}
    assert readers == {"compactor", "expected-attention", "kara-retain"}
    gptj = GPTJConfig()
    check_model(CompressionConfig(method="kara"), gptj, 1)
    check_model(CompressionConfig(method="snapkv"), gptj, 1)
    for method in ("compactor", "expected-attention"):
        with pytest.raises(ValueError, match=rf"kvllm.method='{method}' is invalid for this model: .*GPT-J"):
            check_model(CompressionConfig(method=method), gptj, 1)


def test_model_check_remembers_only_what_passed() -> None:
    check = ModelCheck(GPTJConfig(), 1)
    check(CompressionConfig(method="kara"))
    assert check.passed == {("kara", "{}")}
    for _ in range(2):  # a refusal is not remembered: it raises every time
        with pytest.raises(ValueError, match="compactor"):
            check(CompressionConfig(method="compactor"))
    assert len(check.passed) == 1
