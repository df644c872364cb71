"""Live compression metrics: each EngineCore publishes, the API process reads at scrape time.

The scheduler (EngineCore process) and ``/metrics`` (API process) live in different
processes. vLLM's own per-step channel, ``SchedulerStats``, cannot carry KvLLM's numbers:
it is a fixed dataclass that the API process decodes with a typed msgspec decoder (extra
attributes and subclass fields are dropped), its only free-form dicts belong to the KV and
EC connectors (whose loggers assert that a connector is configured), and a custom stat
logger can only be added through an entry-point group. So each engine writes its numbers
into a tiny memory-mapped file of its own, one fixed record of float64s behind a seqlock,
after every step (:class:`EnginePublisher`); the API process sums all engines' records
whenever ``/metrics`` is scraped (:class:`Collector`); with several API processes
(``--api-server-count``), each reads the same records and reports the same totals.
Nothing goes through vLLM, so the values are as live as the last engine step, whatever
vLLM's own stats settings.

The directory is named in ``KVLLM_METRICS_DIR``; the first process that loads the plugin
sets it (:func:`claim_directory`), so the engines and API servers it spawns inherit it,
and removes it at exit. A record is ``[sequence, *FIELDS]``: the writer makes ``sequence`` odd while it
writes, so a reader that sees it odd or changed reads again.
"""

from __future__ import annotations

import atexit
import mmap
import os
import shutil
import struct
import tempfile
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ENV = "KVLLM_METRICS_DIR"

# name -> (kind, help). Counters are exported with prometheus' "_total" suffix.
FIELDS: dict[str, tuple[str, str]] = {
    "compression_rounds": ("counter", "KV compression rounds run"),
    "tokens_dropped": ("counter", "KV slots removed by compression"),
    "blocks_freed": ("counter", "KV blocks returned to the pool by compression"),
    "compress_seconds": ("counter", "Worker time spent compressing"),
    "rounds_refused": (
        "counter",
        "Compression rounds not run because they would rewrite a shared or cached KV block, or that failed",
    ),
    # Counted where the scheduler preempts; vllm:num_preemptions_total misses requests
    # aborted before their next output, which never deliver the event (docs/guide/serving.md).
    "preemptions": ("counter", "Requests preempted by the compressing scheduler (vLLM's scheduler too)"),
    "kv_logical_tokens": ("gauge", "Tokens the running requests have seen (their KV without compression)"),
    "kv_physical_tokens": ("gauge", "KV slots the running requests hold (after compression)"),
    "kv_blocks_saved": ("gauge", "KV blocks the running requests' logical lengths need minus those they hold"),
    "kv_blocks_used": ("gauge", "KV blocks in use in the pool"),
}
_RECORD = struct.Struct(f"<Q{len(FIELDS)}d")


def claim_directory() -> str:
    """The metrics directory of this process tree; created by the first process to ask.

    Root processes (no ``KVLLM_METRICS_DIR`` yet) name a new directory and remove it at
    exit; spawned engines inherit the name through the environment.
    """
    path = os.environ.get(ENV)
    if path:
        return path
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    path = tempfile.mkdtemp(prefix=f"kvllm-metrics-{os.getpid()}-", dir=base)
    os.environ[ENV] = path
    atexit.register(shutil.rmtree, path, True)
    return path


class EnginePublisher:
    """One engine's record, written after every step (single writer).

    The record goes when the engine shuts down (:meth:`close`), when the publisher is
    dropped without that (an engine left to the garbage collector, or its process
    exiting), and, for a process that died without either, when a reader finds that
    its writer's process is gone (:func:`read_totals`): a stale record is never summed.
    """

    def __init__(self, directory: str, engine_index: int) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / f"engine-{engine_index}-{os.getpid()}-{id(self)}.bin"
        with self.path.open("wb") as f:
            f.write(b"\0" * _RECORD.size)
        with self.path.open("r+b") as f:
            self._map = mmap.mmap(f.fileno(), _RECORD.size)
        self._sequence = 0
        self._finalizer = weakref.finalize(self, _remove, self._map, self.path)

    def publish(self, values: dict[str, float]) -> None:
        self._sequence += 1  # odd: writing
        struct.pack_into("<Q", self._map, 0, self._sequence)
        _RECORD.pack_into(self._map, 0, self._sequence, *(float(values.get(k, 0.0)) for k in FIELDS))
        self._sequence += 1  # even: consistent
        struct.pack_into("<Q", self._map, 0, self._sequence)

    def close(self) -> None:
        self._finalizer()


def _remove(record: mmap.mmap, path: Path) -> None:
    record.close()
    path.unlink(missing_ok=True)


def _writer_alive(path: Path) -> bool:
    """Whether the process named in a record's file name (``engine-<i>-<pid>-<id>.bin``) runs."""
    try:
        pid = int(path.name.split("-")[2])
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (ValueError, IndexError, PermissionError):  # not ours to judge: keep it
        return True
    return True


def _read(path: Path) -> dict[str, float] | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    for _ in range(100):
        if len(data) != _RECORD.size:
            return None
        sequence, *values = _RECORD.unpack(data)
        if sequence % 2 == 0:
            again = path.read_bytes()
            if again[:8] == data[:8]:
                return dict(zip(FIELDS, values, strict=True))
            data = again
        else:
            data = path.read_bytes()
    return None


def read_totals(directory: str | None = None) -> dict[str, float]:
    """Every engine's record under ``directory``, summed (all zero when there is none)."""
    totals = dict.fromkeys(FIELDS, 0.0)
    directory = directory or os.environ.get(ENV)
    if not directory or not os.path.isdir(directory):
        return totals
    for path in sorted(Path(directory).glob("engine-*.bin")):
        if not _writer_alive(path):
            path.unlink(missing_ok=True)  # its engine died without closing it
            continue
        record = _read(path)
        for k, v in (record or {}).items():
            totals[k] += v
    return totals


class Collector:
    """A prometheus collector: the ``kvllm:*`` metrics, read from the engines at each scrape."""

    def __init__(self, directory: str | None = None) -> None:
        self.directory = directory

    def describe(self) -> list[Any]:
        return list(self._families(dict.fromkeys(FIELDS, 0.0)))

    def collect(self) -> Iterator[Any]:
        yield from self._families(read_totals(self.directory))

    @staticmethod
    def _families(values: dict[str, float]) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for name, (kind, doc) in FIELDS.items():
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(f"kvllm:{name}", doc, value=values[name])
