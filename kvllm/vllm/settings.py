"""How compression settings travel through vLLM, and the one builder of engine settings.

Engine-wide: ``additional_config={"kvllm": {<CompressionConfig fields>}}`` (reaches the
scheduler and the worker processes). Per request: ``SamplingParams.extra_args={"kvllm":
{...}}`` with any of :data:`OVERRIDABLE`; the OpenAI server takes the same dict as
``extra_body={"kvllm": {...}}``.

:func:`engine_kwargs` is the only place that turns a config into vLLM engine arguments:
``kvllm.LLM`` passes them to ``vllm.LLM``, ``kvllm serve`` turns them into argv with
:func:`to_argv`, and the benchmarks go through ``kvllm.LLM``. :func:`check_engine` is the
only place that checks a config against an engine; the scheduler calls it too, for
engines started with vLLM's own flags.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from kvllm.config import CompressionConfig
from kvllm.methods import build, calibrated, method_class
from kvllm.vllm.rope_support import rope_problem

KEY = "kvllm"
OVERRIDABLE = ("method", "retention", "params", "lazy", "lazy_keep", "off")
SCHEDULER = "kvllm.vllm.scheduler.CompressingScheduler"


def engine_config(additional_config: Any) -> CompressionConfig | None:
    """The engine-wide config, or ``None`` when compression is not configured."""
    raw = (additional_config or {}).get(KEY) if isinstance(additional_config, dict) else None
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"additional_config.{KEY} must be an object of CompressionConfig fields, got {raw!r}")
    fields = {f.name for f in dataclasses.fields(CompressionConfig)}
    unknown = sorted(set(raw) - fields)
    if unknown:
        raise ValueError(f"additional_config.{KEY} has unknown field(s) {unknown}; valid: {', '.join(sorted(fields))}")
    return check_paged(CompressionConfig(**raw))


def check_paged(config: CompressionConfig) -> CompressionConfig:
    """A paged engine keeps one block table per request: counts must match across heads."""
    if not method_class(config.method).uniform:
        raise ValueError(
            f"CompressionConfig.method={config.method!r} is invalid in vLLM: its per-layer/head budgets "
            "differ, which one block table cannot hold; use it with the hf backend"
        )
    return config


def check_engine(config: CompressionConfig, block_size: int) -> CompressionConfig:
    """``config`` fitted to an engine: its block size.

    Returns ``config`` with ``block_size`` set to the engine's. Raises ``ValueError``
    naming the parameter when the two cannot work together. Prefix caching works with
    compression (the scheduler caches a compressing request's prompt blocks only).
    """
    if config.window % block_size:
        raise ValueError(
            f"CompressionConfig.window={config.window} is invalid: must be a positive multiple of "
            f"vLLM's block_size={block_size}"
        )
    return check_paged(config if config.block_size == block_size else config.replace(block_size=block_size))


def check_parallel(tensor_parallel_size: int, kv_heads: int | None) -> None:
    """Compression compacts whole KV heads on each tensor-parallel rank: ``tensor_parallel_size``
    must divide the model's KV heads (vLLM would otherwise replicate them across ranks)."""
    if tensor_parallel_size > 1 and kv_heads is not None and kv_heads % tensor_parallel_size:
        divisors = [d for d in range(1, kv_heads + 1) if kv_heads % d == 0]
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} (--tensor-parallel-size) is invalid with KV compression: "
            f"must divide the model's {kv_heads} KV heads, so that each rank compacts whole heads of its own; "
            f"use one of {divisors}"
        )


def check_vllm_config(vllm_config: Any) -> CompressionConfig | None:
    """The engine-wide config of a vLLM ``VllmConfig``, checked against that engine.

    The one check of an engine as vLLM built it, whichever way it was started: the plugin
    runs it in the process that creates the config (before any engine process starts, so
    that ``vllm.LLM(...)`` and vLLM's own server fail there, naming the field), and the
    scheduler runs it again in the EngineCore. Returns the config with the engine's block
    size, or ``None`` without a ``kvllm`` config.
    """
    config = engine_config(vllm_config.additional_config)
    if config is None:
        return None
    scheduler = vllm_config.scheduler_config.get_scheduler_cls()
    # By name along the MRO, not issubclass: the scheduler imports this module, and the
    # dependency runs one way.
    lineage = {f"{c.__module__}.{c.__qualname__}" for c in getattr(scheduler, "__mro__", ())}
    if SCHEDULER not in lineage:
        raise ValueError(
            f"additional_config.{KEY} is set but scheduler_cls={getattr(scheduler, '__qualname__', scheduler)} "
            f"is not KvLLM's scheduler: compression would never run; start vLLM with scheduler_cls={SCHEDULER!r} "
            f"(--scheduler-cls {SCHEDULER})"
        )
    check_features(vllm_config)
    cache = vllm_config.cache_config
    config = check_engine(config, cache.block_size)
    tp = vllm_config.parallel_config.tensor_parallel_size
    check_parallel(tp, vllm_config.model_config.get_total_num_kv_heads())
    check_model(config, vllm_config.model_config.hf_config, tp)
    return config


