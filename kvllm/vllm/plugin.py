"""The ``vllm.general_plugins`` entry point.

vLLM loads it in every process it spawns (API server, EngineCore, workers). In the
worker it installs the capturing attention backend and the compacting model runner;
both are inert for an engine started without a ``kvllm`` config, so loading the plugin
costs nothing when compression is off. The first process of a tree names the live
metrics directory (:func:`kvllm.vllm.metrics.claim_directory`) before it spawns
engines; an OpenAI API-server process (``kvllm serve`` or vLLM's own) gets the
``/metrics`` collector and the streamed statistics (:func:`server.install_api_hooks`).
"""

from __future__ import annotations

import os
import sys

_done = False


def register() -> None:
    global _done
    if _done:
        return
    _done = True
    # On CUDA, vLLM 0.32 defaults to Model Runner V2, whose seams differ; only the V1
    # (CPU) adapter exists so far.
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.worker import cpu_worker

    from kvllm.vllm import frontend, server
    from kvllm.vllm.metrics import claim_directory
    from kvllm.vllm.runner import CompressingCPUModelRunner

    register_backend(AttentionBackendEnum.CPU_ATTN, "kvllm.vllm.capture.CapturingCPUAttentionBackend")
    cpu_worker.CPUModelRunner = CompressingCPUModelRunner
    claim_directory()
    _check_configs_where_created()
    frontend.install()
    if _api_server_process():
        server.install_api_hooks()


def _check_configs_where_created() -> None:
    """Run :func:`~kvllm.vllm.settings.check_vllm_config` on every ``VllmConfig`` vLLM
    builds in this process, as it builds it.

    vLLM builds the config in the process that starts the engine (``vllm.LLM``, the
    API server) and only then spawns the EngineCore, where the scheduler would find a
    malformed ``additional_config["kvllm"]`` and die with the reason in its log and
    "Engine core initialization failed" at the caller. Checked here, the caller gets the
    ``ValueError`` naming the field, before any engine process exists. The config found
    is kept for the server's middleware (:data:`server.ENGINE_CONFIG`).
    """
    import functools

    from vllm.engine.arg_utils import EngineArgs

    from kvllm.vllm import server
    from kvllm.vllm.settings import check_vllm_config

    original = EngineArgs.create_engine_config
    if getattr(original, "_kvllm", False):
        return

    @functools.wraps(original)
    def create_engine_config(self: EngineArgs, *args: object, **kwargs: object) -> object:
        vllm_config = original(self, *args, **kwargs)
        server.ENGINE_CONFIG = check_vllm_config(vllm_config)
        return vllm_config

    create_engine_config._kvllm = True  # type: ignore[attr-defined]
    EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign]


def _api_server_process() -> bool:
    """This process serves vLLM's OpenAI API: the root process of ``kvllm serve`` (which
    sets ``KVLLM_SERVE_CONFIG`` before vLLM is imported) or of vLLM's API-server entry,
    or one of the API servers vLLM spawns for ``--api-server-count`` > 1. Engines and
    workers inherit the variable (and, spawned from ``python -m``, re-import the entry
    module), so the root test keeps them out."""
    import multiprocessing

    from kvllm.vllm import server

    if multiprocessing.current_process().name.startswith("ApiServer_"):
        return True
    root = multiprocessing.parent_process() is None
    return root and bool(os.environ.get(server.ENV) or "vllm.entrypoints.launchers.app" in sys.modules)
