"""The adapter surface: every path into vLLM's engine internals goes through here.

Benchmarks, tools, the CLI and the tests reach the scheduler, the model runner, the
API-server entry and shutdown only through these functions, so a vLLM upgrade changes
this file and the subclasses beside it, nothing else. The scheduler and runner are
reachable only for an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations

import logging
import os
import sys
from argparse import Namespace
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)
BIND = "VLLM_CPU_OMP_THREADS_BIND"
# vLLM's OpenAI API-server entry (``python -m API_SERVER_MODULE --model ...`` is `vllm serve` with one API server).
API_SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"


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


def _ring_usage(worker: Any) -> tuple[int, int] | None:
    ring = worker.model_runner.kv_ring
    return None if ring is None else (len(ring.owner), len(ring.free))


def ring_usage(llm: Any) -> list[tuple[int, int] | None]:
    """Per worker rank: (query-ring slots held, slots free), or ``None`` before any round.

    Runs in every worker (``collective_rpc``), so it works for tensor-parallel engines too.
    """
    return _vllm_llm(llm).collective_rpc(_ring_usage)


def block_pool_usage(scheduler: Any) -> tuple[int, int]:
    """(blocks in use, usable blocks) of the KV pool; block 0 is vLLM's null block."""
    pool = scheduler.kv_cache_manager.block_pool
    usable = pool.num_gpu_blocks - 1
    return usable - pool.get_num_free_blocks(), usable


def held_blocks(scheduler: Any, request_id: str) -> int:
    """KV blocks ``request_id`` holds now (under KvLLM's scheduler: its physical blocks)."""
    return scheduler.kv_cache_manager.held_blocks(request_id)


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


def _server_parser() -> Any:
    """vLLM's OpenAI server parser, as ``vllm serve`` builds it (with its positional ``model_tag``)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def parse_server_args(argv: list[str]) -> Namespace:
    """``argv`` parsed by vLLM's OpenAI server parser (what the server itself will see)."""
    return _server_parser().parse_args(argv)


def server_model(argv: list[str]) -> str | None:
    """The model ``argv`` names, as ``vllm serve`` reads it, or ``None`` when it names none.

    vLLM's parser knows which flags take a value, so ``--port 8000`` is never read as the
    model: the positional ``model_tag`` wins, as in ``vllm serve``, else ``--model`` when given.
    """
    parser = _server_parser()
    args = parser.parse_args(argv)
    if args.model_tag is not None:
        return args.model_tag
    return None if args.model == parser.get_default("model") else args.model


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

    What ``vllm serve`` runs after parsing (``ServeSubcommand.cmd``), set up as vLLM's
    server entry sets itself up: vllm-cpu's ``vllm`` CLI looks up the metadata of a
    distribution named "vllm", which vllm-cpu is not, and fails before parsing. The
    entry's own ``main`` always runs one API server in this process and ignores
    ``--api-server-count`` (and ``--headless``); ``cmd`` honours them, spawning the API
    servers and engines as ``vllm serve`` does. Without ``--api-server-count``,
    ``kvllm serve`` keeps one API server, also with data parallelism (``vllm serve``
    would start one per rank), as it always did.
    """
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    sys.argv = ["kvllm-serve", *argv]
    cli_env_setup()
    args = make_arg_parser(FlexibleArgumentParser(description="kvllm serve")).parse_args(argv)
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    if args.api_server_count is None and not args.headless:
        args.api_server_count = 1
    ServeSubcommand.cmd(args)


def model_kv_heads(model: str) -> int | None:
    """The model's KV head count from its config, or ``None`` when it cannot be read here."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model)
    except Exception:  # vLLM reads the config itself later and reports what it finds
        return None
    config = getattr(config, "get_text_config", lambda: config)()
    heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None)
    return int(heads) if heads else None


