"""WHEN to compress and WHAT region: the policies of docs/design.md, "Policies".

A policy reads a sequence's lengths and answers with a :class:`Region` (or nothing).
It never touches tensors; a backend gathers the region's queries and keys, asks a
method for kept indices, compacts its storage, then calls :meth:`Policy.commit`.
All positions here are *physical* slot indices of one sequence.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from kvllm.config import CompressionConfig


@dataclass
class SeqState:
    """One sequence's compression bookkeeping.

    Attributes
    ----------
    prompt_len
        Physical slots of the prompt; never compressed.
    length
        Physical slots in use: prompt + kept history + tail.
    tail_start
        First physical slot of the uncompressed tail.
    logical_length
        Tokens the sequence has seen; RoPE positions count from it.
    rounds
        Compression rounds run on this sequence.
    pending
        Lazy retention: the last round's candidates, the slots right before the tail,
        which the next round cuts (:mod:`kvllm.methods.lazy`); 0 otherwise.
    """

    prompt_len: int
    length: int = 0
    tail_start: int = 0
    logical_length: int = 0
    rounds: int = 0
    pending: int = 0

    def __post_init__(self) -> None:
        self.length = max(self.length, self.prompt_len)
        self.tail_start = max(self.tail_start, self.prompt_len)
        self.logical_length = max(self.logical_length, self.length)

    @property
    def tail(self) -> int:
        return self.length - self.tail_start

    @property
    def decode_steps(self) -> int:
        """Tokens cached after the protected prefix: the sequence's own decode steps.

        The period counts these in both backends, so hf and vLLM consider a sequence
        for a round at the same token whatever else the engine runs.
        """
        return self.logical_length - self.prompt_len

    def append(self, n: int = 1) -> None:
        """``n`` new tokens were cached."""
        self.length += n
        self.logical_length += n


@dataclass(frozen=True)
class Region:
    """What to compress in one sequence, in physical slots.

    The scoring span is ``[start, start + span)``; its first ``n_compress`` slots are
    compressible and shrink to ``budget``; the queries that score it are those of the
    span's last ``n_queries`` tokens. Under lazy retention the area opens with the
    previous round's ``candidates`` (:mod:`kvllm.methods.lazy`).
    """

    start: int
    n_compress: int
    span: int
    n_queries: int
    budget: int
    candidates: int = 0

    @property
    def freed(self) -> int:
        """Slots released by the round."""
        return self.n_compress - self.budget


class Policy(ABC):
    """Decides compression rounds; one instance serves every sequence of an engine."""

    def __init__(self, config: CompressionConfig) -> None:
        self.config = config

    @abstractmethod
    def plan(self, state: SeqState) -> Region | None:
        """The region to compress now, after the sequence's latest decode step, if any."""

    def catch_up(self, state: SeqState) -> Region | None:
        """The region to compress now in a sequence being recomputed (after preemption).

        A recomputation writes many tokens a step, so the period does not apply; the
        rest of the rule is :meth:`plan`'s.
        """
        return self.plan(state)

    def recompute_stop(self, state: SeqState) -> int | None:
        """The logical length at which a recomputation pauses for :meth:`catch_up`, or
        ``None`` when it need not (its round's queries are the last ones computed)."""
        return None

    def commit(self, state: SeqState, region: Region) -> None:
        """Update ``state`` once the backend has compacted ``region``."""
        state.length -= region.freed
        # The uncompressed tail now starts right after the kept slots.
        state.tail_start = region.start + region.budget
        state.rounds += 1


class PeriodicWindowPolicy(Policy):
    """Kara's policy: every P steps, compress each eligible sequence's next window once.

    Every P of the sequence's own decode steps (:attr:`SeqState.decode_steps`), a
    sequence is eligible when its uncompressed tail holds at least W + b tokens. The
    window is the first W + b tokens of the tail; its first W (the area C) shrink to
    m = max(1, round(r * W)). The buffer's b tokens are not compressed this round: they
    open the next window, so each generated token is compressed at most once.

    Under lazy retention (``config.lazy`` F > 1) the window keeps min(W, F m) candidates,
    and the next round's area is those candidates and its own window, cut to m and to
    the new candidates: each generated token is still dropped by one round at most (its
    window's or the next), and every round frees W - m slots but the first, which frees
    W - F m.
    """

    def plan(self, state: SeqState) -> Region | None:
        if state.decode_steps % self.config.period:
            return None
        return self.catch_up(state)

    def catch_up(self, state: SeqState) -> Region | None:
        cfg = self.config
        span = cfg.window + cfg.buffer
        if state.tail < span:
            return None
        n = state.pending
        # The candidates' cut keeps m; the new window keeps m, or its lazy candidates.
        budget = (cfg.budget if n else 0) + cfg.lazy_first
        return Region(state.tail_start - n, n + cfg.window, n + span, span, budget, candidates=n)

    def commit(self, state: SeqState, region: Region) -> None:
        super().commit(state, region)
        if self.config.lazy > 1:
            state.pending = self.config.lazy_first

    def recompute_stop(self, state: SeqState) -> int | None:
        """The end of the tail's first window: the round that compresses it needs the
        queries of all W + b of its tokens, and the query ring holds only the last
        W + b + P computed."""
        dropped = state.logical_length - state.length
        return state.tail_start + dropped + self.config.window + self.config.buffer


class ThresholdPolicy(Policy):
    """SnapKV / R-KV style baseline: recompress the whole generated region at a size.

    With G generated slots (everything after the prompt), a round triggers when
    G >= budget + interval. The last ``window`` slots are the observation part and
    stay; everything generated before them is compressed to ``budget - window``
    slots, so G = budget afterwards. Cost grows with the cache, and rounds grow with
    concurrency: this is the policy that shows the concurrency-throughput inversion.
    """

    def plan(self, state: SeqState) -> Region | None:
        cfg = self.config
        generated = state.length - state.prompt_len
        if generated < cfg.threshold_budget + cfg.threshold_interval:
            return None
        return Region(
            start=state.prompt_len,
            n_compress=generated - cfg.window,
            span=generated,
            n_queries=cfg.window,
            budget=cfg.threshold_budget - cfg.window,
        )


def build_policy(config: CompressionConfig) -> Policy:
    """The policy named by ``config.policy``."""
    return {"periodic": PeriodicWindowPolicy, "threshold": ThresholdPolicy}[config.policy](config)


def physical_growth(config: CompressionConfig, steps: int) -> np.ndarray:
    """Slots a sequence needs at each of its first ``steps`` decode steps, past its prompt.

    Entry k is what decode step k holds once that step's round (if any) has run: the
    kept history, the tail and the slot of the token it writes. The policies read only
    lengths relative to the protected prefix, so one array serves every prompt length;
    a scheduler adds the prompt to project a request's physical footprint
    (docs/design.md, "Admission").
    """
    return _growth(config, 1 << max(0, steps - 1).bit_length())[:steps]


@lru_cache(maxsize=64)
def _growth(config: CompressionConfig, steps: int) -> np.ndarray:
    # Replays the policy as the scheduler runs it: plan, commit, then write one token.
    policy = build_policy(config)
    state = SeqState(prompt_len=0)
    out = np.empty(steps, dtype=np.int64)
    for k in range(steps):
        region = policy.plan(state)
        if region is not None:
            policy.commit(state, region)
        out[k] = state.length + 1
        state.append(1)
    out.flags.writeable = False
    return out
