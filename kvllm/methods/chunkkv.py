"""ChunkKV: keep whole fixed-size chunks.

Liu et al., "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient
Long-Context LLM Inference", 2025. Our exact form: the compressible area is cut into
chunks of 10 tokens (the last may be shorter); a chunk scores the sum of its tokens'
SnapKV scores (:func:`~kvllm.methods.scoring.snapkv_scores`); the best chunks are kept
whole in order, and where m is not a multiple of the chunk length, the next chunk
contributes its best tokens, so every row keeps exactly m.
"""

from __future__ import annotations

import torch.nn.functional as F

from kvllm.methods.base import Method, Selection, Window, register
from kvllm.methods.scoring import snapkv_scores, topk_sorted


@register
class ChunkKV(Method):
    name = "chunkkv"

    def select(self, window: Window, budget: int) -> Selection:
        cfg = self.config
        s = snapkv_scores(window, cfg.obs_window, cfg.pool_kernel)
        c = s.shape[-1]
        size = cfg.chunk_size
        n_chunks = -(-c // size)
        chunk_sum = F.pad(s, (0, n_chunks * size - c)).unflatten(-1, (n_chunks, size)).sum(-1)
        # rank 0 = best chunk; every token inherits its chunk's rank.
        rank = chunk_sum.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
        token_rank = rank.repeat_interleave(size, dim=-1)[..., :c]
        # Rank dominates; the token score (scaled into [0, 1)) orders within a chunk.
        within = s / (s.amax(dim=-1, keepdim=True) + 1e-12) * 0.5
        key = within - token_rank.to(s.dtype)
        return Selection(topk_sorted(key, min(budget, c)))
