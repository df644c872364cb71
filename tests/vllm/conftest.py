"""Engines for the vLLM backend tests: in-process (so that the scheduler and the worker
can be inspected), fp32, on a small random-weight Qwen3 built here."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

# One process: scheduler, worker and test share objects. Set before vLLM is imported.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# A round that would rewrite a shared or cached block raises instead of being skipped.
os.environ.setdefault("KVLLM_STRICT", "1")

from kvllm.config import CompressionConfig
from kvllm.testing import save_tiny_model
from kvllm.vllm.engine import shutdown

# CPU attention needs a head dim that is a multiple of 32 (the "vec" ISA).
SHAPE = {"hidden_size": 128, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 32}
BASE = {
    "dtype": "float32",
    "max_model_len": 512,
    "enforce_eager": True,
    # 2,048 blocks of the tiny model, 64 x 512 tokens twice over. A fixed pool, not a share
    # of the machine: vLLM sizes and zeroes a share at every engine start (9 s against 2 s
    # here), and two engines of one test fit side by side.
    "kv_cache_memory_bytes": 1 << 26,
    "block_size": 32,
    "enable_prefix_caching": False,
    "max_num_seqs": 64,
}
PROMPTS = [f"let v{i} = {7 * i % 100} and v{i + 1} = {i}, then compute the sum of v{i}" for i in range(32)]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny-vllm"), seed=1, **SHAPE))


@contextmanager
def engine(model: str, compression: CompressionConfig | None, plugin: bool = True, **kwargs: Any) -> Iterator[Any]:
    """A ``kvllm.vllm.llm.LLM`` (or plain ``vllm.LLM`` with ``plugin=False``), shut down after."""
    import vllm

    from kvllm.vllm.llm import LLM

    llm = LLM(model, compression=compression, **{**BASE, **kwargs}) if plugin else vllm.LLM(model, **{**BASE, **kwargs})
    try:
        yield llm
    finally:
        shutdown(llm)
        del llm
        # vLLM's shutdown has just collected the heap; frozen, the next engine's start
        # skips it (what this engine leaves in cycles goes with the next shutdown's collection).
        gc.freeze()


def token_ids(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def greedy(max_tokens: int, **extra: Any) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **extra)


@contextmanager
def serving(process: Any, base: str, log: Any) -> Iterator[str]:
    """A started server's base URL once ``/health`` answers (else fail with its log), stopped after."""
    from kvllm.vllm.launch import stop, wait_healthy

    try:
        try:
            wait_healthy(process, base, timeout=300)
        except (RuntimeError, TimeoutError) as err:
            pytest.fail(f"{err}:\n{log.read_text()[-3000:]}")
        yield base
    finally:
        stop(process)
