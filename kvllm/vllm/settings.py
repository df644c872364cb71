"""How compression settings travel through vLLM.

Engine-wide: ``additional_config={"kvllm": {<CompressionConfig fields>}}`` (reaches the
scheduler and the worker processes). Per request: ``SamplingParams.extra_args={"kvllm":
{...}}`` with any of ``method``, ``retention`` or ``off``; the OpenAI server takes the
same dict as ``extra_body={"kvllm": {...}}``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from kvllm.config import CompressionConfig
from kvllm.methods import method_class

KEY = "kvllm"
OVERRIDABLE = ("method", "retention", "off")


def engine_config(additional_config: Any) -> CompressionConfig | None:
    """The engine-wide config, or ``None`` when compression is not configured."""
    raw = (additional_config or {}).get(KEY) if isinstance(additional_config, dict) else None
    if raw is None:
        return None
    return check_paged(CompressionConfig(**raw))


def check_paged(config: CompressionConfig) -> CompressionConfig:
    """A paged engine keeps one block table per request: counts must match across heads."""
    if not method_class(config.method).uniform:
        raise ValueError(
            f"CompressionConfig.method={config.method!r} is invalid in vLLM: its per-layer/head budgets "
            "differ, which one block table cannot hold; use it with the hf backend"
        )
    return config


def request_config(base: CompressionConfig | None, extra_args: dict[str, Any] | None) -> CompressionConfig | None:
    """The effective config of one request: ``base`` with its overrides applied.

    Raises ``ValueError`` naming the bad field for an unknown key or invalid value.
    """
    raw = (extra_args or {}).get(KEY)
    if raw is None:
        return base
    if isinstance(raw, str):  # the OpenAI server forwards it as a JSON string (vllm_xargs)
        try:
            raw = json.loads(raw)
        except ValueError as err:
            raise ValueError(f"{KEY} must be a JSON object: {err}") from err
    if not isinstance(raw, dict):
        raise ValueError(f"{KEY} must be an object with any of {', '.join(OVERRIDABLE)}, got {raw!r}")
    unknown = set(raw) - set(OVERRIDABLE)
    if unknown:
        raise ValueError(f"{KEY}: unknown field(s) {sorted(unknown)}; allowed: {', '.join(OVERRIDABLE)}")
    off = raw.get("off", False)
    if not isinstance(off, bool):
        raise ValueError(f"{KEY}.off={off!r} is invalid: must be true or false")
    if off:
        return None
    changes = {k: v for k, v in raw.items() if k != "off"}
    if base is None:
        if changes:
            raise ValueError(f"{KEY}: this engine was started without compression; per-request overrides need it")
        return None
    return check_paged(dataclasses.replace(base, **changes)) if changes else base


def as_additional_config(config: CompressionConfig) -> dict[str, Any]:
    return {KEY: dataclasses.asdict(config)}
