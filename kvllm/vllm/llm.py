"""``kvllm.LLM``: a thin wrapper over ``vllm.LLM`` with KV compression."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvllm.config import CompressionConfig
from kvllm.generation import Generation, SeqStats
from kvllm.vllm import engine
from kvllm.vllm.settings import KEY, ModelCheck, check_parallel, engine_kwargs, request_config, worker_ranks


class LLM:
    """``vllm.LLM`` serving with KvLLM compression.

    Parameters
    ----------
    model
        Model path or name, as for ``vllm.LLM``.
    compression
        Engine-wide compression; ``None`` loads the plugin with compression off.
    **vllm_kwargs
        Any ``vllm.LLM`` argument; :func:`~kvllm.vllm.settings.engine_kwargs` adds
        KvLLM's scheduler, block size and ``additional_config``. With
        ``tensor_parallel_size > 1`` on a CPU with fewer NUMA nodes than worker ranks,
        ``VLLM_CPU_OMP_THREADS_BIND`` is set when unset (:func:`~kvllm.vllm.engine.bind_cpu_threads`).
    """

    def __init__(self, model: str, compression: CompressionConfig | None = None, **vllm_kwargs: Any) -> None:
        import vllm

        kwargs = engine_kwargs(compression, vllm_kwargs)
        if compression is not None:
            check_parallel(kwargs.get("tensor_parallel_size") or 1, engine.model_kv_heads(model))
        engine.bind_cpu_threads(worker_ranks(kwargs))
        self.compression = compression
        self.llm = vllm.LLM(model, **kwargs)
        self.model_check = ModelCheck.of(self.llm.llm_engine.vllm_config)

    def generate(self, prompts: Sequence[Any], sampling_params: Any = None, **kwargs: Any) -> list[Any]:
        """``vllm.LLM.generate``; each output also gets ``.compression`` (a stats dict or None).

        Per-request overrides go in ``SamplingParams.extra_args={"kvllm": {...}}`` and
        are validated here, against the served model too, before anything is submitted.
        """
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params]
        for p in params:
            if p is not None and (config := request_config(self.compression, p.extra_args)) is not None:
                if config is not self.compression:
                    self.model_check(config)
        outputs = self.llm.generate(prompts, sampling_params, **kwargs)
        for out in outputs:
            out.compression = (out.kv_transfer_params or {}).get(KEY)
        return outputs


def generate(
    model: str,
    prompts: Sequence[str],
    config: CompressionConfig | None,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_at_eos: bool = True,
    **vllm_kwargs: Any,
) -> Generation:
    """Generate continuations of ``prompts`` inside vLLM: ``kvllm.hf.generate``'s twin.

    The engine runs in fp32 with eager execution unless ``vllm_kwargs`` say otherwise:
    an engine started for a few prompts spends more compiling than compiled decoding
    gives back (docs/results/serving.md, "Compiled or eager"); :class:`LLM` itself
    follows vLLM's default.
    """
    from vllm import SamplingParams

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} is invalid: must be >= 1")
    kwargs = {"dtype": "float32", "enforce_eager": True, "gpu_memory_utilization": 0.3, "seed": seed, **vllm_kwargs}
    llm = LLM(model, compression=config, **kwargs)
    params = SamplingParams(
        max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, ignore_eos=not stop_at_eos
    )
    outputs = llm.generate(list(prompts), params, use_tqdm=False)
    stats = []
    for out in outputs:
        s = out.compression or {}
        logical = len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1
        stats.append(
            SeqStats(
                logical_length=s.get("logical_length", logical),
                physical_length=s.get("physical_length", logical),
                compressions=s.get("compressions", 0),
                compress_seconds=s.get("compress_seconds", 0.0),
            )
        )
    return Generation(
        texts=[o.outputs[0].text for o in outputs],
        token_ids=[list(o.outputs[0].token_ids) for o in outputs],
        stats=stats,
    )
