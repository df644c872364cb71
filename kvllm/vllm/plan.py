"""What the scheduler tells the worker each step (pickled with ``SchedulerOutput``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvllm.config import CompressionConfig
from kvllm.policy import Region


@dataclass(frozen=True)
class Compaction:
    """Compress ``region`` of request ``req_id`` before this step's forward.

    ``length`` is the request's physical slot count before the round and ``dropped``
    the slots removed before it (tail slot ``p`` holds logical token ``p + dropped``).
    ``seed`` is the round's random-stream key (:func:`kvllm.methods.stream_seed`).
    """

    req_id: str
    region: Region
    config: CompressionConfig
    length: int
    dropped: int
    seed: int = 0


@dataclass
class StepPlan:
    """One step's compression work.

    Attributes
    ----------
    dropped
        Every compressible running request -> slots dropped so far (after this step's
        compactions). The worker subtracts it for slot mapping and attention lengths.
    compactions
        Rounds to apply now, before the forward and before new block ids are appended.
    keep_blocks
        Requests whose trailing blocks the scheduler freed -> blocks they keep.
    """

    dropped: dict[str, int] = field(default_factory=dict)
    compactions: list[Compaction] = field(default_factory=list)
    keep_blocks: dict[str, int] = field(default_factory=dict)
