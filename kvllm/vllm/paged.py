"""Reading and rewriting slots of vLLM's CPU paged KV cache.

A layer's cache is ``[num_blocks, Hkv, block_size, 2 * D]``; each (block, head) page
holds K then V. For the ``vec``/``vec16`` ISAs (x86 without AMX, fp32 or bf16) K is
stored transposed, ``[D, block_size]``, and V plainly, ``[block_size, D]``; these views
read back exactly what ``cpu_attn_reshape_and_cache`` wrote. Writes always go through
that op, so the ISA's packing stays the backend's business.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from vllm import _custom_ops as ops

READABLE_ISAS = ("vec", "vec16")


def attention_isa(vllm_config: Any) -> str:
    """The ISA vLLM's CPU attention backend will pick for this engine (it decides per
    layer group at start-up, from the dtype, block size, head size and KV cache dtype)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    model = vllm_config.model_config
    cache = vllm_config.cache_config
    return _get_attn_isa(model.dtype, cache.block_size, model.get_head_size(), cache.cache_dtype)


def slots_of(block_ids: Tensor, positions: Tensor, block_size: int) -> Tensor:
    """Physical slot ids of physical token ``positions`` of one request."""
    return block_ids[positions // block_size] * block_size + positions % block_size


def _views(kv: Tensor) -> tuple[Tensor, Tensor]:
    blocks, heads, block_size, d2 = kv.shape
    d = d2 // 2
    pages = kv.view(blocks, heads, 2, block_size * d)
    return pages[:, :, 0].view(blocks, heads, d, block_size), pages[:, :, 1].view(blocks, heads, block_size, d)


def read(kv: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
    """K and V at ``slots``, as ``[Hkv, ..., D]`` for ``slots`` of any shape ``[...]``.

    ``slots`` may also be ``[Hkv, n]``: then head ``h`` reads its own row of slots.
    """
    k_t, v = _views(kv)
    block_size = kv.shape[2]
    heads = torch.arange(kv.shape[1], device=kv.device)
    if slots.dim() == 2 and slots.shape[0] == kv.shape[1]:
        b, o, h = slots // block_size, slots % block_size, heads.unsqueeze(1)
        return k_t[b, h, :, o], v[b, h, o, :]  # [Hkv, n, D]
    b, o = slots // block_size, slots % block_size
    return read_keys(kv, slots), v[b, :, o, :].movedim(-2, 0)


def read_keys(kv: Tensor, slots: Tensor) -> Tensor:
    """K alone at ``slots`` of any shape ``[...]``, shared by all heads, as ``[Hkv, ..., D]``."""
    b, o = slots // kv.shape[2], slots % kv.shape[2]
    return _views(kv)[0][b, :, :, o].movedim(-2, 0)


def read_spans(caches: Sequence[Tensor], slots: Tensor, values: bool = True) -> tuple[Tensor, Tensor | None]:
    """Keys and values at ``slots`` ``[B, span]`` in each layer's cache of ``caches``, as
    ``[B, L, Hkv, span, D]`` each: a round's window, one gather per layer and tensor.

    With ``values=False`` only the keys are gathered (the values come back ``None``): a
    method that does not read them (``Method.reads_values``) spares a round that copy,
    a fifth of the round at qwen3-0.6b-4l's shape with 16 requests
    (docs/appendix/method-notes.md, "What a round reads, and what it costs").
    """
    b, span = slots.shape
    # Flat slots: [B, span] slots with B == Hkv would read as per-head rows in `read`.
    flat = slots.flatten()
    keys, vals = [], []
    for kv in caches:
        if values:
            k, v = read(kv, flat)
            vals.append(v.unflatten(1, (b, span)).transpose(0, 1))  # [Hkv, B*span, D] -> [B, Hkv, span, D]
        else:
            k = read_keys(kv, flat)
        keys.append(k.unflatten(1, (b, span)).transpose(0, 1))
    return torch.stack(keys, dim=1), torch.stack(vals, dim=1) if values else None


def write(kv: Tensor, keys: Tensor, values: Tensor, slots: Tensor, isa: str) -> None:
    """Store ``keys``/``values`` ``[n, Hkv, D]`` at ``slots`` ``[n]`` through the backend op."""
    blocks, heads, block_size, d2 = kv.shape
    key_cache, value_cache = kv.view(blocks, heads, block_size * 2, d2 // 2).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(
        keys.contiguous(), values.contiguous(), key_cache, value_cache, slots.to(torch.int64), isa
    )
