"""Admission that counts compression: admit a request only if every future step fits.

vLLM admits a waiting request when its prompt fits the free blocks; running requests
then grow until one cannot allocate and the newest is preempted (recomputed from token
0 later). For compressing requests that wastes what compression saved: a pool that
holds their *compressed* steady state still preempts while they all grow together.

:class:`Projection` projects each request's physical footprint over the rest of its
life: its prompt plus :func:`kvllm.policy.physical_growth` of its config (or plain
growth when it does not compress), up to its ``max_tokens``. A waiting request is
admitted, in queue order, while the sum of all projected footprints stays within the
pool at every future step (docs/design.md, "Admission"). The projection is exact for
requests that run to ``max_tokens`` and conservative for those that stop earlier.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
from vllm.v1.request import Request

from kvllm.config import CompressionConfig
from kvllm.policy import physical_growth


@dataclass(frozen=True)
class Footprint:
    """A request's slots from now on: ``base + growth[start:start + steps]``.

    ``compressing`` is False for a request with compression off: its growth is reserved
    like any other, but its own admission is left to vLLM.
    """

    base: int
    growth: np.ndarray
    start: int
    steps: int
    compressing: bool

    def blocks(self, block_size: int) -> np.ndarray:
        slots = self.base + self.growth[self.start : self.start + self.steps]
        return -(-slots // block_size)


def footprint(
    request: Request, config: CompressionConfig | None, prompt_len: int | None, max_model_len: int
) -> Footprint:
    """The request's projected slots per future step.

    ``prompt_len`` is the protected prefix of a decoding request (its compression state
    starts there); ``None`` for a request not decoding yet, whose whole current token
    list becomes the protected prefix (a fresh prompt, or a preempted request's
    recomputation).
    """
    left = max(1, min(request.max_tokens - request.num_output_tokens, max_model_len - request.num_tokens + 1))
    base = request.num_tokens if prompt_len is None else prompt_len
    start = 0 if prompt_len is None else request.num_computed_tokens - prompt_len
    if config is None:
        growth = np.arange(1, start + left + 1, dtype=np.int64)
    else:
        growth = physical_growth(config, start + left)
    return Footprint(base, growth, start, left, config is not None)


def admissible(
    running: Iterable[Footprint],
    waiting: Iterable[Footprint],
    capacity: int,
    block_size: int,
) -> int:
    """How many of ``waiting`` (in order) fit beside ``running`` at every future step.

    A waiting request with compression off is counted as admitted (vLLM decides for
    it) and its growth reserved. With nothing running the first waiting request is
    always admitted, as vLLM does, or a request larger than the pool would wait forever.
    """
    profiles = [f.blocks(block_size) for f in running]
    usage = np.zeros(max((len(p) for p in profiles), default=1), dtype=np.int64)
    for p in profiles:
        usage[: len(p)] += p
    n = 0
    for f in waiting:
        p = f.blocks(block_size)
        if len(p) > len(usage):
            usage = np.concatenate([usage, np.zeros(len(p) - len(usage), dtype=np.int64)])
        if f.compressing and (profiles or n) and int((usage[: len(p)] + p).max()) > capacity:
            break
        usage[: len(p)] += p
        profiles.append(p)
        n += 1
    return n


def admission_cap(
    running: list[Request],
    waiting: Iterable[Request],
    slots_of: Callable[[Request], Footprint],
    capacity: int,
    block_size: int,
    limit: int,
) -> int:
    """The running-request cap to give vLLM's admission loop this step.

    ``slots_of`` projects one request. At most ``limit`` (vLLM's own cap) and at least
    the running count: admission never preempts.
    """
    room = limit - len(running)
    if room <= 0:
        return limit
    candidates = []
    for request in waiting:
        if len(candidates) == room:
            break
        candidates.append(slots_of(request))
    if not candidates:
        return limit
    return len(running) + admissible([slots_of(r) for r in running], candidates, capacity, block_size)
