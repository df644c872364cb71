"""Output throughput under a small KV pool: vanilla vLLM against KvLLM, in one run.

Every (system, pool) pair runs in its own process, because vanilla vLLM must start
without the plugin (``VLLM_PLUGINS`` set to a name that matches nothing) and one engine
per process is what vLLM supports. Inside that process one engine serves the whole
concurrency sweep: a cell keeps ``concurrency`` requests in flight (as ``vllm bench
serve --max-concurrency`` does) until ``requests`` have finished. The engine is
in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the scheduler can be sampled
after every step: KV pool usage, running requests, preemptions, compression rounds.

Run ``python -m kvllm.bench.throughput SPEC_JSON`` to run one process's cells; the
driver (:mod:`kvllm.bench.sweep`) does that for every system, pool and repeat.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvllm.config import CompressionConfig

SYSTEMS: tuple[str, ...] = ("vanilla", "plugin-off", "kara", "snapkv-threshold")
UNCOMPRESSED: tuple[str, ...] = ("vanilla", "plugin-off")
# Room for the short prompts (about a hundred tokens with the test tokenizer).
PROMPT_MARGIN = 256


@dataclass(frozen=True)
class Workload:
    """What every system serves: short prompts, fixed-length outputs (EOS ignored).

    Attributes
    ----------
    output_tokens
        Tokens each request generates; EOS is ignored so every system does equal work.
    requests
        Requests per cell, at least the cell's concurrency (then that many).
    prompt_steps
        Program length of the generated trace prompts (a few dozen tokens).
    """

    output_tokens: int = 512
    requests: int = 32
    prompt_steps: int = 4

    def __post_init__(self) -> None:
        if self.output_tokens < 2:
            raise ValueError(f"Workload.output_tokens={self.output_tokens} is invalid: must be >= 2")
        if self.requests < 1:
            raise ValueError(f"Workload.requests={self.requests} is invalid: must be >= 1")


@dataclass(frozen=True)
class Engine:
    """Engine limits shared by every system of a run."""

    pool_blocks: int
    block_size: int = 32
    max_num_seqs: int = 128
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.pool_blocks < 2:
            raise ValueError(f"Engine.pool_blocks={self.pool_blocks} is invalid: must be >= 2")

    @property
    def max_model_len(self) -> int:
        """The longest request the pool holds (vLLM keeps one block back as its null block)."""
        return min((self.pool_blocks - 1) * self.block_size, 8192)


@dataclass(frozen=True)
class Spec:
    """One process's work: a system on one engine, over a concurrency sweep."""

    system: str
    model: str
    engine: Engine
    workload: Workload
    concurrency: tuple[int, ...]
    compression: dict[str, Any] = field(default_factory=dict)  # CompressionConfig fields
    repeat: int = 0

    def __post_init__(self) -> None:
        if self.system not in SYSTEMS:
            raise ValueError(f"system={self.system!r} is invalid: must be one of {', '.join(SYSTEMS)}")
        if self.workload.output_tokens + PROMPT_MARGIN > self.engine.max_model_len:
            raise ValueError(
                f"output_tokens={self.workload.output_tokens} is invalid for a pool of {self.engine.pool_blocks} "
                f"blocks: must be <= {self.engine.max_model_len - PROMPT_MARGIN} (one request must fit the pool)"
            )
        bad = [c for c in self.concurrency if not 1 <= c <= self.engine.max_num_seqs]
        if bad or not self.concurrency:
            raise ValueError(
                f"concurrency={list(self.concurrency)} is invalid: each must be in [1, {self.engine.max_num_seqs}]"
            )

    def config(self) -> CompressionConfig | None:
        """The system's compression (None for the systems in :data:`UNCOMPRESSED`)."""
        return CompressionConfig(**self.compression) if self.compression else None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Spec:
        """The spec of ``dataclasses.asdict(spec)``, as it crosses to the bench process."""
        return cls(
            **{
                **raw,
                "engine": Engine(**raw["engine"]),
                "workload": Workload(**raw["workload"]),
                "concurrency": tuple(raw["concurrency"]),
            }
        )


def system_compression(system: str, retention: float, base: CompressionConfig) -> dict[str, Any]:
    """CompressionConfig fields of a KvLLM system at ``retention``."""
    if system == "kara":
        return asdict(base.replace(method="kara", retention=retention, policy="periodic"))
    if system == "snapkv-threshold":
        return asdict(base.replace(method="snapkv", retention=retention, policy="threshold"))
    return {}


def _prompts(n: int, steps: int) -> list[str]:
    """Short trace prompts (the shipped model's own task format), distinct per request."""
    from kvllm.eval.tasks import Difficulty, make_task

    return [make_task("trace", seed, Difficulty(constants=4, steps=steps)).prompt for seed in range(n)]


