"""Where the engine's step time goes, for vLLM and KvLLM, at the two benchmark shapes.

Usage: python tools/step_profile.py [--out DIR]

Runs, each in its own process and one after another, with the step timers of
:mod:`kvllm.vllm.profile` armed after warm-up:

- ``goodput``: ``kara-reasoner-6l`` serving the 48 held-out ``reason`` tasks to their EOS
  (pool 8x, C=32, as `kvllm bench goodput`), vanilla vLLM and Kara at r=0.2;
- ``throughput``: the random-weights ``tiny-qwen3`` shape, 32 requests of 2,048 tokens
  with EOS ignored (pool 8x, C=32, as `kvllm bench throughput`), vanilla vLLM and Kara.

Writes DIR/profile.json (default docs/results/data/profile): per run, the exclusive
seconds per part (:func:`kvllm.vllm.profile.split`), engine steps, tokens and wall time.
`python tools/render_results.py` renders it into docs/results/goodput.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

# The row fields each profile keeps beside its parts.
KEPT = ("model", "output_tokens", "seconds", "engine_steps", "mean_running", "preemptions", "rounds")
RUNS: tuple[tuple[str, str], ...] = (
    ("goodput", "vanilla-default"),
    ("goodput", "kara@0.2"),
    ("throughput", "vanilla-default"),
    ("throughput", "kara"),
)


def _goodput(system: str, on_start) -> dict:
    from kvllm.assets import model_path
    from kvllm.bench.goodput import Goodput, serve
    from kvllm.cli.options import trained_op

    path = model_path("kara-reasoner-6l")
    run = Goodput(model=str(path), out=Path("unused"), op=trained_op(path), systems=(system,), repeats=1)
    cell = next(c for c in run.cells() if c.system == system)
    return {"model": "kara-reasoner-6l", **serve(cell, on_start=on_start)}


def _throughput(system: str, on_start) -> dict:
    from kvllm.bench.shapes import shape_model
    from kvllm.bench.sweep import Sweep
    from kvllm.bench.throughput import run

    sweep = Sweep(model=str(shape_model("tiny-qwen3")), out=Path("unused"), systems=(system,), concurrency=(32,),
                  pools=("8x",), repeats=1)  # fmt: skip
    (row,) = run(sweep.specs()[0], on_start=on_start)
    return {**row, "model": "tiny-qwen3"}


def one(bench: str, system: str) -> dict:
    """Run one (bench, system) in this process, timed; returns its profile."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from kvllm.vllm.profile import split, step_timer

    with step_timer() as timer:
        row = (_goodput if bench == "goodput" else _throughput)(system, timer.arm)
    parts = {k: round(v, 3) for k, v in split(timer, row["seconds"]).items()}
    return {"bench": bench, "system": system, **{k: row[k] for k in KEPT}, "parts": parts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/results/data/profile"))
    parser.add_argument("--one", nargs=2, metavar=("BENCH", "SYSTEM"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print("KVLLM_PROFILE " + json.dumps(one(*args.one)), flush=True)
        return
    rows = []
    for bench, system in RUNS:
        env = dict(os.environ)
        if system.startswith("vanilla"):
            env["VLLM_PLUGINS"] = "no-plugin"  # a name that matches nothing: vLLM without KvLLM
        proc = subprocess.run([sys.executable, __file__, "--one", bench, system], capture_output=True, text=True,
                              env=env)  # fmt: skip
        line = next((x for x in proc.stdout.splitlines() if x.startswith("KVLLM_PROFILE ")), None)
        if line is None:
            raise SystemExit(f"{bench} {system} failed:\n{proc.stderr[-4000:]}")
        rows.append(json.loads(line.removeprefix("KVLLM_PROFILE ")))
        print(bench, system, rows[-1]["seconds"], rows[-1]["parts"], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {args.out / 'profile.json'}")


if __name__ == "__main__":
    main()
