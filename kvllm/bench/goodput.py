"""``kvllm bench goodput``: answers per second at the accuracy a user accepts, inside vLLM.

A fixed-length benchmark (``kvllm bench throughput``) charges every system the same
tokens and grades none of them. Here a real-weights model serves graded tasks as
``kvllm serve`` runs it: held-out ``reason`` (or ``trace``) problems as prompts, greedy,
each generation stopped by the model's own EOS or by a cap. A chain that loses its way
runs longer (and costs time and memory) and is graded wrong, so a system is charged for
both. Each cell reports the accuracy grades (:mod:`kvllm.eval.statements`) and what they
cost: wall time, output tokens/s, statements right per second (goodput) and answers
right per second, chain length against Full KV's, cap hits, preemptions, and the share
of engine time spent in rounds.

Systems (:func:`parse_system`): ``vanilla-default`` (vLLM as a user starts it, in the
run's pool), ``vanilla-unlimited`` (vLLM in a pool that holds every request whole at the
cap: the limit row, with no memory pressure), and compressing systems
``METHOD[-POLICY][@R[/W/B]]``: a registered method under the periodic (default) or the
threshold policy, at retention R with window W and buffer b, run by KvLLM with vLLM's
admission rule (``kvllm serve``'s default). Every (system, pool, repeat) runs in its own
process (the vanilla systems without the plugin); systems alternate within a repeat and
their order rotates between repeats. Rows append to ``results.jsonl`` as they finish and
a rerun skips what is done; the first repeat's completions are kept in
``completions/`` so any cell can be inspected.

Run ``python -m kvllm.bench.goodput SPEC_JSON`` to serve one cell;
:func:`run_goodput` does that for every cell.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from kvllm.config import CompressionConfig

VANILLA = ("vanilla-default", "vanilla-unlimited")
BASELINE = "vanilla-default"
LIMIT = "vanilla-unlimited"
DEFAULT_SYSTEMS = (
    "vanilla-default",
    "vanilla-unlimited",
    "kara@0.2",
    "kara@0.3",
    "kara@0.5",
    "kara@0.5/256/64",
    "snapkv-periodic@0.2",
    "snapkv-threshold@0.2",
)
_SYSTEM = re.compile(
    r"^(?P<name>[a-z0-9-]+?)(?:-(?P<policy>periodic|threshold))?(?:\+lazy(?P<lazy>\d+)(?::(?P<keep>[0-9.]+))?)?"
    r"(?:@(?P<r>[0-9.]+)(?:/(?P<w>\d+)/(?P<b>\d+))?)?$"
)
# Room kept for a threshold round's interval (kvllm.bench.throughput.matched_threshold_budget).
THRESHOLD_INTERVAL = 64


def parse_system(system: str, base: CompressionConfig, calibration: str | None = None) -> CompressionConfig | None:
    """The compression of a system string (``None`` for the vanilla systems).

    ``kara@0.5/256/64`` is Kara at retention 0.5 with W=256, b=64; ``kara+lazy2:0.5@0.2``
    Kara with lazy retention, F=2 and A=0.5 (A defaults to the config's); ``snapkv-threshold@0.2``
    SnapKV's scores under the threshold policy, its budget matched to what Kara holds at
    the same retention after 2,048 tokens; a system without ``@`` takes ``base``'s
    retention, window and buffer. A method that reads a calibration file gets
    ``calibration``. Raises ``ValueError`` naming the system when it is not one.
    """
    from kvllm.methods import calibrated

    if system in VANILLA:
        return None
    m = _SYSTEM.match(system)
    if m is None:
        raise ValueError(
            f"--system {system!r} is invalid: must be {' or '.join(VANILLA)}, or METHOD[-periodic|-threshold]"
            "[+lazyF[:A]][@RETENTION[/WINDOW/BUFFER]] (kara@0.5/256/64, kara+lazy2@0.2)"
        )
    changes: dict[str, Any] = {"method": m["name"], "policy": m["policy"] or "periodic", "admission": "vllm"}
    try:
        if calibrated(m["name"]):
            changes["params"] = {"calibration": calibration or ""}
    except ValueError as err:  # not a method
        raise ValueError(f"--system {system!r} is invalid: {err}") from err
    if m["r"] is not None:
        changes["retention"] = float(m["r"])
    if m["w"] is not None:
        changes["window"], changes["buffer"] = int(m["w"]), int(m["b"])
    if m["lazy"] is not None:
        changes["lazy"] = int(m["lazy"])
    if m["keep"] is not None:
        changes["lazy_keep"] = float(m["keep"])
    try:
        if changes["policy"] == "threshold":
            from kvllm.bench.throughput import matched_threshold_budget

            periodic = base.replace(**{**changes, "policy": "periodic"})
            changes["threshold_budget"] = matched_threshold_budget(periodic, 2048, THRESHOLD_INTERVAL)
            changes["threshold_interval"] = THRESHOLD_INTERVAL
        return base.replace(**changes)
    except ValueError as err:
        raise ValueError(f"--system {system!r} is invalid: {err}") from err


@dataclass(frozen=True)
class Cell:
    """One process's work: one system serving every task, in one engine."""

    system: str
    model: str
    family: str
    seeds: tuple[int, int]
    op: str
    pool: str  # as the user gave it (8x); vanilla-unlimited's pool_blocks ignore it
    pool_blocks: int
    concurrency: int
    cap: int
    max_model_len: int
    compression: dict[str, Any] = field(default_factory=dict)  # CompressionConfig fields; {} for vanilla
    repeat: int = 0
    block_size: int = 32

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Cell:
        return cls(**{**raw, "seeds": tuple(raw["seeds"])})

    @property
    def key(self) -> tuple[str, str, int, int]:
        return (self.system, self.pool, self.concurrency, self.repeat)


def tasks_of(family: str, seeds: tuple[int, int], op: str) -> list[Any]:
    """The held-out tasks of seeds ``[a, b)``, at the family's default difficulty."""
    from kvllm.eval.tasks import TEST_SEEDS, default_difficulty, make_task

    a, b = seeds
    if not (0 <= a < b and a in TEST_SEEDS and b - 1 in TEST_SEEDS):
        raise ValueError(f"--test-seeds {a}:{b} is invalid: need 0 <= A < B within the held-out seeds {TEST_SEEDS}")
    difficulty = dataclasses.replace(default_difficulty(family), op=op)
    return [make_task(family, seed, difficulty) for seed in range(a, b)]


@dataclass(frozen=True)
class Goodput:
    """A whole goodput run.

    Attributes
    ----------
    systems
        System strings (:func:`parse_system`); the baseline ``vanilla-default`` is added
        when missing, since every ratio is to it.
    pools
        ``"Nx"``: room for N whole requests of the longest prompt and the longest
        reference chain (the task's own completion; a model may write a shorter one:
        ``kara-reasoner-6l``'s reason chains leave out most of the reference's check
        passes and restatements and run about 0.75 of its length), or a number of
        blocks. ``vanilla-unlimited`` always gets room for every request in flight at
        the cap.
    calibration
        The calibration file of the methods that read one (``kara-retain``, ``qfilter``).
    cap
        Tokens a request may generate. It should be at least 1.5 times Full KV's longest
        chain, so that a chain that runs long is charged for it; the report says what
        it was against the baseline's longest chain.
    """

    model: str
    out: Path
    family: str = "reason"
    seeds: tuple[int, int] = (0, 48)
    op: str = "add"
    systems: tuple[str, ...] = DEFAULT_SYSTEMS
    pools: tuple[str, ...] = ("8x",)
    concurrency: tuple[int, ...] = (32,)
    repeats: int = 3
    cap: int = 3200
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    calibration: str | None = None

    def __post_init__(self) -> None:
        from kvllm.eval.tasks import FAMILIES, OPS

        if self.family not in FAMILIES:
            raise ValueError(f"--family {self.family!r} is invalid: must be one of {', '.join(FAMILIES)}")
        if self.op not in OPS:
            raise ValueError(f"--op {self.op!r} is invalid: must be one of {', '.join(OPS)}")
        if self.repeats < 1:
            raise ValueError(f"--repeats {self.repeats} is invalid: must be >= 1")
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError(f"--concurrency {list(self.concurrency)} is invalid: each must be >= 1")
        for system in self.systems:
            parse_system(system, self.compression, self.calibration)
        for pool in self.pools:
            if not (pool.isdigit() or (pool.endswith("x") and pool[:-1].isdigit() and int(pool[:-1]) >= 1)):
                raise ValueError(f"--pool {pool!r} is invalid: must be a number of blocks or Nx (N whole requests)")
        if self.cap < 1:
            raise ValueError(f"--cap {self.cap} is invalid: must be >= 1")
        _ = self.tasks  # the seeds, checked before any tokenizer or engine is loaded

    @cached_property
    def tasks(self) -> list[Any]:
        return tasks_of(self.family, self.seeds, self.op)

    @cached_property
    def lengths(self) -> tuple[list[int], list[int]]:
        """Tokens of each task's prompt and of its reference chain, with the model's tokenizer."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.model)
        prompts = [len(tokenizer(t.prompt)["input_ids"]) for t in self.tasks]
        targets = [len(tokenizer(t.target, add_special_tokens=False)["input_ids"]) + 1 for t in self.tasks]
        return prompts, targets

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.compression.block_size)

    def pool_blocks(self, pool: str, system: str, concurrency: int) -> int:
        """A pool in blocks, one more than the requests need (vLLM's null block)."""
        prompts, targets = self.lengths
        if system == LIMIT:
            return concurrency * self.blocks(max(prompts) + self.cap) + 1
        if pool.isdigit():
            return int(pool)
        return int(pool[:-1]) * self.blocks(max(prompts) + max(targets)) + 1

    @property
    def all_systems(self) -> tuple[str, ...]:
        return self.systems if BASELINE in self.systems else (BASELINE, *self.systems)

    def cells(self) -> list[Cell]:
        """Every process to run, in run order: systems rotate between repeats."""
        systems = self.all_systems
        max_len = max(self.lengths[0]) + self.cap + 16
        out = []
        for pool in self.pools:
            for c in self.concurrency:
                for repeat in range(self.repeats):
                    k = repeat % len(systems)
                    for system in systems[k:] + systems[:k]:
                        config = parse_system(system, self.compression, self.calibration)
                        out.append(
                            Cell(
                                system=system,
                                model=self.model,
                                family=self.family,
                                seeds=self.seeds,
                                op=self.op,
                                pool=pool,
                                pool_blocks=self.pool_blocks(pool, system, c),
                                concurrency=c,
                                cap=self.cap,
                                max_model_len=max_len,
                                compression={} if config is None else asdict(config),
                                repeat=repeat,
                                block_size=self.compression.block_size,
                            )
                        )
        return out


def _engine(cell: Cell) -> Any:
    """A started in-process ``vllm.LLM`` for the cell's system, as ``kvllm serve`` builds it."""
    import vllm

    from kvllm.vllm.llm import LLM

    kwargs = dict(
        dtype="float32",
        block_size=cell.block_size,
        max_num_seqs=cell.concurrency,
        num_gpu_blocks_override=cell.pool_blocks,
        max_model_len=cell.max_model_len,
        # Every system eager, as in every stored run, so that ratios compare like with like
        # (compiled decoding is faster: docs/results/serving.md, "Compiled or eager").
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        seed=0,
    )
    if not cell.compression:
        return vllm.LLM(cell.model, **kwargs)
    return LLM(cell.model, compression=CompressionConfig(**cell.compression), **kwargs).llm


def serve(cell: Cell, on_start: Callable[[], None] | None = None) -> dict[str, Any]:
    """Serve every task of ``cell`` at once (vLLM runs ``concurrency`` of them at a time),
    then grade each completion. Returns the cell's row, completions included.

    ``on_start`` is called when the timed part starts, after start-up and warm-up (a step
    profiler arms itself there)."""
    from vllm import SamplingParams

    from kvllm.eval.statements import grade, program
    from kvllm.eval.tasks import grade as answer_grade
    from kvllm.vllm.engine import count_preemptions, scheduler_of

    tasks = tasks_of(cell.family, cell.seeds, cell.op)
    started = time.perf_counter()
    llm = _engine(cell)
    scheduler = scheduler_of(llm)
    preemptions = count_preemptions(scheduler)
    # One short untimed request: first-step allocations and lazy imports.
    llm.generate([tasks[0].prompt], SamplingParams(max_tokens=8), use_tqdm=False)
    startup = time.perf_counter() - started
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=cell.cap, temperature=0.0)  # stops at the model's EOS
    kv0 = scheduler.kv_stats() if hasattr(scheduler, "kv_stats") else {}
    pre0 = preemptions()
    outputs: dict[str, Any] = {}
    running, steps = [], 0
    if on_start is not None:
        on_start()
    start = time.perf_counter()
    for i, task in enumerate(tasks):
        engine.add_request(str(i), task.prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        steps += 1
        running.append(len(scheduler.running))
    wall = time.perf_counter() - start
    kv1 = scheduler.kv_stats() if hasattr(scheduler, "kv_stats") else {}
    records, texts = [], []
    for i, task in enumerate(tasks):
        out = outputs[str(i)]
        text, ids = out.outputs[0].text, out.outputs[0].token_ids
        g = grade(program(task.prompt), text)
        stats = (out.kv_transfer_params or {}).get("kvllm") or {}
        generated = len(ids)
        # Generated tokens' KV held at the end, over generated tokens (1.0 uncompressed).
        held = stats.get("physical_length", 0) - len(out.prompt_token_ids) if stats.get("method") else generated
        records.append(
            {
                "seed": task.seed, "tokens": generated, "cap_hit": out.outputs[0].finish_reason == "length",
                "right": g.right, "statements": g.statements, "extra": g.extra, "stopped": g.stopped,
                "answered": g.answered, "answer_grade": answer_grade(task, text),
                "held_end": round(held / max(1, generated), 4),
            }
        )  # fmt: skip
        texts.append(text)
    compress_s = kv1.get("compress_seconds", 0.0) - kv0.get("compress_seconds", 0.0)
    produced = sum(r["tokens"] for r in records)
    right = sum(r["right"] for r in records)
    answers = sum(r["answered"] for r in records)
    return {
        **{k: v for k, v in asdict(cell).items() if k not in ("model",)},
        "model": Path(cell.model).name,
        "tasks": len(tasks),
        "seconds": round(wall, 3),
        "startup_seconds": round(startup, 2),
        "output_tokens": produced,
        "tok_s": round(produced / wall, 2),
        "statements_right": right,
        "statements_right_s": round(right / wall, 3),
        "statements_share": round(right / sum(r["statements"] + r["extra"] for r in records), 4),
        "answers_right": answers,
        "answers_right_s": round(answers / wall, 4),
        "stopped_right": sum(r["stopped"] for r in records),
        "cap_hits": sum(r["cap_hit"] for r in records),
        "mean_tokens": round(produced / len(records), 1),
        "preemptions": preemptions() - pre0,
        "rounds": kv1.get("rounds", 0) - kv0.get("rounds", 0),
        "compress_seconds": round(compress_s, 3),
        "compress_share": round(compress_s / wall, 5),
        "mean_running": round(sum(running) / max(1, len(running)), 2),
        "engine_steps": steps,
        "records": records,
        "texts": texts,
    }


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler must be readable
    row = serve(Cell.from_dict(json.loads(sys.argv[1])))
    print("KVLLM_BENCH " + json.dumps(row), flush=True)


def _run_cell(cell: Cell) -> dict[str, Any]:
    env = dict(os.environ)
    if not cell.compression:
        env["VLLM_PLUGINS"] = "no-plugin"  # a name that matches nothing: vLLM without KvLLM
    proc = subprocess.run(
        [sys.executable, "-m", "kvllm.bench.goodput", json.dumps(asdict(cell))],
        capture_output=True,
        text=True,
        env=env,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("KVLLM_BENCH "):
            return json.loads(line.removeprefix("KVLLM_BENCH "))
    raise RuntimeError(
        f"goodput cell {cell.system} (pool {cell.pool}, repeat {cell.repeat}) failed:\n{proc.stderr[-4000:]}"
    )


def load_rows(out: Path) -> list[dict[str, Any]]:
    path = out / "results.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def row_key(row: dict[str, Any]) -> tuple[str, str, int, int]:
    return (row["system"], row["pool"], row["concurrency"], row["repeat"])


def completions_path(out: Path, row: dict[str, Any]) -> Path:
    name = re.sub(r"[^A-Za-z0-9.-]+", "_", f"{row['system']}-{row['pool']}-c{row['concurrency']}")
    return out / "completions" / f"{name}.jsonl.gz"


def run_goodput(run: Goodput, progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Run every missing cell; return every row (stored and new)."""
    run.out.mkdir(parents=True, exist_ok=True)
    rows = {row_key(r): r for r in load_rows(run.out)}
    with (run.out / "results.jsonl").open("a") as f:
        for cell in run.cells():
            if cell.key in rows:
                if progress:
                    progress(f"{cell.system} r{cell.repeat}: stored")
                continue
            row = _run_cell(cell)
            texts = row.pop("texts")
            if cell.repeat == 0:  # completions are kept once per cell (greedy: repeats write the same)
                path = completions_path(run.out, row)
                path.parent.mkdir(exist_ok=True)
                with gzip.open(path, "wt") as z:
                    for record, text in zip(row["records"], texts, strict=True):
                        z.write(json.dumps({"seed": record["seed"], "text": text}) + "\n")
            rows[cell.key] = row
            f.write(json.dumps(row) + "\n")
            f.flush()
            if progress:
                progress(
                    f"{cell.system} r{cell.repeat}: {row['seconds']:.0f} s, statements {row['statements_share']:.3f}, "
                    f"{row['statements_right_s']:.1f} right/s"
                )
    return list(rows.values())


if __name__ == "__main__":
    main()
