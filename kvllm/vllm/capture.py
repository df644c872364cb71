"""Query capture: the attention backend that records each decode token's post-RoPE query.

The runner publishes, once per step, which rows of the flattened batch are decode
tokens of compressible requests and where each goes in the query ring; every layer's
attention call then stores its rows with one ``index_copy_``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl


@dataclass
class QueryRing:
    """Post-RoPE queries of the last R = W + b + P tokens of each compressible request.

    ``queries[layer]`` is ``[slots, R, Hq, D]``; a request owns one slot from admission
    to finish or preemption, and token at logical position ``t`` sits at ``t % R``.
    ``flat[layer]`` is the same buffer viewed ``[slots * R, Hq, D]``: (slot, position)
    is row ``slot * R + position``, which capture writes with one ``index_copy_``.
    """

    queries: list[Tensor]
    ring: int
    free: list[int]
    owner: dict[str, int]
    flat: list[Tensor] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.flat = [q.view(-1, *q.shape[2:]) for q in self.queries]

    @classmethod
    def allocate(cls, layers: int, slots: int, ring: int, heads: int, head_dim: int, dtype: torch.dtype) -> QueryRing:
        queries = [torch.zeros(slots, ring, heads, head_dim, dtype=dtype) for _ in range(layers)]
        return cls(queries, ring, list(range(slots - 1, -1, -1)), {})

    @property
    def bytes_per_request(self) -> int:
        q = self.queries[0]
        return len(self.queries) * q[0].numel() * q.element_size()

    def slot(self, req_id: str) -> int:
        if req_id not in self.owner:
            self.owner[req_id] = self.free.pop()
        return self.owner[req_id]

    def release(self, req_id: str) -> None:
        slot = self.owner.pop(req_id, None)
        if slot is not None:
            self.free.append(slot)


@dataclass
class StepCapture:
    """This step's capture targets, set by the runner before the forward."""

    ring: QueryRing | None = None
    index: Tensor | None = None  # ring row (slot * R + position) of each captured token; None: none this step
    rows: Tensor | None = None  # their rows of the flattened batch; None: rows 0 .. count - 1
    count: int = 0
    layer_of: dict[str, int] | None = None

    def publish(self, ring: QueryRing, slots: np.ndarray, positions: np.ndarray, rows: np.ndarray) -> None:
        """Capture batch ``rows`` (ascending) at ring ``slots``, logical ``positions``, this step."""
        self.ring = ring
        self.index = torch.from_numpy(np.asarray(slots, dtype=np.int64) * ring.ring + positions % ring.ring)
        self.count = len(rows)
        # vLLM puts decode rows first, so the captured rows are usually the batch's first
        # rows (ascending and distinct: they are 0..k-1 exactly when the last is k-1). Then
        # every layer reads them as a slice of its query, a view, instead of a gather.
        leading = self.count > 0 and int(rows[-1]) == self.count - 1
        self.rows = None if leading else torch.from_numpy(np.asarray(rows, dtype=np.int64))

    def clear(self) -> None:
        self.index = self.rows = None
        self.count = 0


# The attribute by which a model's attention layers reach their engine's capture: set by
# that engine's runner, so two engines in one process never share capture state.
LAYER_ATTR = "kvllm_capture"


class CapturingCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, plus query capture for compressible decode rows."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):  # type: ignore[override]
        cap: StepCapture | None = getattr(layer, LAYER_ATTR, None)
        if cap is not None and attn_metadata is not None and cap.index is not None and cap.layer_of is not None:
            # One copy per layer, of a slice of the query (or one gather) into the flat ring:
            # index_select + index_put_ at (slot, position) pairs took about 1.6x as long.
            store = cap.ring.flat[cap.layer_of[layer.layer_name]]
            src = query[: cap.count] if cap.rows is None else query.index_select(0, cap.rows)
            store.index_copy_(0, cap.index, src.to(store.dtype))
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)


class CapturingCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[CPUAttentionBackendImpl]:
        return CapturingCPUAttentionImpl