def bind_cpu_threads(ranks: int) -> str | None:
    """Set ``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` CPU workers when vLLM's own binding would fail.

    vLLM's default ("auto") binds each worker rank (tensor x pipeline x data parallel)
    to a NUMA node of its own and refuses to start with fewer nodes than ranks, as on
    a one-node machine. Then the allowed CPUs (one logical CPU per physical core, as
    vLLM's auto does, when there are enough cores) are split evenly and in order among
    the ranks, e.g. ``"0|1"`` for two ranks on two CPUs. Nothing happens on one rank,
    off CPU, when the variable is set, or when there are NUMA nodes enough. Returns the
    value set, or ``None``. Raises ``ValueError`` saying what to set when there are
    fewer CPUs than ranks.
    """
    if ranks <= 1 or os.environ.get(BIND):
        return None
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    import vllm.utils.cpu_resource_utils as cpu_utils

    nodes = cpu_utils.get_visible_memory_node()
    if len(nodes) >= ranks:
        return None
    logical = cpu_utils.get_allowed_cpu_list()
    by_core: dict[int, int] = {}
    for cpu in sorted(logical, key=lambda c: c.id):
        by_core[cpu.physical_core] = cpu.id  # the last logical CPU of each core, like vLLM's auto
    chosen = sorted(by_core.values()) if len(by_core) >= ranks and -1 not in by_core else sorted(c.id for c in logical)
    if len(chosen) < ranks:
        raise ValueError(
            f"{ranks} CPU worker ranks (tensor x pipeline x data parallel) need {ranks} CPUs, and this process may "
            f"use {len(chosen)}: set {BIND} yourself (e.g. {BIND}={'|'.join(str(chosen[0]) for _ in range(ranks))!r} "
            "to share one CPU) or lower the parallel sizes"
        )
    k = len(chosen) // ranks
    value = "|".join(",".join(str(c) for c in chosen[i * k : (i + 1) * k]) for i in range(ranks))
    os.environ[BIND] = value
    logger.warning(
        "kvllm: set %s=%r for %d CPU worker ranks: vLLM's automatic binding needs one NUMA node per rank and "
        "this machine shows %d; set %s yourself to choose other CPUs",
        BIND,
        value,
        ranks,
        len(nodes),
        BIND,
    )
    return value


# vLLM's default share (``CacheConfig.gpu_memory_utilization``); on the CPU it is the share
# of a NUMA node's memory each worker reserves, checked against that node's free memory.
VLLM_DEFAULT_SHARE = 0.92
# What a fitted share leaves of the free memory: the API server, the tokenizer and the
# model's weights allocate after the worker's check.
FIT_MARGIN = 0.9
# Memory the API server and EngineCore processes take between this check (in the API
# process) and the worker's own. On an 8.46 GiB node the worker saw 7.0 GiB free where
# the API process of the next start saw 7.92: a share fitted to the free memory alone
# (vLLM's 0.92 passed) failed the worker's check.
STARTUP_RESERVE = 1.5 * 2**30


def fitted_memory_share(ranks: int) -> float | None:
    """A ``gpu_memory_utilization`` that fits this CPU's free memory when vLLM's default does not.

    vllm-cpu's worker reserves ``share x`` its NUMA node's total memory and refuses to
    start when the node has less free (``CPUWorker.__init__``); on a machine whose node 0
    is partly in use, the default 0.92 fails at start-up. Returns ``None`` off CPU and
    when the default fits; else the largest share in hundredths that leaves
    :data:`FIT_MARGIN` of the free memory of the tightest node, less
    :data:`STARTUP_RESERVE`, split among the worker ranks that share a node, and logs what
    it chose. Raises ``ValueError`` when not even 0.01 fits.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    import vllm.utils.cpu_resource_utils as cpu_utils

    nodes = cpu_utils.get_visible_memory_node()
    per_node = -(-max(ranks, 1) // len(nodes))  # ranks are spread over the nodes
    infos = [cpu_utils.get_memory_node_info(node) for node in nodes]
    fits = min((info.available_memory - STARTUP_RESERVE) / info.total_memory / per_node for info in infos)
    if fits >= VLLM_DEFAULT_SHARE:
        return None
    share = int(FIT_MARGIN * fits * 100) / 100
    tightest = min(infos, key=lambda info: info.available_memory / info.total_memory)
    free, total = (round(x / 2**30, 2) for x in (tightest.available_memory, tightest.total_memory))
    if share < 0.01:
        raise ValueError(
            f"gpu_memory_utilization (--gpu-memory-utilization): this machine's NUMA node has {free} of {total} GiB "
            f"free, too little for {per_node} worker(s) to reserve any; free memory, or set it yourself"
        )
    logger.warning(
        "kvllm: --gpu-memory-utilization not given and vLLM's default %.2f does not fit: on the CPU it reserves "
        "that share of a NUMA node's %.2f GiB per worker, and the node has %.2f GiB free; using %.2f "
        "(%.2f GiB per worker) instead; pass --gpu-memory-utilization to choose",
        VLLM_DEFAULT_SHARE,
        total,
        free,
        share,
        share * total,
    )
    return share
