from __future__ import annotations

import pytest

from kvllm import CompressionConfig


def test_defaults_are_valid() -> None:
    cfg = CompressionConfig()
    assert cfg.budget == round(0.2 * 128)
    assert cfg.query_buffer_len == 128 + 32 + 16


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("method", "nope", "must be one of"),
        ("retention", 0.0, "(0, 1]"),
        ("retention", -0.5, "(0, 1]"),
        ("retention", 1.5, "(0, 1]"),
        ("retention", float("nan"), "(0, 1]"),
        ("window", 100, "multiple of block_size=32"),
        ("window", 0, "multiple of block_size=32"),
        ("buffer", 128, "[0, 127]"),
        ("buffer", -1, "[0, 127]"),
        ("period", 0, "[1, 128]"),
        ("period", 129, "[1, 128]"),
        ("block_size", 0, "[1, inf]"),
        ("policy", "sometimes", "periodic, threshold"),
        ("rho", 0.0, "(0, 1]"),
        ("beta", -1.0, ">= 0"),
        ("max_gap", -1, "[0, inf]"),
        ("obs_window", 0, "[1, 160]"),
        ("pool_kernel", 4, "odd"),
        ("chunk_size", 0, "[1, 128]"),
        ("pyramid_beta", 0.5, ">= 1"),
        ("adakv_floor", 1.5, "[0, 1]"),
        ("rkv_lambda", -0.1, "[0, 1]"),
        ("threshold_budget", 0, "[1, inf]"),
        ("threshold_interval", 0, "[1, inf]"),
        ("seed", -1, "[0, inf]"),
        ("window", 128.0, "multiple of block_size"),
        ("buffer", True, "integer"),
    ],
)
def test_invalid_values_name_field_value_and_range(field: str, value: object, fragment: str) -> None:
    with pytest.raises(ValueError) as err:
        CompressionConfig(**{field: value})
    message = str(err.value)
    assert f"CompressionConfig.{field}=" in message
    assert repr(value) in message
    assert fragment in message


def test_threshold_budget_must_exceed_window_under_threshold_policy() -> None:
    with pytest.raises(ValueError, match=r"threshold_budget=128 .*\[129, inf\]"):
        CompressionConfig(policy="threshold", threshold_budget=128)


def test_replace_validates() -> None:
    cfg = CompressionConfig()
    assert cfg.replace(retention=0.5).retention == 0.5
    with pytest.raises(ValueError, match="retention"):
        cfg.replace(retention=2.0)
