"""The runs of ``kvllm tune``: Full KV, then the candidate settings, each in its own engine.

Every run serves all the prompts at once in the user's pool and at their concurrency
(vLLM runs ``concurrency`` of them at a time), greedy, each to its own EOS or the cap, and
is timed after an untimed warm-up request, so that its answers per second compare with
Full KV's. Full KV is vLLM with the plugin loaded and compression off, which writes
vLLM's tokens (``tests/vllm/test_engine.py``). Each finished run is appended to
``runs.jsonl`` in the output folder, and a rerun skips what is stored.
"""

from __future__ import annotations

import gc
import gzip
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvllm.config import CompressionConfig
from kvllm.tune.choose import Tolerances, choose, passes, summarize
from kvllm.tune.grade import outcome, resolve_grader
from kvllm.tune.prompts import TunePrompt

FULL = "full"


@dataclass(frozen=True)
class Setting:
    """One candidate: a method at a retention with the window's W, b and P."""

    method: str
    retention: float
    window: int
    buffer: int
    period: int

    @property
    def key(self) -> str:
        return f"{self.method}@{self.retention:g}/{self.window}/{self.buffer}/{self.period}"

    def config(self, calibration: str | None) -> CompressionConfig:
        params = {"calibration": calibration} if calibration else {}
        return CompressionConfig(
            method=self.method,
            retention=self.retention,
            window=self.window,
            buffer=self.buffer,
            period=self.period,
            params=params,
        )

    def flags(self, calibration: str | None) -> str:
        out = f"--kv-compression {self.method} --kv-retention {self.retention:g} --kv-window {self.window}"
        out += f" --kv-buffer {self.buffer} --kv-period {self.period}"
        return out + (f" --kv-calibration {calibration}" if calibration else "")


@dataclass(frozen=True)
class Tune:
    """A whole tuning run (``kvllm tune``'s flags).

    ``retentions`` is the coarse grid, run for every method from the largest down; then
    ``bisect`` midpoints between a method's smallest passing retention and the next one
    below it that fails. ``pool_blocks`` (vLLM's ``num_gpu_blocks_override``) or
    ``memory`` (``gpu_memory_utilization``) sets the pool, ``concurrency`` vLLM's
    ``max_num_seqs``.
    """

    model: str
    out: Path
    prompts: tuple[TunePrompt, ...]
    name: str = ""  # how the user named the model (a shipped name), for the report and flags
    grader: str = "auto"
    methods: tuple[str, ...] = ("kara", "snapkv")
    retentions: tuple[float, ...] = (0.5, 0.3, 0.2, 0.1)
    window: int = 128
    buffer: int = 32
    period: int = 16
    bisect: int = 2
    concurrency: int = 16
    pool_blocks: int | None = None
    memory: float = 0.3
    cap: int = 4096
    eager: bool = False  # vLLM's enforce_eager; compiled by default, as `kvllm serve` runs
    tolerances: Tolerances = field(default_factory=Tolerances)
    calibration: str | None = None
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not self.methods:
            raise ValueError("--method is invalid: name at least one method")
        if self.bisect < 0:
            raise ValueError(f"--bisect {self.bisect} is invalid: must be >= 0")
        if self.concurrency < 1:
            raise ValueError(f"--concurrency {self.concurrency} is invalid: must be >= 1")
        if self.cap < 1:
            raise ValueError(f"--cap {self.cap} is invalid: must be >= 1")
        for setting in self.grid():
            setting.config(self.calibration)  # a bad method, retention or window fails here
        object.__setattr__(self, "grader", resolve_grader(self.grader, list(self.prompts)))

    def conditions(self) -> dict[str, Any]:
        """What every stored run of one output folder must share to be compared: the
        model, the prompts, the grader, the engine and the cap."""
        return {
            "model": self.name or self.model,  # as the user named it: no path of this machine is stored
            "prompts": [p.uid for p in self.prompts],
            "grader": self.grader,
            "concurrency": self.concurrency,
            "pool_blocks": self.pool_blocks,
            "memory": self.memory,
            "cap": self.cap,
            "eager": self.eager,
            "dtype": self.dtype,
            "calibration": self.calibration,
        }

    def setting(self, method: str, retention: float) -> Setting:
        return Setting(method, round(retention, 4), self.window, self.buffer, self.period)

    def grid(self) -> list[Setting]:
        return [self.setting(m, r) for m in self.methods for r in sorted(set(self.retentions), reverse=True)]


Serve = Callable[[Tune, CompressionConfig | None], dict[str, Any]]