def check_features(vllm_config: Any) -> None:
    """Refuse, naming the setting, every engine feature a compression round would make
    silently wrong (docs/design.md, "What is supported").

    A round rewrites a request's own blocks in place on the worker, scored with queries
    the worker captured one decode token at a time, and the scheduler counts physical
    slots per request. Whatever breaks one of those assumptions is refused here, before
    any engine process starts.
    """
    from vllm.platforms import current_platform

    from kvllm.vllm.paged import READABLE_ISAS, attention_isa

    def refuse(setting: str, why: str) -> None:
        raise ValueError(f"{setting} is not supported with KV compression: {why}")

    if not current_platform.is_cpu():
        refuse(
            f"platform {current_platform.device_name!r}",
            "KvLLM's worker side (compaction, query capture) exists for vLLM's CPU model runner only",
        )
    if vllm_config.use_v2_model_runner:
        refuse(
            "VLLM_USE_V2_MODEL_RUNNER=1 (Model Runner V2)",
            "KvLLM's compacting runner extends the V1 CPU model runner; unset it or set VLLM_USE_V2_MODEL_RUNNER=0",
        )
    if vllm_config.speculative_config is not None:
        refuse(
            "speculative decoding (--speculative-config)",
            "a step that accepts several tokens skips the period's rounds and outgrows the query ring",
        )
    if vllm_config.kv_transfer_config is not None:
        refuse("a KV connector (--kv-transfer-config)", "a connector would save or load blocks that rounds rewrite")
    cache_dtype = vllm_config.cache_config.cache_dtype
    model_dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
    if cache_dtype not in ("auto", model_dtype):
        refuse(
            f"kv_cache_dtype={cache_dtype!r} (--kv-cache-dtype)",
            f"rounds read and write the cache in the model's dtype ({model_dtype}); use --kv-cache-dtype auto",
        )
    if vllm_config.scheduler_config.async_scheduling:
        refuse(
            "async scheduling (--async-scheduling)",
            "the scheduler plans a round while the previous step's tokens are still in flight",
        )
    parallel = vllm_config.parallel_config
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(parallel, name, 1) > 1:
            refuse(
                f"{name}={getattr(parallel, name)} (--{name.replace('_', '-')})",
                "context parallelism interleaves a request's slots across ranks, and a round rewrites them in place",
            )
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        refuse(
            f"pipeline_parallel_size={vllm_config.parallel_config.pipeline_parallel_size} (--pipeline-parallel-size)",
            "a round selects per layer on one rank; untested across pipeline stages; use 1",
        )
    text = vllm_config.model_config.hf_config.get_text_config()
    if getattr(text, "num_kv_shared_layers", 0):
        refuse(
            f"cross-layer KV sharing (num_kv_shared_layers={text.num_kv_shared_layers} in the model's config)",
            "a round rewrites each layer's cache in place, and a shared one would be compacted once per layer "
            "that reads it",
        )
    isa = attention_isa(vllm_config)
    if isa not in READABLE_ISAS:
        refuse(
            f"vLLM's CPU attention ISA {isa!r} (this CPU, dtype and block size)",
            f"rounds read the paged cache's layout for ISAs {', '.join(READABLE_ISAS)}; "
            "with AMX, run the model in float32 (--dtype float32), or with a block size that is not a multiple of 32",
        )


