"""Compaction of the reference backend's KV storage: keep selected slots of a region
and close the gap.

It works on whole per-layer tensors; the paged engine's block-level rewrite
(:mod:`kvllm.vllm.runner`) must produce the same slot order, which the hf-vs-vLLM
differential tests check.
"""

from __future__ import annotations

import torch
from torch import Tensor


def compact(x: Tensor, start: int, n_compress: int, indices: Tensor) -> Tensor:
    """Keep ``indices`` of ``x``'s region ``[start, start + n_compress)`` along dim 2.

    Parameters
    ----------
    x
        ``[B, H, N, ...]`` storage (keys, values, or a ``[B, H, N]`` mask).
    start, n_compress
        The compressible region, in slots.
    indices
        ``[B, H, M]`` kept offsets into the region, ascending per row.

    Returns
    -------
    Tensor
        ``[B, H, N - n_compress + M, ...]``: the slots before the region, the kept
        slots in order, then everything after the region moved down behind them.
        Keys are cached after RoPE, so a moved key keeps its position.
    """
    region = x[:, :, start : start + n_compress]
    trailing = (1,) * (x.dim() - 3)
    idx = indices.view(*indices.shape, *trailing).expand(*indices.shape, *x.shape[3:])
    return torch.cat([x[:, :, :start], region.gather(2, idx), x[:, :, start + n_compress :]], dim=2)