def serve(tune: Tune, config: CompressionConfig | None) -> dict[str, Any]:
    """One engine with ``config`` (``None``: Full KV) serving every prompt; its records."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from kvllm.vllm.engine import shutdown
    from kvllm.vllm.llm import LLM

    tokenizer = AutoTokenizer.from_pretrained(tune.model)
    longest = max(len(tokenizer(p.text)["input_ids"]) for p in tune.prompts)
    kwargs: dict[str, Any] = {
        "dtype": tune.dtype,
        "max_num_seqs": tune.concurrency,
        "gpu_memory_utilization": tune.memory,
        "max_model_len": longest + tune.cap + 16,
        "enforce_eager": tune.eager,
        "seed": 0,
    }
    if tune.pool_blocks is not None:
        kwargs["num_gpu_blocks_override"] = tune.pool_blocks
    llm = LLM(tune.model, compression=config, **kwargs)
    try:
        llm.generate([tune.prompts[0].text], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = llm.generate([p.text for p in tune.prompts], SamplingParams(max_tokens=tune.cap, temperature=0.0))
        seconds = time.perf_counter() - start
    finally:
        shutdown(llm)
        del llm
        gc.collect()
    return {"seconds": seconds, "outputs": outputs}


def run_tune(tune: Tune, progress: Callable[[str, int], None] | None = None, runner: Serve = serve) -> dict:
    """Run what is not stored yet and return the result: every run's summary, the
    recommendation (or ``None``) and, without one, the best setting tried.

    ``progress(label, total)`` is called before each run (total: runs planned so far);
    ``runner`` serves one run (tests pass a fake one).
    """
    tune.out.mkdir(parents=True, exist_ok=True)
    stored = {row["key"]: row for row in _rows(tune.out)}
    conditions = tune.conditions()
    for row in stored.values():
        if row.get("conditions") != conditions:
            other = row.get("conditions") or {}
            changed = sorted(k for k in conditions if other.get(k) != conditions[k])
            raise ValueError(
                f"{tune.out / 'runs.jsonl'} holds runs made with another {', '.join(changed)}: they cannot be "
                "compared with these; give another --out, or delete that folder to start afresh"
            )
    total = 1 + len(tune.grid()) + tune.bisect * len(tune.methods)

    def run(key: str, setting: Setting | None, full: list[dict[str, Any]] | None) -> dict[str, Any]:
        if key in stored:
            return stored[key]
        if progress is not None:
            progress(key, total)
        served = runner(tune, None if setting is None else setting.config(tune.calibration))
        fulls = full or [None] * len(tune.prompts)
        records = [
            outcome(tune.grader, p, o, f) for p, o, f in zip(tune.prompts, served["outputs"], fulls, strict=True)
        ]
        row = {"key": key, "setting": None if setting is None else asdict(setting), "seconds": served["seconds"]}
        row["conditions"] = conditions
        row["records"] = records if setting is None else [_light(r) for r in records]
        _store(tune.out, row, records)
        stored[key] = row
        return row

    full = run(FULL, None, None)["records"]
    rows = {s.key: run(s.key, s, full) for s in tune.grid()}
    for method in tune.methods:
        for setting in _bisection(tune, method, rows, full):
            rows[setting.key] = run(setting.key, setting, full)
    return result(tune, full, stored[FULL]["seconds"], list(rows.values()))


def _bisection(tune: Tune, method: str, rows: dict[str, Any], full: list[dict[str, Any]]) -> Iterator[Setting]:
    """Midpoints between the method's smallest passing retention and the largest failing
    one below it, ``tune.bisect`` times, each decided by the run before it."""
    for _ in range(tune.bisect):
        tried = sorted(
            (r["setting"]["retention"], passes(summarize(r["records"], full), tune.tolerances))
            for r in rows.values()
            if r["setting"]["method"] == method
        )
        passing = [r for r, ok in tried if ok]
        if not passing:
            return
        lowest = min(passing)
        below = [r for r, ok in tried if not ok and r < lowest]
        if not below:
            return
        mid = round((lowest + max(below)) / 2, 3)
        if mid in (lowest, max(below)):
            return
        yield tune.setting(method, mid)


def result(tune: Tune, full: list[dict[str, Any]], full_seconds: float, rows: list[dict[str, Any]]) -> dict:
    """Each run's summary with its goodput against Full KV's, and the choice."""
    full_rate = sum(r["score"] for r in full) / full_seconds
    candidates = []
    for row in rows:
        summary = summarize(row["records"], full)
        rate = sum(r["score"] for r in row["records"]) / row["seconds"]
        summary["goodput_ratio"] = rate / full_rate if full_rate else float("nan")
        summary["passes"] = passes(summary, tune.tolerances)
        setting = Setting(**row["setting"])
        candidates.append({"key": row["key"], "setting": asdict(setting), "summary": summary,
                           "flags": setting.flags(tune.calibration)})  # fmt: skip
    chosen, best = choose(candidates, tune.tolerances)
    return {
        "model": tune.name or tune.model,
        "prompts": len(tune.prompts),
        "grader": tune.grader,
        "tolerances": asdict(tune.tolerances),
        "full": {
            "accuracy": sum(r["score"] for r in full) / len(full),
            "stop_rate": sum(r["stopped"] for r in full) / len(full),
            "mean_tokens": sum(r["tokens"] for r in full) / len(full),
            "seconds": full_seconds,
        },
        "candidates": candidates,
        "recommended": chosen,
        "best_failing": best,
    }


def _light(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k not in ("text", "ids")}


def _rows(out: Path) -> list[dict[str, Any]]:
    path = out / "runs.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    full = next((r for r in rows if r["key"] == FULL), None)
    if full is not None:  # Full KV's texts and ids, which agreement and divergence read
        with gzip.open(out / "completions" / f"{FULL}.jsonl.gz", "rt") as f:
            kept = [json.loads(line) for line in f]
        full["records"] = [{**r, **k} for r, k in zip(full["records"], kept, strict=True)]
    return rows


def _store(out: Path, row: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """Append the run (completions beside it, Full KV's ids too) to the output folder."""
    folder = out / "completions"
    folder.mkdir(exist_ok=True)
    with gzip.open(folder / f"{row['key'].replace('/', '_')}.jsonl.gz", "wt") as f:
        for r in records:
            f.write(json.dumps({"uid": r["uid"], "text": r["text"], "ids": r["ids"]}) + "\n")
    light = {**row, "records": [_light(r) for r in row["records"]]}
    with (out / "runs.jsonl").open("a") as f:
        f.write(json.dumps(light) + "\n")
