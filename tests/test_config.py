from __future__ import annotations

import dataclasses

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
        ("admission", "fifo", "must be one of"),
        ("policy", "sometimes", "periodic, threshold"),
        ("threshold_budget", 0, "[1, inf]"),
        ("threshold_interval", 0, "[1, inf]"),
        ("params", [1], "mapping"),
        ("window", 128.0, "multiple of block_size"),
        ("buffer", True, "integer"),
        ("lazy", 0, "[1, inf]"),
        ("lazy", 1.5, "integer"),
        ("lazy_keep", -0.1, "[0, 1]"),
        ("lazy_keep", 1.5, "[0, 1]"),
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


def test_a_method_that_reads_every_keys_position_is_refused_under_the_threshold_policy() -> None:
    """A threshold round's span holds compacted history, whose keys are not at
    consecutive positions: compactor would un-rotate them at wrong ones."""
    with pytest.raises(ValueError, match=r"policy='threshold' is invalid: method 'compactor' reads every key"):
        CompressionConfig(method="compactor", policy="threshold", threshold_budget=512)
    CompressionConfig(method="compactor")  # its windows are uncompressed spans
    CompressionConfig(method="expected-attention", policy="threshold", threshold_budget=512)


def test_replace_validates() -> None:
    # Every field off its default, so a replace that rebuilt from defaults would show.
    cfg = CompressionConfig(
        method="snapkv", retention=0.1, window=64, buffer=16, period=8, block_size=16, policy="threshold",
        threshold_budget=200, threshold_interval=32, admission="projected", params={"obs_window": 70},
    )  # fmt: skip
    half = cfg.replace(retention=0.5)
    assert dataclasses.asdict(half) == {**dataclasses.asdict(cfg), "retention": 0.5}
    assert half.budget == 32 and cfg.budget == round(0.1 * 64) and cfg.retention == 0.1  # derived; cfg untouched
    assert half.method_params.obs_window == 70
    with pytest.raises(ValueError, match="retention"):
        cfg.replace(retention=2.0)
    # The method's params are checked again against the new window: 70 > W + b = 68.
    with pytest.raises(ValueError, match=r"CompressionConfig.params.obs_window=70 .*\[1, 68\]"):
        cfg.replace(buffer=4)


@pytest.mark.parametrize(
    ("method", "field", "value", "fragment"),
    [
        ("kara", "rho", 0.0, "(0, 1]"),
        ("kara", "beta", -1.0, ">= 0"),
        ("kara-causal", "max_gap", -1, "[0, inf]"),
        ("kara-far", "band", 0, "[1, 159]"),
        ("kara-late", "obs_window", 0, "[1, inf]"),
        ("snapkv", "obs_window", 0, "[1, 160]"),
        ("snapkv", "pool_kernel", 4, "odd"),
        ("chunkkv", "chunk_size", 0, "[1, 128]"),
        ("chunkkv", "chunk_size", 129, "[1, 128]"),
        ("pyramidkv", "beta", 0.5, ">= 1"),
        ("adakv", "floor", 1.5, "[0, 1]"),
        ("rkv", "lam", -0.1, "[0, 1]"),
        ("random", "seed", -1, "[0, inf]"),
    ],
)
def test_invalid_method_params_name_field_value_and_range(
    method: str, field: str, value: object, fragment: str
) -> None:
    with pytest.raises(ValueError) as err:
        CompressionConfig(method=method, params={field: value})
    message = str(err.value)
    assert f"CompressionConfig.params.{field}={value!r}" in message
    assert fragment in message


def test_unknown_method_param_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['rho'\] for method 'snapkv': valid: obs_window"):
        CompressionConfig(method="snapkv", params={"rho": 0.5})
    with pytest.raises(ValueError, match="it has none"):
        CompressionConfig(method="h2o", params={"rho": 0.5})


def test_params_resolve_to_the_method_dataclass() -> None:
    cfg = CompressionConfig(method="kara", params={"rho": 0.25})
    assert cfg.method_params.rho == 0.25 and cfg.method_params.beta == 1.0
    assert CompressionConfig(**dataclasses.asdict(cfg)) == cfg  # travels as plain JSON-ready fields
    assert cfg != CompressionConfig(method="kara")
    hash(cfg)  # usable as a dict key despite the params mapping


def test_replace_with_another_method_drops_the_old_methods_params() -> None:
    cfg = CompressionConfig(method="kara", params={"rho": 0.25})
    assert cfg.replace(method="snapkv").params == {}
    assert cfg.replace(retention=0.3).params == {"rho": 0.25}
    assert cfg.replace(method="chunkkv", params={"chunk_size": 8}).method_params.chunk_size == 8


@pytest.mark.parametrize(
    ("changes", "field", "fragment"),
    [
        ({"policy": "threshold"}, "lazy", "periodic policy"),
        ({"method": "pyramidkv"}, "lazy", "vary by layer and head"),
        ({"method": "random"}, "lazy_keep", "no single window score"),
    ],
)
def test_lazy_retention_is_refused_where_it_cannot_run(changes: dict, field: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=rf"CompressionConfig\.{field}=.*{fragment}"):
        CompressionConfig(lazy=2, **changes)


def test_lazy_retention_keeps_f_times_the_budget_at_first_at_most_a_window() -> None:
    assert CompressionConfig(lazy=2).lazy_first == 2 * 26
    assert CompressionConfig(lazy=2, retention=0.75).lazy_first == 128
    assert CompressionConfig().lazy_first == 26
    # A method without a single score runs lazily when the cut uses the later reads alone.
    assert CompressionConfig(method="random", lazy=2, lazy_keep=0.0).lazy == 2
