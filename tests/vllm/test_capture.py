"""``QueryRing``: slot bookkeeping, and the ring indexing that capture writes and compaction reads.

The write side goes through the real ``CapturingCPUAttentionImpl.forward``; only vLLM's own
attention (the parent ``forward``) is stubbed out, since it needs an engine's metadata, and the
impl is built without ``__init__``, which needs a vLLM config. The read side replicates the
index arithmetic of ``runner.py::_compact_group`` (a method of the engine's model runner).
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import Tensor

# As in conftest: keep vLLM in-process. Set before vLLM is imported.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

from kvllm.vllm.capture import LAYER_ATTR, CapturingCPUAttentionImpl, QueryRing, StepCapture

LAYERS, SLOTS, RING, HEADS, HEAD_DIM = 3, 4, 6, 4, 8
METADATA = object()  # any non-None attention metadata: the capture only checks for None
CAPTURE = StepCapture()  # the engine's capture state the layers below reach (the fixture renews it)


def _ring(slots: int = SLOTS) -> QueryRing:
    return QueryRing.allocate(
        layers=LAYERS, slots=slots, ring=RING, heads=HEADS, head_dim=HEAD_DIM, dtype=torch.float32
    )


@pytest.mark.parametrize(("dtype", "size"), [(torch.float32, 4), (torch.bfloat16, 2)])
def test_allocate_shapes_and_bytes_per_request(dtype: torch.dtype, size: int) -> None:
    """One zeroed ``[slots, ring, Hq, D]`` buffer per layer; a request costs one slot of every layer."""
    ring = QueryRing.allocate(layers=LAYERS, slots=SLOTS, ring=RING, heads=HEADS, head_dim=HEAD_DIM, dtype=dtype)
    assert len(ring.queries) == LAYERS
    assert len({q.data_ptr() for q in ring.queries}) == LAYERS  # separate buffers, not one aliased
    for q in ring.queries:
        assert q.shape == (SLOTS, RING, HEADS, HEAD_DIM)
        assert q.dtype == dtype
        assert not q.any()
    assert ring.ring == RING
    assert ring.bytes_per_request == LAYERS * RING * HEADS * HEAD_DIM * size
    assert sorted(ring.free) == list(range(SLOTS)) and ring.owner == {}


def test_slot_is_stable_distinct_and_reused_after_release() -> None:
    """A request keeps its slot until released; a freed slot goes to the next new request."""
    ring = _ring()
    a, b, c = ring.slot("a"), ring.slot("b"), ring.slot("c")
    assert len({a, b, c}) == 3
    assert {a, b, c} <= set(range(SLOTS))
    assert ring.slot("a") == a and ring.slot("b") == b  # asking again does not allocate
    assert len(ring.free) == SLOTS - 3

    ring.release("b")
    assert "b" not in ring.owner
    assert ring.slot("d") == b  # the freed slot, not the one still free
    assert ring.slot("a") == a and ring.slot("c") == c

    ring.release("never-admitted")  # e.g. finished before it was ever compressible
    ring.release("b")  # already released: must not free "d"'s slot a second time
    assert ring.owner == {"a": a, "c": c, "d": b}
    assert len(ring.free) == SLOTS - 3

    for req_id in ("a", "c", "d"):
        ring.release(req_id)
    assert ring.owner == {}
    assert sorted(ring.free) == list(range(SLOTS))
    assert len({ring.slot(f"new{i}") for i in range(SLOTS)}) == SLOTS  # all usable again


def test_exhausting_slots_raises() -> None:
    """More live requests than slots is a bug upstream (slots = max_num_seqs): it fails loudly."""
    ring = _ring(slots=2)
    a = ring.slot("a")
    ring.slot("b")
    with pytest.raises(IndexError):
        ring.slot("c")
    assert ring.owner.keys() == {"a", "b"}  # the failed request took nothing
    ring.release("a")
    assert ring.slot("c") == a


@pytest.fixture
def step(monkeypatch: pytest.MonkeyPatch) -> CapturingCPUAttentionImpl:
    """The capturing impl with vLLM's attention stubbed out, and a fresh ``CAPTURE``."""
    monkeypatch.setattr(sys.modules[__name__], "CAPTURE", StepCapture())
    monkeypatch.setattr(CPUAttentionBackendImpl, "forward", lambda self, layer, q, k, v, kv, meta, out, *a, **kw: out)
    return object.__new__(CapturingCPUAttentionImpl)


def _forward(impl: CapturingCPUAttentionImpl, layer: str, query: Tensor, metadata: object = METADATA) -> Tensor:
    out = torch.empty(query.shape[0], HEADS * HEAD_DIM)
    layer_module = SimpleNamespace(layer_name=layer, **{LAYER_ATTR: CAPTURE})
    return impl.forward(layer_module, query, None, None, None, metadata, out)