def check_kv_cache(kv_cache_config: Any) -> None:
    """One KV cache group of plain full attention: a round rewrites every layer through
    the first group's block table, and slots count physical tokens. Known only once vLLM
    has laid out the cache, so the scheduler checks it as the engine starts."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(
            f"a model with {len(groups)} KV cache groups (hybrid or mixed sliding-window attention) is not "
            "supported with KV compression: a round rewrites every layer through one block table"
        )
    spec = groups[0].kv_cache_spec
    windowed = getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None)
    if type(spec) is not FullAttentionSpec or windowed:
        raise ValueError(
            f"KV cache spec {type(spec).__name__}"
            f"{f' (window {windowed})' if windowed else ''} is not supported with KV compression: "
            "only full attention, whose slots hold physical tokens with no window of their own"
        )


def check_kv_sharing(layers: Any) -> None:
    """Refuse cross-layer KV sharing: layers that read another layer's KV cache tensor.

    A round rewrites each layer's cache in place, so a tensor that several layers read
    would be compacted once per reader. The worker checks the loaded model's attention
    layers (vLLM's ``kv_sharing_target_layer_name``), at start-up, before any request;
    :func:`check_features` refuses the config fields that announce it earlier."""
    shared = sorted(
        f"{layer.layer_name} -> {target}"
        for layer in layers
        if (target := getattr(layer, "kv_sharing_target_layer_name", None)) is not None
    )
    if shared:
        raise ValueError(
            f"cross-layer KV sharing ({len(shared)} layers read another layer's KV cache, e.g. {shared[0]}) "
            "is not supported with KV compression: a round rewrites each layer's cache in place, and a shared "
            "one would be compacted once per layer that reads it"
        )


def check_model(config: CompressionConfig, hf_config: Any, tensor_parallel_size: int) -> None:
    """``config``'s method can run on this model in vLLM: a calibration file is this model's,
    and a method that un-rotates keys gets a RoPE table it can read. Checked for the
    engine's config before any engine process starts, and for each request's override
    where the request enters (:class:`ModelCheck`), rather than at a round, in a worker."""
    method = build(config)
    method.check_model(hf_config)
    if method.reads_rope and (problem := rope_problem(hf_config)) is not None:
        raise ValueError(
            f"{KEY}.method={config.method!r} is invalid for this model: it scores keys before their RoPE "
            f"rotation, and {problem}, which the vLLM runner cannot undo (it reads neox-style RoPE only); "
            "use a method that reads no RoPE table, such as kara or snapkv"
        )
    if calibrated(config.method) and tensor_parallel_size > 1:
        raise ValueError(
            f"{KEY}.method={config.method!r} is invalid with tensor_parallel_size={tensor_parallel_size}: its "
            "calibration file holds every KV head, and a rank's windows hold a share of them; use "
            "--tensor-parallel-size 1"
        )


class ModelCheck:
    """:func:`check_model` against one engine's model, remembered per method and parameters
    that passed: a request's override is checked as it enters, and most repeat one."""

    def __init__(self, hf_config: Any, tensor_parallel_size: int) -> None:
        self.hf_config, self.tensor_parallel_size = hf_config, tensor_parallel_size
        self.passed: set[tuple[str, str]] = set()

    def __call__(self, config: CompressionConfig) -> None:
        key = (config.method, json.dumps(config.params, sort_keys=True, default=str))
        if key not in self.passed:
            check_model(config, self.hf_config, self.tensor_parallel_size)
            self.passed.add(key)

    @classmethod
    def of(cls, vllm_config: Any) -> ModelCheck:
        return cls(vllm_config.model_config.hf_config, vllm_config.parallel_config.tensor_parallel_size)


def worker_ranks(kwargs: dict[str, Any]) -> int:
    """CPU worker processes an engine with ``kwargs`` runs on this machine (tensor x pipeline x data)."""
    dp = kwargs.get("data_parallel_size_local") or kwargs.get("data_parallel_size") or 1
    return (kwargs.get("tensor_parallel_size") or 1) * (kwargs.get("pipeline_parallel_size") or 1) * dp


def engine_kwargs(compression: CompressionConfig | None, vllm_kwargs: dict[str, Any]) -> dict[str, Any]:
    """vLLM engine arguments that load KvLLM with ``compression`` (or with it off).

    The block size is vLLM's ``block_size`` when given, else ``compression.block_size``
    (see :class:`~kvllm.config.CompressionConfig` for why 32).
    """
    kwargs = dict(vllm_kwargs)
    kwargs.setdefault("scheduler_cls", SCHEDULER)
    if compression is None:
        return kwargs
    block_size = kwargs.setdefault("block_size", compression.block_size)
    compression = check_engine(compression, block_size)
    kwargs["additional_config"] = {**(kwargs.get("additional_config") or {}), **as_additional_config(compression)}
    return kwargs


def to_argv(kwargs: dict[str, Any]) -> list[str]:
    """vLLM CLI flags for engine ``kwargs`` (``--block-size 32``, ``--no-enable-prefix-caching``)."""
    argv: list[str] = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


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
    params = changes.get("params")
    path = params.get("calibration") if isinstance(params, dict) else None
    if path is not None and path != base.params.get("calibration"):
        # A request must not make the server open a file of its choosing (nor learn, from
        # the error, whether it exists): calibration files are the operator's.
        raise ValueError(
            f"{KEY}.params.calibration cannot be set per request; start the engine with it "
            "(kvllm serve --kv-calibration PATH)"
        )
    return check_paged(base.replace(**changes)) if changes else base


def as_additional_config(config: CompressionConfig) -> dict[str, Any]:
    return {KEY: dataclasses.asdict(config)}
