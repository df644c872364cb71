"""ChunkKV: keep whole fixed-size chunks, the same chunks for every head of a layer.

Liu et al., "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient
Long-Context LLM Inference", 2025. Reference read: NVIDIA/kvpress at 8bb29b9,
``kvpress/presses/chunkkv_press.py`` (``ChunkKVPress``), over ``SnapKVPress`` as its
``evaluation/evaluate_registry.py`` composes it, ``chunk_length = 20``.

Per (sequence, layer), over the compressible area (``C`` keys):

1. Token scores are SnapKV's (:func:`~kvllm.methods.scoring.snapkv_scores`), summed
   over the layer's KV heads (kvpress sums the per-head scores over ``dim=1``).
2. The area is cut into chunks of ``chunk_size`` tokens from its first token; the last
   chunk may be shorter. A chunk scores the *mean* of its tokens' layer scores, so a
   short last chunk competes on equal terms (kvpress's rule for the remainder).
3. Chunks are ranked by score; every head of the layer keeps the same tokens.

Budget. kvpress keeps ``max(1, int(n_chunks * (1 - compression_ratio)))`` whole chunks,
so the kept count depends on which chunks win (a short chunk keeps fewer tokens) and
may fall short of or exceed m. The paged engine frees the same number of slots in every
(layer, KV head), so here the chunks are taken whole in rank order while they fit in
m, and the first one that does not fit gives its best tokens (by the layer score) to
fill m exactly. kvpress's whole-chunk set is thus always contained in ours when it has
at most m tokens, and equals ours when ``C`` and m are multiples of the chunk size.

Other deviations: the chunks tile the compressible area only (kvpress tiles the whole
sequence and keeps its observation window by padding it with the top score); each
sequence picks its own chunks (kvpress takes batch 0's, ``top_chunks.indices[0]``).

``chunkkv-head`` is this module's earlier variant, kept for comparison with results
made with it: chunks are ranked per (layer, KV head) by the *sum* of that head's token
scores, and the top-up uses that head's scores. It was run with ``chunk_size = 10``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kvllm.checks import check_int
from kvllm.methods.base import FIELD, Method, Selection, Window, register
from kvllm.methods.scoring import snapkv_scores
from kvllm.methods.snapkv import SnapKVParams


@dataclass(frozen=True)
class ChunkKVParams(SnapKVParams):
    """SnapKV's knobs plus the chunk length.

    Attributes
    ----------
    chunk_size
        Tokens per chunk, in [1, W]; kvpress's ``chunk_length = 20``.
    """

    chunk_size: int = 20

    def check(self, window: int, buffer: int) -> None:
        super().check(window, buffer)
        check_int(f"{FIELD}.chunk_size", self.chunk_size, 1, window)


def chunk_fill(token_scores: Tensor, chunk_scores: Tensor, size: int, budget: int) -> Tensor:
    """Fill ``budget`` slots per row with whole chunks in rank order, then the best tokens of the next.

    Parameters
    ----------
    token_scores
        ``[..., C]`` per-token scores; they order the tokens inside a chunk.
    chunk_scores
        ``[..., ceil(C / size)]`` per-chunk scores; the best chunk is taken first, ties
        to the earlier chunk.
    size
        Tokens per chunk (the last chunk holds the remainder).
    budget
        m; each row keeps ``min(m, C)`` tokens.

    Returns
    -------
    Tensor
        ``[..., min(m, C)]`` indices, sorted ascending.
    """
    c = token_scores.shape[-1]
    # Rank 0 = best chunk; every token inherits its chunk's rank.
    rank = chunk_scores.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
    token_rank = rank.repeat_interleave(size, dim=-1)[..., :c]
    # Fill order: by chunk rank, then by token score inside the chunk (two stable sorts,
    # so no token score is ever rounded against a rank).
    by_score = token_scores.argsort(dim=-1, descending=True, stable=True)
    by_rank = token_rank.gather(-1, by_score).argsort(dim=-1, stable=True)
    order = by_score.gather(-1, by_rank)
    return order[..., : min(budget, c)].sort(dim=-1).values


def _chunk_sums(scores: Tensor, size: int) -> tuple[Tensor, Tensor]:
    """Per-chunk sums of ``scores`` ``[..., C]`` and the chunk lengths."""
    c = scores.shape[-1]
    n_chunks = -(-c // size)
    sums = F.pad(scores, (0, n_chunks * size - c)).unflatten(-1, (n_chunks, size)).sum(-1)
    lengths = torch.full((n_chunks,), size, dtype=scores.dtype, device=scores.device)
    lengths[-1] = c - (n_chunks - 1) * size
    return sums, lengths


@register
class ChunkKV(Method):
    name = "chunkkv"
    Params = ChunkKVParams

    def select(self, window: Window, budget: int) -> Selection:
        p = self.params
        s = snapkv_scores(window, p.obs_window, p.pool_kernel)
        hkv = s.shape[2]
        layer = s.sum(dim=2)  # [B, L, C]: one score per token for all heads of a layer
        sums, lengths = _chunk_sums(layer, p.chunk_size)
        kept = chunk_fill(layer, sums / lengths, p.chunk_size, budget)
        return Selection(kept.unsqueeze(2).expand(-1, -1, hkv, -1).contiguous())


@register
class ChunkKVHead(Method):
    name = "chunkkv-head"
    Params = ChunkKVParams

    def select(self, window: Window, budget: int) -> Selection:
        p = self.params
        s = snapkv_scores(window, p.obs_window, p.pool_kernel)
        sums, _ = _chunk_sums(s, p.chunk_size)
        return Selection(chunk_fill(s, sums, p.chunk_size, budget))
