"""``kvllm bench throughput``: every system x pool x repeat, alternating, resumable.

Systems alternate within a repeat, and their order rotates between repeats, so slow
drift of a noisy machine spreads over all of them; ratios are taken within a repeat.
Each (system, pool, repeat) process appends its cells to ``results.jsonl`` as they
finish, and a rerun skips the groups already complete.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from kvllm.bench.throughput import PROMPT_MARGIN, SYSTEMS, VANILLA, Engine, Spec, Workload, system_compression
from kvllm.config import CompressionConfig


@dataclass(frozen=True)
class Sweep:
    """A whole benchmark run.

    Attributes
    ----------
    retention
        Kara's retention; SnapKV-threshold uses the same retention and a
        ``threshold_budget`` from ``compression`` (``kvllm bench throughput`` matches it to
        Kara's footprint: :func:`kvllm.bench.throughput.matched_threshold_budget`).
    pools
        KV pools: a number of blocks, ``"Nx"`` for room for N whole requests of the
        longest output without compression (vanilla's pool), or ``"max"`` for room for
        the highest concurrency's whole requests (no pressure: the ceiling).
    prompt_tokens
        The longest prompt in tokens, for the relative pools; measured with the model's
        tokenizer when not given.
    """

    model: str
    out: Path
    systems: tuple[str, ...] = SYSTEMS
    concurrency: tuple[int, ...] = (16, 32, 64, 128)
    pools: tuple[int | str, ...] = ("8x", "16x", "max")
    repeats: int = 3
    workload: Workload = field(default_factory=Workload)
    retention: float = 0.2
    compression: CompressionConfig = field(
        default_factory=lambda: CompressionConfig(threshold_budget=192, threshold_interval=64)
    )
    block_size: int = 32
    prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        unknown = [s for s in self.systems if s not in SYSTEMS]
        if unknown or not self.systems:
            raise ValueError(f"systems={list(self.systems)} is invalid: each must be one of {', '.join(SYSTEMS)}")
        if self.repeats < 1:
            raise ValueError(f"repeats={self.repeats} is invalid: must be >= 1")
        # Fails here, before any engine starts, on a bad retention or policy parameter.
        self.compression.replace(retention=self.retention)
        for pool in self.pools:
            if not (isinstance(pool, int) or pool == "max" or (pool.endswith("x") and pool[:-1].isdigit())):
                raise ValueError(
                    f"--pool {pool!r} is invalid: must be a number of blocks, Nx (N whole requests) or max"
                )
        if not self.prompt_tokens and any(isinstance(p, str) for p in self.pools) and not Path(self.model).exists():
            raise ValueError(f"--model {self.model} does not exist: the Nx and max pools need its tokenizer")
        blocks = [self.pool_blocks(p) for p in self.pools]
        if len(set(blocks)) < len(blocks):
            raise ValueError(f"--pool {list(self.pools)} is invalid: two pools resolve to the same {blocks} blocks")
        limit = _max_positions(self.model)
        if limit is not None and self.workload.longest + PROMPT_MARGIN > limit:
            raise ValueError(
                f"--output-tokens/--output-max {self.workload.longest} is invalid for this model: must be <= "
                f"{limit - PROMPT_MARGIN} (its max_position_embeddings {limit}, less room for the prompt)"
            )

    def request_blocks(self) -> int:
        """Blocks one whole request of the longest output holds without compression."""
        n = max(self.workload.requests, *self.concurrency)  # a cell serves max(requests, C) prompts
        prompt = self.prompt_tokens if self.prompt_tokens is not None else _prompt_tokens(self.model, self.workload, n)
        return -(-(prompt + self.workload.longest) // self.block_size)

    def pool_blocks(self, pool: int | str) -> int:
        """A pool in blocks (one more than the requests need: vLLM's null block)."""
        if isinstance(pool, int):
            return pool
        n = max(self.concurrency) if pool == "max" else int(pool[:-1])
        return n * self.request_blocks() + 1

    def specs(self) -> list[Spec]:
        """Every process to run, in run order (systems rotate between repeats)."""
        out = []
        # Pool by pool, so that an interrupted run leaves whole pools behind.
        for pool in self.pools:
            engine = Engine(
                pool_blocks=self.pool_blocks(pool), label=str(pool), block_size=self.block_size,
                max_num_seqs=max(self.concurrency),
            )  # fmt: skip
            for repeat in range(self.repeats):
                k = repeat % len(self.systems)
                for system in self.systems[k:] + self.systems[:k]:
                    out.append(
                        Spec(
                            system=system,
                            model=self.model,
                            engine=engine,
                            workload=self.workload,
                            concurrency=self.concurrency,
                            compression=system_compression(system, self.retention, self.compression),
                            repeat=repeat,
                        )
                    )
        return out


def _max_positions(model: str) -> int | None:
    config = Path(model) / "config.json"
    return json.loads(config.read_text()).get("max_position_embeddings") if config.exists() else None


@lru_cache(maxsize=8)
def _prompt_tokens(model: str, workload: Workload, n: int) -> int:
    from transformers import AutoTokenizer

    from kvllm.bench.throughput import prompts

    tokenizer = AutoTokenizer.from_pretrained(model)
    return max(len(tokenizer(p).input_ids) for p in prompts(n, workload.prompt_steps))


def _done(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _run_spec(spec: Spec, on_row: Callable[[dict[str, Any]], None]) -> None:
    env = dict(os.environ)
    if spec.system in VANILLA:
        env["VLLM_PLUGINS"] = "no-plugin"  # a name that matches nothing: vLLM without KvLLM
    raw = asdict(spec)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvllm.bench.throughput", json.dumps(raw)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None and proc.stderr is not None
    for line in proc.stdout:
        if line.startswith("KVLLM_BENCH "):
            on_row(json.loads(line.removeprefix("KVLLM_BENCH ")))
    err = proc.stderr.read()
    if proc.wait() != 0:
        raise RuntimeError(f"bench process for {spec.system} (pool {spec.engine.pool_blocks}) failed:\n{err[-4000:]}")


def run_sweep(sweep: Sweep, progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Run every missing cell; return all rows (old and new)."""
    sweep.out.mkdir(parents=True, exist_ok=True)
    path = sweep.out / "results.jsonl"
    # Keyed by cell, so a rerun group's rows supersede those of its interrupted run.
    rows = {_key(r): r for r in _done(path)}
    with path.open("a") as f:

        def on_row(row: dict[str, Any]) -> None:
            rows[_key(row)] = row
            f.write(json.dumps(row) + "\n")
            f.flush()
            if progress:
                progress(
                    f"{row['system']} pool {row['pool_blocks']} c={row['concurrency']} r{row['repeat']}: "
                    f"{row['tok_s']:.0f} tok/s"
                )

        for spec in sweep.specs():
            keys = {(spec.system, spec.engine.pool_blocks, spec.repeat, c) for c in spec.concurrency}
            if keys <= rows.keys():
                for _ in spec.concurrency:
                    if progress:
                        progress("(resumed)")
                continue
            # A partly finished process reruns whole: its engine's history would differ.
            _run_spec(spec, on_row)
    return list(rows.values())


def _key(row: dict[str, Any]) -> tuple[str, int, int, int]:
    return (row["system"], row["pool_blocks"], row["repeat"], row["concurrency"])
