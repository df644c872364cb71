"""Eager against vLLM's default compile mode, for KvLLM's own short runs.

``kvllm.LLM`` and ``kvllm serve`` follow vLLM's default (compiled); ``kvllm generate``,
``kvllm eval``'s vLLM backend and ``kvllm bench`` start an engine per run and force
eager. This measures why: each mode starts an engine in a fresh process, and the shipped
reasoning model writes ``--tasks`` held-out reason chains with Kara at r=0.2, greedy, to
EOS. A row per run: the engine's start-up seconds, the generation's seconds, the output
tokens and the rounds. Modes alternate, so drift on the machine hits both; the compile
cache is emptied before the first compiled run (a user's first start) and kept for the
later ones (every start after it).

    python tools/compile_timing.py --out docs/results/data/serving/compile-vs-eager [--repeats 3] [--tasks 8]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def run_one(eager: bool, tasks: int) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams

    from kvllm import CompressionConfig
    from kvllm.assets import model_path
    from kvllm.cli.evaluate import family_difficulty
    from kvllm.eval.tasks import make_task
    from kvllm.vllm.llm import LLM

    difficulty = family_difficulty("reason", None, None, 0.5, op="shift")
    prompts = [make_task("reason", seed, difficulty).prompt for seed in range(tasks)]
    t0 = time.perf_counter()
    llm = LLM(
        str(model_path("kara-reasoner-6l")),
        compression=CompressionConfig(),
        dtype="float32",
        gpu_memory_utilization=0.3,
        enforce_eager=eager,
    )
    t1 = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=1500, temperature=0.0), use_tqdm=False)
    t2 = time.perf_counter()
    return {
        "mode": "eager" if eager else "compiled",
        "startup_s": round(t1 - t0, 2),
        "generate_s": round(t2 - t1, 2),
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "rounds": sum(o.compression["compressions"] for o in outputs),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tasks", type=int, default=8)
    p.add_argument("--one", choices=("eager", "compiled"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one == "eager", args.tasks)))
        return
    cache = Path(os.environ.get("VLLM_CACHE_ROOT", Path.home() / ".cache" / "vllm")) / "torch_compile_cache"
    shutil.rmtree(cache, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    cold = True
    with open(args.out / "results.jsonl", "w") as f:
        for repeat in range(args.repeats):
            for mode in ("eager", "compiled") if repeat % 2 == 0 else ("compiled", "eager"):
                cmd = [sys.executable, __file__, "--out", str(args.out), "--tasks", str(args.tasks), "--one", mode]
                line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
                row = {"repeat": repeat, "tasks": args.tasks, **json.loads(line)}
                if mode == "compiled":
                    row["cold_compile_cache"], cold = cold, False
                print(row, flush=True)
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
