"""``kvllm.LLM``: a thin wrapper over ``vllm.LLM`` with KV compression."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvllm.config import CompressionConfig
from kvllm.vllm.settings import KEY, as_additional_config, check_paged, request_config

SCHEDULER = "kvllm.vllm.scheduler.KaraScheduler"


def engine_kwargs(compression: CompressionConfig | None, vllm_kwargs: dict[str, Any]) -> dict[str, Any]:
    """vLLM engine arguments that load KvLLM with ``compression`` (or none)."""
    kwargs = dict(vllm_kwargs)
    kwargs.setdefault("scheduler_cls", SCHEDULER)
    if compression is None:
        return kwargs
    check_paged(compression)
    if kwargs.get("enable_prefix_caching"):
        raise ValueError(
            "enable_prefix_caching=True is invalid with KV compression: compacted blocks must never be shared"
        )
    kwargs["enable_prefix_caching"] = False
    block_size = kwargs.setdefault("block_size", compression.block_size)
    if compression.window % block_size:
        raise ValueError(
            f"CompressionConfig.window={compression.window} is invalid: must be a positive multiple of "
            f"vLLM's block_size={block_size}"
        )
    kwargs["additional_config"] = {**(kwargs.get("additional_config") or {}), **as_additional_config(compression)}
    return kwargs


class LLM:
    """``vllm.LLM`` serving with KvLLM compression.

    Parameters
    ----------
    model
        Model path or name, as for ``vllm.LLM``.
    compression
        Engine-wide compression; ``None`` loads the plugin with compression off.
    **vllm_kwargs
        Any ``vllm.LLM`` argument.
    """

    def __init__(self, model: str, compression: CompressionConfig | None = None, **vllm_kwargs: Any) -> None:
        import vllm

        self.compression = compression
        self.llm = vllm.LLM(model, **engine_kwargs(compression, vllm_kwargs))

    def generate(self, prompts: Sequence[Any], sampling_params: Any = None, **kwargs: Any) -> list[Any]:
        """``vllm.LLM.generate``; each output also gets ``.compression`` (a stats dict or None).

        Per-request overrides go in ``SamplingParams.extra_args={"kvllm": {...}}`` and
        are validated here, before anything is submitted.
        """
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params]
        for p in params:
            if p is not None:
                request_config(self.compression, p.extra_args)
        outputs = self.llm.generate(prompts, sampling_params, **kwargs)
        for out in outputs:
            out.compression = (out.kv_transfer_params or {}).get(KEY)
        return outputs
