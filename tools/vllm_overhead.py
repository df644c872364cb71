"""One-run comparison of vanilla vLLM, KvLLM keep-all and KvLLM-Kara on one request set.

Each system runs in its own process (vanilla without the plugin: VLLM_PLUGINS is set to a
name that matches nothing), in turn, `--repeats` times; prints output tokens/s, engine
start-up seconds and peak KV blocks in use (KvLLM systems). A stopgap until `kvllm bench`.

Usage: python tools/vllm_overhead.py MODEL [--prompts 32] [--tokens 256] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SYSTEMS = ("vanilla", "keep-all", "kara-0.2")


def run_one(system: str, model: str, n: int, tokens: int) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: the scheduler can be read
    t0 = time.perf_counter()
    import vllm
    from vllm import SamplingParams

    from kvllm import CompressionConfig
    from kvllm.vllm.engine import block_pool_usage, scheduler_of
    from kvllm.vllm.llm import LLM

    kwargs = {"dtype": "float32", "max_model_len": 2048, "enforce_eager": True, "gpu_memory_utilization": 0.3}
    kwargs |= {"block_size": 32, "enable_prefix_caching": False, "max_num_seqs": n}
    if system == "vanilla":
        llm = vllm.LLM(model, **kwargs)
        engine = llm
    else:
        retention = 1.0 if system == "keep-all" else 0.2
        llm = LLM(model, compression=CompressionConfig(window=128, buffer=32, period=16, retention=retention), **kwargs)
        engine = llm.llm
    startup = time.perf_counter() - t0
    sched = scheduler_of(engine)
    prompts = [f"let v{i} = {i % 100} and v{i + 1} = {(7 * i) % 100}, then compute the sum of v{i}" for i in range(n)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    eng = engine.llm_engine
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    peak, produced = 0, 0
    t1 = time.perf_counter()
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                produced += len(out.outputs[0].token_ids)
        peak = max(peak, block_pool_usage(sched)[0])
    wall = time.perf_counter() - t1
    return {"system": system, "tok_s": produced / wall, "startup_s": startup, "peak_blocks": peak}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--one", choices=SYSTEMS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(run_one(a.one, a.model, a.prompts, a.tokens)))
        return
    rows = []
    for _ in range(a.repeats):
        for system in SYSTEMS:
            env = dict(os.environ)
            if system == "vanilla":
                env["VLLM_PLUGINS"] = "none"
            cmd = [sys.executable, __file__, a.model, "--prompts", str(a.prompts), "--tokens", str(a.tokens)]
            out = subprocess.run([*cmd, "--one", system], capture_output=True, text=True, env=env, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    for system in SYSTEMS:
        mine = [r for r in rows if r["system"] == system]
        tok = sorted(r["tok_s"] for r in mine)
        print(
            f"{system:9s} tok/s {tok} startup {[round(r['startup_s'], 1) for r in mine]} "
            f"peak blocks {[r['peak_blocks'] for r in mine]}"
        )


if __name__ == "__main__":
    main()
