"""Query capture: the attention backend that records each decode token's post-RoPE query.

The runner publishes, once per step, which rows of the flattened batch are decode
tokens of compressible requests and where each goes in the query ring; every layer's
attention call then stores its rows with one vectorised ``index_put_``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl


@dataclass
class QueryRing:
    """Post-RoPE queries of the last R = W + b + P tokens of each compressible request.

    ``queries[layer]`` is ``[slots, R, Hq, D]``; a request owns one slot from admission
    to finish or preemption, and token at logical position ``t`` sits at ``t % R``.
    """

    queries: list[Tensor]
    ring: int
    free: list[int]
    owner: dict[str, int]

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
    rows: Tensor | None = None  # rows of the flattened batch to keep
    slots: Tensor | None = None  # their ring slots
    positions: Tensor | None = None  # their ring positions (logical position % R)
    layer_of: dict[str, int] | None = None


CAPTURE = StepCapture()


class CapturingCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, plus query capture for compressible decode rows."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):  # type: ignore[override]
        cap = CAPTURE
        if attn_metadata is not None and cap.rows is not None and cap.layer_of is not None:
            store = cap.ring.queries[cap.layer_of[layer.layer_name]]
            store.index_put_((cap.slots, cap.positions), query.index_select(0, cap.rows).to(store.dtype))
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)


class CapturingCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[CPUAttentionBackendImpl]:
        return CapturingCPUAttentionImpl
