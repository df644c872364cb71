"""The ``vllm.general_plugins`` entry point.

vLLM loads it in every process it spawns (API server, EngineCore, workers). In the
worker it installs the capturing attention backend and the compacting model runner;
both are inert for an engine started without a ``kvllm`` config, so loading the plugin
costs nothing when compression is off.
"""

from __future__ import annotations

import os

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

    from kvllm.vllm import server
    from kvllm.vllm.runner import CompressingCPUModelRunner

    register_backend(AttentionBackendEnum.CPU_ATTN, "kvllm.vllm.capture.CapturingCPUAttentionBackend")
    cpu_worker.CPUModelRunner = CompressingCPUModelRunner
    if os.environ.get(server.ENV):  # started by `kvllm serve`
        server.install_metrics()
