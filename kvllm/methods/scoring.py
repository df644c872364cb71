"""Attention-based importance scores shared by the methods, all computed in fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvllm.methods.base import Window

# Bound on one chunk's attention matrix (elements). The passes over it (max, exp, sum,
# the column-sum matvec) are memory-bound: a 2 MiB chunk stays in cache between passes,
# which scored a 16-request round of the tiny model about 1.6x faster than one 26 MB
# matrix (a profile of a Kara round, in docs/throughput.md until commit 1930a98 rewrote it).
_MAX_CHUNK_ELEMENTS = 1 << 19


def attention_scores(
    window: Window,
    *,
    causal: bool,
    last_queries: int | None = None,
    band: int = 0,
    given_later: bool = False,
    scale: float | None = None,
) -> Tensor:
    """Column sums of softmax attention, per KV head, over the window's keys.

    ``A_g = softmax(Q_g K^T / sqrt(d))`` for every query head ``g`` of a KV head's GQA
    group; the score of key ``i`` is ``sum_g sum_j A_g[j, i]`` (docs/design.md, "Kara").

    Parameters
    ----------
    window
        The queries and keys; the queries are those of the span's last tokens.
    causal
        Mask key ``i`` from query ``j`` when ``i`` comes after ``j``'s own token.
        ``False`` gives Kara's bidirectional scoring.
    last_queries
        Use only the last this many queries (the SnapKV observation window).
    band
        Mask key ``i`` from query ``j`` when their tokens are fewer than ``band`` apart,
        before the softmax (``kara-far``); a query with no key left adds nothing.
    given_later
        Also add to token ``t``'s score the attention its own query gives to the keys
        after it, ``sum_g sum_{i > t} A_g[t, i]`` (``kara-twoway``); a token with no
        query among the used ones adds nothing.
    scale
        The logits' factor, ``1 / sqrt(d)`` when ``None``; kvpress's non-causal scorer
        (``noncausal-attn``, ``compactor``) uses 1.

    Returns
    -------
    Tensor
        ``[B, L, Hkv, N]`` fp32 scores for all ``N`` keys of the span.
    """
    q, k = window.queries, window.keys
    if last_queries is not None:
        q = q[..., -last_queries:, :]
    b, n_layers, hq, nq, d = q.shape
    hkv, n = k.shape[2], k.shape[3]
    g = hq // hkv
    # One (sequence, layer, KV head) per bmm batch entry; its group's queries stacked.
    heads = b * n_layers * hkv
    qf = q.reshape(heads, g * nq, d)
    kf = k.reshape(heads, n, d)
    mask = None
    # Query j is the token at span position n - nq + j.
    q_pos = torch.arange(n - nq, n, device=k.device).unsqueeze(1)
    k_pos = torch.arange(n, device=k.device).unsqueeze(0)
    if causal:
        mask = k_pos > q_pos
    if band > 0:
        near = (k_pos - q_pos).abs() < band
        mask = near if mask is None else mask | near
    later = (k_pos > q_pos).float() if given_later else None
    factor = d**-0.5 if scale is None else scale
    step = max(1, _MAX_CHUNK_ELEMENTS // (g * nq * n))
    out = torch.empty(heads, n, dtype=torch.float32, device=k.device)
    for lo in range(0, heads, step):
        # Scaling the queries, not the logits: g * nq * d elements instead of g * nq * n.
        logits = torch.bmm(qf[lo : lo + step].float() * factor, kf[lo : lo + step].float().transpose(1, 2))
        if mask is not None:
            logits.view(-1, g, nq, n).masked_fill_(mask, float("-inf"))
        # Softmax without materialising the normalised matrix: with E = exp(logits - max)
        # and row sums z, sum_j A[j, i] = sum_j E[j, i] / z_j, a single batched matvec.
        peak = logits.amax(dim=-1, keepdim=True)
        logits -= peak.clamp_min(torch.finfo(torch.float32).min)  # a fully masked row stays -inf
        exp = logits.exp_()
        z = exp.sum(dim=-1)
        inv_z = torch.where(z > 0, z.reciprocal(), torch.zeros_like(z)).unsqueeze(1)
        out[lo : lo + step] = torch.bmm(inv_z, exp).squeeze(1)
        if later is not None:
            # Each query row's mass on later keys, normalised and summed over the group,
            # lands on the query's own token: the last nq positions of the span.
            later_mass = (exp.view(-1, g, nq, n) * later).sum(-1) * inv_z.view(-1, g, nq)
            out[lo : lo + step, n - nq :] += later_mass.sum(1)
    return out.view(b, n_layers, hkv, n)


def snapkv_scores(window: Window, obs_window: int, pool_kernel: int) -> Tensor:
    """SnapKV importance of the compressible keys: ``[B, L, Hkv, C]`` fp32.

    Causal attention of the last ``obs_window`` queries, summed over them and the GQA
    group, then average-pooled along the keys with ``pool_kernel`` (stride 1, zero
    padding counted), as in SnapKV's reference code.
    """
    nq = min(obs_window, window.queries.shape[3])
    return avg_pool(attention_scores(window, causal=True, last_queries=nq)[..., : window.n_compress], pool_kernel)


def avg_pool(scores: Tensor, kernel: int) -> Tensor:
    """``scores`` ``[..., N]`` average-pooled along the last dim: stride 1, zero padding
    counted, as SnapKV's and kvpress's ``F.avg_pool1d`` (a kernel of 1 or less: as is)."""
    if kernel <= 1:
        return scores
    shape = scores.shape
    return F.avg_pool1d(scores.reshape(-1, 1, shape[-1]), kernel, stride=1, padding=kernel // 2).view(shape)


def zscore(scores: Tensor) -> Tensor:
    """``scores`` ``[..., C]`` z-scored along the last dim (a flat row scores 0)."""
    mean = scores.mean(dim=-1, keepdim=True)
    # A one-entry row has no spread (and the unbiased std of one entry is undefined).
    std = scores.std(dim=-1, keepdim=True, correction=int(scores.shape[-1] > 1)).nan_to_num(0.0).clamp_min(1e-6)
    return (scores - mean) / std


def topk_sorted(scores: Tensor, k: int) -> Tensor:
    """Indices of the ``k`` largest entries of the last dim, sorted ascending."""
    return scores.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values


def topk_variable(scores: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row top-``counts`` of ``scores`` for methods whose counts differ by row.

    Parameters
    ----------
    scores
        ``[..., C]`` scores.
    counts
        Integer tensor broadcastable to ``scores.shape[:-1]``, each in ``[0, C]``.

    Returns
    -------
    tuple[Tensor, Tensor]
        ``indices`` and ``valid``, both ``[..., max(counts)]``: each row's valid
        indices first, ascending; padding entries are 0 and not valid.
    """
    c = scores.shape[-1]
    counts = counts.expand(scores.shape[:-1])
    width = int(counts.max())
    top = scores.topk(width, dim=-1).indices
    valid = torch.arange(width, device=scores.device) < counts.unsqueeze(-1)
    # Push the padding past every real index, sort, then point it at index 0.
    ordered = top.masked_fill(~valid, c).sort(dim=-1).values
    return ordered.masked_fill(ordered == c, 0), ordered < c