def _engine(spec: Spec) -> Any:
    """A started in-process ``vllm.LLM`` for the spec's system."""
    import vllm

    from kvllm.vllm.llm import LLM

    e = spec.engine
    kwargs = dict(
        dtype=e.dtype,
        block_size=e.block_size,
        max_num_seqs=e.max_num_seqs,
        num_gpu_blocks_override=e.pool_blocks,
        # Enough for the workload: the pool may hold more than the model's positions.
        max_model_len=min(e.max_model_len, spec.workload.output_tokens + PROMPT_MARGIN),
        enable_prefix_caching=False,
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        seed=0,
    )
    if spec.system == "vanilla":
        return vllm.LLM(spec.model, **kwargs)
    return LLM(spec.model, compression=spec.config(), **kwargs).llm


def serve_cell(
    llm: Any, scheduler: Any, preemptions: Callable[[], int], spec: Spec, concurrency: int
) -> dict[str, Any]:
    """Serve one cell: keep ``concurrency`` requests in flight until all have finished."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    w = spec.workload
    n = max(w.requests, concurrency)
    prompts = _prompts(n, w.prompt_steps)
    params = SamplingParams(
        max_tokens=w.output_tokens, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    from kvllm.vllm.engine import block_pool_usage, running_requests

    engine = llm.llm_engine
    kv0 = scheduler.kv_stats() if hasattr(scheduler, "kv_stats") else {}
    pre0 = preemptions()
    added, produced, peak_running, steps = 0, 0, 0, 0
    first: dict[str, float] = {}
    tpot: list[float] = []
    ttft: list[float] = []
    submitted: dict[str, float] = {}
    counts: dict[str, int] = {}
    usage: list[tuple[float, float, int]] = []
    start = time.perf_counter()
    while added < n or engine.has_unfinished_requests():
        while added < n and len(submitted) < concurrency:
            rid = f"c{concurrency}-{added}"
            engine.add_request(rid, prompts[added], params)
            submitted[rid] = time.perf_counter()
            added += 1
        outputs = engine.step()
        now = time.perf_counter()
        steps += 1
        for out in outputs:
            k = len(out.outputs[0].token_ids)
            if k and out.request_id not in first:
                first[out.request_id] = now
                ttft.append(now - submitted[out.request_id])
            counts[out.request_id] = counts.get(out.request_id, 0) + k
            if out.finished:
                total = counts.pop(out.request_id)
                produced += total
                if total > 1:
                    tpot.append((now - first.pop(out.request_id)) / (total - 1))
                submitted.pop(out.request_id)
        peak_running = max(peak_running, running_requests(scheduler))
        used, usable = block_pool_usage(scheduler)
        usage.append((round(now - start, 4), round(used / usable, 4), running_requests(scheduler)))
    wall = time.perf_counter() - start
    kv1 = scheduler.kv_stats() if hasattr(scheduler, "kv_stats") else {}
    compress_s = kv1.get("compress_seconds", 0.0) - kv0.get("compress_seconds", 0.0)
    return {
        "system": spec.system,
        "repeat": spec.repeat,
        "pool_blocks": spec.engine.pool_blocks,
        "concurrency": concurrency,
        "requests": n,
        "output_tokens": produced,
        "seconds": round(wall, 4),
        "tok_s": round(produced / wall, 2),
        "mean_tpot_ms": round(1e3 * sum(tpot) / max(1, len(tpot)), 3),
        "mean_ttft_s": round(sum(ttft) / max(1, len(ttft)), 4),
        "peak_running": peak_running,
        "preemptions": preemptions() - pre0,
        "rounds": kv1.get("rounds", 0) - kv0.get("rounds", 0),
        "compress_seconds": round(compress_s, 4),
        "compress_share": round(compress_s / wall, 5),
        "peak_pool_usage": max(u for _, u, _ in usage),
        "mean_pool_usage": round(sum(u for _, u, _ in usage) / len(usage), 4),
        "engine_steps": steps,
        "usage": usage[:: max(1, len(usage) // 200)],
    }


def run(spec: Spec) -> None:
    """Start the engine, warm it up, then print one JSON line per concurrency cell."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler must be readable
    started = time.perf_counter()
    from kvllm.vllm.engine import count_preemptions, scheduler_of

    llm = _engine(spec)
    scheduler = scheduler_of(llm)
    preemptions = count_preemptions(scheduler)
    from vllm import SamplingParams

    # One short untimed request: first-step allocations and lazy imports.
    llm.generate(_prompts(2, spec.workload.prompt_steps), SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    startup = time.perf_counter() - started
    for c in spec.concurrency:
        row = serve_cell(llm, scheduler, preemptions, spec, c)
        row["startup_seconds"] = round(startup, 2)
        print("KVLLM_BENCH " + json.dumps(row), flush=True)


def main() -> None:
    run(Spec.from_dict(json.loads(sys.argv[1])))


if __name__ == "__main__":
    main()