def test_capture_wraps_around_and_compaction_reads_last_queries(step: CapturingCPUAttentionImpl) -> None:
    """Decode over more than ``ring`` positions: the ring keeps exactly the last ``ring`` queries, each
    at ``t % ring``, and the runner's read ``(first + arange(n)) % ring`` returns the last n in order."""
    ring = _ring()
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    CAPTURE.ring = ring
    CAPTURE.layer_of = {name: i for i, name in enumerate(names)}
    reqs = ["a", "b"]
    slots = torch.tensor([ring.slot(r) for r in reqs])
    slots_np = slots.numpy()
    # Request "b" starts decoding 3 tokens later than "a", so their ring positions differ.
    starts = {"a": 10, "b": 13}
    steps = 2 * RING + 3
    gen = torch.Generator().manual_seed(0)
    history: dict[tuple[str, int], list[Tensor]] = {}  # (req, layer) -> query at each logical position

    for s in range(steps):
        # Batch rows: a prefill chunk of some other request (rows 0-2), then one decode row each.
        batch = torch.randn(5, HEADS, HEAD_DIM, generator=gen)
        # Logical positions: publish takes them modulo the ring.
        CAPTURE.publish(ring, slots_np, np.array([starts[r] + s for r in reqs]), np.array([3, 4]))
        assert CAPTURE.rows is not None  # not the batch's first rows: gathered
        for layer, name in enumerate(names):
            q = batch + layer  # each layer sees its own queries
            out = _forward(step, name, q)
            assert out.shape == (5, HEADS * HEAD_DIM)
            for r, row in zip(reqs, (3, 4), strict=True):
                history.setdefault((r, layer), []).append(q[row])

    for layer in range(LAYERS):
        store = ring.queries[layer]
        for i, r in enumerate(reqs):
            seen = history[(r, layer)]
            last = {starts[r] + s: q for s, q in enumerate(seen)}  # logical position -> query
            for t in range(starts[r] + steps - RING, starts[r] + steps):  # exactly the last RING tokens
                torch.testing.assert_close(store[slots[i], t % RING], last[t], rtol=0, atol=0)

        # runner._compact_group: queries of the last n tokens, oldest first.
        n = RING - 1
        first = torch.tensor([starts[r] + steps - n for r in reqs])
        positions = (first.unsqueeze(1) + torch.arange(n)) % RING  # [B, n]
        got = store[slots.unsqueeze(1), positions]  # [B, n, Hq, D]
        for i, r in enumerate(reqs):
            torch.testing.assert_close(got[i], torch.stack(history[(r, layer)][-n:]), rtol=0, atol=0)

    # Slots nobody owns were never written.
    idle = [s for s in range(SLOTS) if s not in slots.tolist()]
    assert not any(q[idle].any() for q in ring.queries)


def test_capture_of_leading_rows_reads_a_slice(step: CapturingCPUAttentionImpl) -> None:
    """Captured rows 0..k-1 (decode rows first, as vLLM orders a batch) are stored from a slice
    of the query, exactly as a gather of those rows would; rows after them are left alone."""
    ring = _ring()
    CAPTURE.ring = ring
    CAPTURE.layer_of = {"l0": 0}
    slots = np.array([ring.slot("a"), ring.slot("b")])
    CAPTURE.publish(ring, slots, np.array([RING + 1, 2]), np.array([0, 1]))
    assert CAPTURE.rows is None and CAPTURE.count == 2
    query = torch.randn(4, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1))  # rows 2-3: a prefill
    _forward(step, "l0", query)
    store = ring.queries[0]
    torch.testing.assert_close(store[slots[0], 1], query[0], rtol=0, atol=0)
    torch.testing.assert_close(store[slots[1], 2], query[1], rtol=0, atol=0)
    assert int((store != 0).any(dim=(-1, -2)).sum()) == 2  # nothing else written


def test_capture_skips_warmup_and_steps_without_decode_rows(step: CapturingCPUAttentionImpl) -> None:
    """No metadata (vLLM's warm-up) or nothing published (or cleared): nothing is stored."""
    ring = _ring()
    CAPTURE.ring = ring
    CAPTURE.layer_of = {"l0": 0}
    query = torch.ones(1, HEADS, HEAD_DIM)

    CAPTURE.publish(ring, np.array([ring.slot("a")]), np.array([0]), np.array([0]))
    _forward(step, "l0", query, metadata=None)
    CAPTURE.clear()
    _forward(step, "l0", query)
    assert not ring.queries[0].any()

    CAPTURE.publish(ring, np.array([ring.slot("a")]), np.array([0]), np.array([0]))  # published: stored
    _forward(step, "l0", query)
    assert ring.queries[0].any()
