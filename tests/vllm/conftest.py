"""Engines for the vLLM backend tests: in-process (so that the scheduler and the worker
can be inspected), fp32, on a small random-weight Qwen3 built here; and the servers that
a module's tests share."""

from __future__ import annotations

import functools
import gc
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

# One process: scheduler, worker and test share objects. Set before vLLM is imported.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# A round that would rewrite a shared or cached block raises instead of being skipped.
os.environ.setdefault("KVLLM_STRICT", "1")

from kvllm.bench.common import free_port
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


@functools.cache
def tiny_model_path(config: pytest.Config) -> str:
    """The tiny model, saved once per session; outside a fixture, so that the shared
    servers can start on it as soon as collection ends."""
    folder = Path(tempfile.mkdtemp(prefix="kvllm-tests-"))
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
    return str(save_tiny_model(folder / "tiny-vllm", seed=1, **SHAPE))


@pytest.fixture(scope="session")
def tiny_model(pytestconfig: pytest.Config) -> str:
    return tiny_model_path(pytestconfig)


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


@dataclass
class SharedServer:
    """A server on the tiny model that the tests of one module share, through the fixture
    named ``fixture`` (or one that a test expects to refuse to start).

    Before a server answers, three processes import vLLM in turn (about 45 s on two
    cores), and an idle server takes no CPU. So every shared server a selected test needs
    starts as soon as collection ends (``pytest_collection_finish``), at the lowest CPU
    priority so that it takes only what the modules running before its own leave idle, and
    stops when its module is done, or else at the session's end.
    """

    fixture: str
    flags: list[str]
    vllm: bool = False  # vLLM's own API server, not `kvllm serve`
    drop_env: tuple[str, ...] = ("VLLM_ENABLE_V1_MULTIPROCESSING",)
    process: subprocess.Popen | None = field(default=None, init=False)
    base: str = field(default="", init=False)
    log: Path | None = field(default=None, init=False)

    def start(self, model: str) -> None:
        from kvllm.vllm.launch import start_server

        if self.process is not None:
            return
        self.log = Path(model).parent / f"{self.fixture}.log"
        env = {k: v for k, v in os.environ.items() if k not in self.drop_env}
        self.process, self.base = start_server(model, free_port(), self.flags, log=self.log, env=env, vllm=self.vllm)
        os.setpriority(os.PRIO_PROCESS, self.process.pid, 19)  # the engine processes it spawns inherit it
        _STARTED.append(self)

    @contextmanager
    def serving(self, model: str) -> Iterator[str]:
        self.start(model)
        with serving(self.process, self.base, self.log) as url:
            yield url


_STARTED: list[SharedServer] = []


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    for item in session.items:
        module = getattr(item, "module", None)
        servers = [v for v in vars(module).values() if isinstance(v, SharedServer)] if module else []
        for server in servers:
            if server.fixture in getattr(item, "fixturenames", ()):
                server.start(tiny_model_path(session.config))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop what an interrupted or failed-early session left running."""
    from kvllm.vllm.launch import stop

    for server in _STARTED:
        if server.process is not None and server.process.poll() is None:
            stop(server.process)
