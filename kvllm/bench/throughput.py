"""Output throughput under a small KV pool: vanilla vLLM against KvLLM, in one run.

Every (system, pool) pair runs in its own process, because the vanilla systems must start
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

SYSTEMS: tuple[str, ...] = (
    "vanilla-default",  # vLLM as a user starts it: prefix caching on
    "vanilla",  # vLLM with prefix caching off, as KvLLM had to run before it supported prefix caching
    "plugin-off",  # KvLLM's scheduler and runner, no compression
    "kara",  # Kara, periodic policy, vLLM's admission rule: what `kvllm serve` runs by default
    "kara-projected",  # Kara, periodic policy, projected admission (`kvllm serve --kv-admission projected`)
    "snapkv-periodic",  # SnapKV's scoring under Kara's policy, projected admission: policy vs scoring
    "snapkv-threshold",  # SnapKV's scoring under the threshold policy, projected admission
)
# Before commit 2e08d1f, `kara` named projected admission and `kara-vllm-admit` vLLM's rule.
UNCOMPRESSED: tuple[str, ...] = ("vanilla-default", "vanilla", "plugin-off")
VANILLA: tuple[str, ...] = ("vanilla-default", "vanilla")  # vLLM without the plugin
# Room for the prompts (137-155 tokens at prompt_steps=8 with the shipped tokenizer).
PROMPT_MARGIN = 256


@dataclass(frozen=True)
class Workload:
    """What every system serves: trace prompts, reasoning-length outputs (EOS ignored).

    Attributes
    ----------
    output_tokens
        Tokens each request generates; EOS is ignored so every system does equal work.
    output_max
        With a value, request i generates a length drawn uniformly from
        [output_tokens, output_max] (seeded by i, so every system serves the same mix).
    requests
        Requests per cell, at least the cell's concurrency (then that many).
    prompt_steps
        Program length of the generated trace prompts (8: 137-155 tokens).
    """

    output_tokens: int = 2048
    output_max: int | None = None
    requests: int = 32
    prompt_steps: int = 8

    def __post_init__(self) -> None:
        if self.output_tokens < 2:
            raise ValueError(f"output_tokens={self.output_tokens} (--output-tokens) is invalid: must be >= 2")
        if self.output_max is not None and self.output_max < self.output_tokens:
            raise ValueError(
                f"output_max={self.output_max} (--output-max) is invalid: must be >= --output-tokens "
                f"({self.output_tokens})"
            )
        if self.requests < 1:
            raise ValueError(f"requests={self.requests} (--requests) is invalid: must be >= 1")

    @property
    def longest(self) -> int:
        return self.output_max or self.output_tokens

    def lengths(self, n: int) -> list[int]:
        """Output tokens of requests 0..n-1."""
        if self.output_max is None:
            return [self.output_tokens] * n
        import numpy as np

        return [int(np.random.default_rng(i).integers(self.output_tokens, self.output_max + 1)) for i in range(n)]


@dataclass(frozen=True)
class Engine:
    """Engine limits shared by every system of a run (``label``: the pool as the user gave it)."""

    pool_blocks: int
    label: str = ""
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
        if self.workload.longest + PROMPT_MARGIN > self.engine.max_model_len:
            raise ValueError(
                f"--output-tokens/--output-max {self.workload.longest} is invalid for a pool of "
                f"{self.engine.pool_blocks} blocks (--pool): must be <= {self.engine.max_model_len - PROMPT_MARGIN} "
                "(one request must fit the pool)"
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
    if system in UNCOMPRESSED:
        return {}
    method, _, policy = system.partition("-")
    # `kara` takes vLLM's rule, as `kvllm serve` does by default; `kara-projected` and
    # the SnapKV systems take projected admission (as the SnapKV rows were measured).
    admission = "vllm" if system == "kara" else "projected"
    policy = "periodic" if policy in ("", "projected") else policy
    return asdict(base.replace(method=method, retention=retention, policy=policy, admission=admission))


def matched_threshold_budget(kara: CompressionConfig, output_tokens: int, interval: int) -> int:
    """SnapKV-threshold's budget at equal retention: its generated slots, which swing
    between the budget and budget + ``interval``, average Kara's after ``output_tokens``."""
    from kvllm.policy import physical_growth

    held = int(physical_growth(kara, output_tokens)[-1])
    return max(kara.window + 1, held - interval // 2)


def prompts(n: int, steps: int) -> list[str]:
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
        max_model_len=min(e.max_model_len, spec.workload.longest + PROMPT_MARGIN),
        # vLLM's default everywhere but `vanilla`; KvLLM's rows stored before it supported prefix
        # caching were measured with it off (docs/results/throughput.md).
        enable_prefix_caching=spec.system != "vanilla",
        # Every system eager, as in every stored run, so that ratios compare like with like
        # (compiled decoding is faster: docs/results/serving.md, "Compiled or eager").
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        seed=0,
    )
    if spec.system in VANILLA:
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
    texts = prompts(n, w.prompt_steps)
    params = [
        SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        for k in w.lengths(n)
    ]
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
            engine.add_request(rid, texts[added], params[added])
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
        running = running_requests(scheduler)
        peak_running = max(peak_running, running)
        used, usable = block_pool_usage(scheduler)
        usage.append((round(now - start, 4), round(used / usable, 4), running))
    wall = time.perf_counter() - start
    kv1 = scheduler.kv_stats() if hasattr(scheduler, "kv_stats") else {}
    compress_s = kv1.get("compress_seconds", 0.0) - kv0.get("compress_seconds", 0.0)
    return {
        "system": spec.system,
        "repeat": spec.repeat,
        "pool": spec.engine.label or str(spec.engine.pool_blocks),
        "pool_blocks": spec.engine.pool_blocks,
        "concurrency": concurrency,
        "requests": n,
        "output_tokens": produced,
        "seconds": round(wall, 4),
        "tok_s": round(produced / wall, 2),
        "mean_tpot_ms": round(1e3 * sum(tpot) / max(1, len(tpot)), 3),
        "mean_ttft_s": round(sum(ttft) / max(1, len(ttft)), 4),
        "peak_running": peak_running,
        "mean_running": round(sum(r for _, _, r in usage) / len(usage), 2),
        "mean_step_ms": round(1e3 * wall / steps, 3),
        "preemptions": preemptions() - pre0,
        "rounds": kv1.get("rounds", 0) - kv0.get("rounds", 0),
        "compress_seconds": round(compress_s, 4),
        "compress_share": round(compress_s / wall, 5),
        "peak_pool_usage": max(u for _, u, _ in usage),
        "mean_pool_usage": round(sum(u for _, u, _ in usage) / len(usage), 4),
        "engine_steps": steps,
        "usage": usage[:: max(1, len(usage) // 200)],
    }


def run(spec: Spec, on_start: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """Start the engine, warm it up, then print one JSON line per concurrency cell.

    ``on_start`` is called once the engine is warm, before the first cell (a step
    profiler arms itself there). Returns the cells' rows."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler must be readable
    started = time.perf_counter()
    from kvllm.vllm.engine import count_preemptions, scheduler_of

    llm = _engine(spec)
    scheduler = scheduler_of(llm)
    preemptions = count_preemptions(scheduler)
    from vllm import SamplingParams

    # One short untimed request: first-step allocations and lazy imports.
    llm.generate(prompts(2, spec.workload.prompt_steps), SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    startup = time.perf_counter() - started
    if on_start is not None:
        on_start()
    rows = []
    for c in spec.concurrency:
        row = serve_cell(llm, scheduler, preemptions, spec, c)
        row["startup_seconds"] = round(startup, 2)
        print("KVLLM_BENCH " + json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    run(Spec.from_dict(json.loads(sys.argv[1])))


if __name__ == "__main__":
    main()
