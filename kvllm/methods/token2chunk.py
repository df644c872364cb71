"""Token2Chunk: expand top-scoring candidate tokens into flexible contiguous chunks.

Kara (sliding-window KV cache compression for reasoning LLM serving), §Token2Chunk;
the exact procedure is docs/design.md, "Token2Chunk":

1. K = max(1, round(rho * m)) top-scoring tokens are candidates, sorted by index.
2. Each consecutive pair (c_i, c_{i+1}) with an interior gap g_i = c_{i+1} - c_i - 1 > 0
   is a candidate chunk.
3. sigma_i = (s[c_i] + s[c_{i+1}]) / (g_i + 2) ** beta.
4. Gaps are filled whole, greedily by decreasing sigma_i, when g_i fits the remaining
   budget and g_i <= max_gap; otherwise the gap is skipped and the next one tried.
5. What is left of m goes to the best-scoring tokens not yet kept.

The greedy step loops over candidate chunks (at most K - 1 iterations), each one
vectorised over every (sequence, layer, KV head) row at once; nothing loops over tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvllm.methods.scoring import topk_sorted


def token2chunk(scores: Tensor, budget: int, rho: float, beta: float, max_gap: int) -> Tensor:
    """Select exactly ``min(budget, C)`` indices per row of ``scores``.

    Parameters
    ----------
    scores
        ``[..., C]`` importance of each compressible token (finite).
    budget
        m, the slots to keep per row.
    rho, beta, max_gap
        Token2Chunk knobs, see :class:`kvllm.methods.kara.KaraParams`.

    Returns
    -------
    Tensor
        ``[..., m]`` int64 indices, sorted ascending and unique per row.
    """
    *lead, c = scores.shape
    m = min(budget, c)
    s = scores.reshape(-1, c).float()
    rows = s.shape[0]
    k = min(m, max(1, round(rho * m)))
    cand = topk_sorted(s, k)
    keep = torch.zeros(rows, c, dtype=torch.bool, device=s.device)
    keep.scatter_(1, cand, True)
    remaining = torch.full((rows,), m - k, dtype=torch.long, device=s.device)

    if k > 1 and m > k:
        left, right = cand[:, :-1], cand[:, 1:]
        gap = right - left - 1
        fillable = (gap > 0) & (gap <= max_gap)
        sigma = (s.gather(1, left) + s.gather(1, right)) / (gap + 2).float().pow(beta)
        sigma = sigma.masked_fill(~fillable, float("-inf"))
        order = sigma.argsort(dim=1, descending=True, stable=True)
        gap_sorted = gap.gather(1, order)
        fillable_sorted = fillable.gather(1, order)
        taken_sorted = torch.zeros_like(fillable_sorted)
        for j in range(k - 1):
            take = fillable_sorted[:, j] & (gap_sorted[:, j] <= remaining)
            remaining -= torch.where(take, gap_sorted[:, j], 0)
            taken_sorted[:, j] = take
        taken = torch.zeros_like(taken_sorted).scatter_(1, order, taken_sorted).long()
        # Mark each filled interior [left + 1, right) with +1/-1 and integrate: chunks
        # between consecutive candidates never overlap, so the running sum is 0 or 1.
        edges = torch.zeros(rows, c, dtype=torch.long, device=s.device)
        edges.scatter_add_(1, left + 1, taken).scatter_add_(1, right, -taken)
        keep |= edges.cumsum(1) > 0

    extra = int(remaining.max()) if rows else 0
    if extra > 0:
        rest = s.masked_fill(keep, float("-inf")).topk(extra, dim=1).indices
        wanted = torch.arange(extra, device=s.device).unsqueeze(0) < remaining.unsqueeze(1)
        keep |= torch.zeros_like(keep).scatter_(1, rest, wanted)

    indices = keep.nonzero()[:, 1]
    return indices.view(*lead, m)
