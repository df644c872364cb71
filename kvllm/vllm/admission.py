"""Admission that counts compression: admit a request only if every future step fits.

vLLM admits a waiting request when its prompt fits the free blocks; running requests
then grow until one cannot allocate and the newest is preempted (recomputed from token
0 later). For compressing requests that wastes what compression saved: a pool that
holds their *compressed* footprints still preempts while they all grow together.

:func:`project` projects a request's physical footprint, in blocks, over the rest of
its life: its protected prefix plus :func:`kvllm.policy.physical_growth` of its config
(or plain growth when it does not compress), up to its ``max_tokens``. A waiting request
is admitted, in queue order, while the sum of all projected footprints stays within the
pool at every future step (docs/design.md, "Admission"). The projection of a decoding
request is exact when it runs to ``max_tokens``; that of a request yet to prefill is
one step conservative, and any request that stops earlier only frees blocks sooner.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from vllm.v1.request import Request

from kvllm.config import CompressionConfig
from kvllm.policy import physical_growth


@dataclass(frozen=True)
class Footprint:
    """A request's projected KV blocks at each future engine step, from this one.

    ``compressing`` is False for a request with compression off: its growth is reserved
    like any other, but its own admission is left to vLLM.
    """

    blocks: np.ndarray
    compressing: bool


def project(
    request: Request,
    config: CompressionConfig | None,
    prompt_len: int | None,
    max_model_len: int,
    block_size: int,
) -> Footprint:
    """The request's projected blocks per future step.

    ``prompt_len`` is the protected prefix of a decoding request (its compression state
    starts there); ``None`` for a request not decoding yet, whose whole current token
    list becomes the protected prefix (a fresh prompt, or a preempted request's
    recomputation).
    """
    # Conservative by one step at max_model_len: never short.
    left = max(1, min(request.max_tokens - request.num_output_tokens, max_model_len - request.num_tokens + 1))
    base = request.num_tokens if prompt_len is None else prompt_len
    start = 0 if prompt_len is None else request.num_computed_tokens - prompt_len
    if config is None:
        growth = np.arange(start + 1, start + left + 1, dtype=np.int64)
    else:
        growth = physical_growth(config, start + left)[start:]
    slots = base + growth
    if prompt_len is None:
        # Its prefill holds ``base`` slots and decode step k comes one step later, or
        # more under chunked prefill: take the larger of both alignments at every step,
        # since a round's drop would otherwise be projected a step early.
        slots = np.maximum(slots, np.concatenate([[base], slots[:-1]]))
    return Footprint(-(-slots // block_size), config is not None)


def admissible(running: Iterable[np.ndarray], waiting: Iterable[Footprint], capacity: int) -> int:
    """How many of ``waiting`` (in order) fit beside ``running`` at every future step.

    ``running`` holds each running request's projected blocks. A waiting request with
    compression off is counted as admitted (vLLM decides for it) and its growth
    reserved. With nothing running the first waiting request is always admitted, as vLLM
    does, or a request larger than the pool would wait forever.
    """
    profiles = list(running)
    usage = np.zeros(max((len(p) for p in profiles), default=1), dtype=np.int64)
    for p in profiles:
        usage[: len(p)] += p
    n = 0
    for f in waiting:
        p = f.blocks
        if len(p) > len(usage):
            usage = np.concatenate([usage, np.zeros(len(p) - len(usage), dtype=np.int64)])
        if f.compressing and (profiles or n) and int((usage[: len(p)] + p).max()) > capacity:
            break
        usage[: len(p)] += p
        n += 1
    return n
