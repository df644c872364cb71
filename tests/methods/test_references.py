"""Every registered method against a small, independent re-implementation of its reference.

Each reference below is written from the method's paper and the reference code named
in its module's docstring (kvpress at 8bb29b9 and 0.5.5, R-KV at d15c976,
FMInference/H2O at ac75c2a, ...), row by row in plain torch, without calling the
package's scoring code,
and gives the kept index set on seeded random tensors. A method must keep exactly that
set. Kara's reference is its spec (bidirectional column sums + Token2Chunk; only the
chunk step reuses :func:`~kvllm.methods.token2chunk.token2chunk`). Random has no set
to match; its reference checks that draws are reproducible per seed.

A newly registered method without an entry in :data:`REFERENCES` fails
:func:`test_every_registered_method_has_a_reference`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from kvllm.methods import Method, Selection, Window, available, calibrated, method_class
from kvllm.methods.rope import Rope
from kvllm.methods.token2chunk import token2chunk

# A reference: (window, budget, the method's resolved params) -> kept mask [B, L, Hkv, C].
Reference = Callable[[Window, int, Any], Tensor]
# A check: (method, window, budget) -> None, raising when the method disagrees.
Check = Callable[[Method, Window, int], None]


# Plain RoPE of the d = 8 heads below, and the table's length: the spans of
# make_window and their 512 future positions (ExpectedAttention's default) fit in it.
INV_FREQ = 1.0 / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
TABLE = 1024
POSITIONS = (3, 250)


def make_window(
    buffer: int,
    *,
    n_compress: int = 48,
    layers: int = 4,
    seed: int = 0,
    positions: tuple[int, int] = POSITIONS,
    table: int = TABLE,
) -> Window:
    """2 sequences x ``layers`` x 2 KV heads (GQA group 2), d = 8; queries of every span token.

    It carries what both backends give: values, the spans' first ``positions``, a RoPE
    table of ``table`` positions and one stream seed per sequence. The queries and keys
    are drawn first, so they are those of a window without the rest.
    """
    gen = torch.Generator().manual_seed(seed)
    n = n_compress + buffer
    q = 1.5 * torch.randn(2, layers, 4, n, 8, generator=gen)
    k = 1.5 * torch.randn(2, layers, 2, n, 8, generator=gen)
    v = torch.randn(2, layers, 2, n, 8, generator=gen) * torch.rand(2, layers, 2, n, 1, generator=gen)
    rope = Rope.from_inv_freq(INV_FREQ.float(), table)
    return Window(q, k, n_compress, (seed + 1, seed + 2), positions, v, rope)


def kept_mask(selection: Selection, c: int) -> Tensor:
    idx = selection.indices
    valid = torch.ones_like(idx, dtype=torch.bool) if selection.valid is None else selection.valid
    counts = torch.zeros((*idx.shape[:-1], c), dtype=torch.long).scatter_add_(-1, idx, valid.long())
    assert counts.max() <= 1, "an index is kept twice"
    return counts > 0


def rows_to_mask(window: Window, kept: Callable[[int, int], list[list[int]]]) -> Tensor:
    """Build the mask from ``kept(b, l)``: one index list per KV head."""
    b, layers, hkv = window.keys.shape[:3]
    mask = torch.zeros(b, layers, hkv, window.n_compress, dtype=torch.bool)
    for bi in range(b):
        for li in range(layers):
            for h, indices in enumerate(kept(bi, li)):
                mask[bi, li, h, list(indices)] = True
    return mask


def top(scores: Tensor, m: int) -> list[int]:
    return sorted(scores.topk(m).indices.tolist())


def avg_pool(x: Tensor, kernel: int) -> Tensor:
    """SnapKV's ``avg_pool1d(padding=k // 2, stride=1)``: zeros padded and counted."""
    r = kernel // 2
    padded = torch.cat([x.new_zeros(r), x, x.new_zeros(r)])
    return torch.stack([padded[i : i + kernel].sum() / kernel for i in range(len(x))])


def max_pool(x: Tensor, kernel: int) -> Tensor:
    """R-KV's ``max_pool1d(padding=k // 2, stride=1)``: padding never wins."""
    r = kernel // 2
    return torch.stack([x[max(0, i - r) : i + r + 1].max() for i in range(len(x))])


def attention(q: Tensor, k: Tensor, *, causal: bool) -> Tensor:
    """``[Hq, Nq, N]`` softmax attention of the span's last ``Nq`` queries; KV head ``h // G``."""
    hq, nq, d = q.shape
    n = k.shape[1]
    krep = k.repeat_interleave(hq // k.shape[0], dim=0)
    logits = q @ krep.transpose(1, 2) / math.sqrt(d)
    if causal:
        # Query j is the token at span position n - nq + j: it sees keys <= that.
        future = torch.ones(nq, n, dtype=torch.bool).triu(diagonal=n - nq + 1)
        logits = logits.masked_fill(future, float("-inf"))
    return logits.softmax(-1)


def kvpress_snapkv(window: Window, bi: int, li: int, obs: int, kernel: int) -> Tensor:
    """kvpress's ``SnapKVPress.score`` without the padded window: ``[Hkv, N - obs]``.

    The last ``obs`` queries, causal, mean over them, average-pooled per query head,
    then the mean over the GQA group.
    """
    q, k = window.queries[bi, li], window.keys[bi, li]
    hkv, n = k.shape[:2]
    assert n - obs == window.n_compress, "kvpress's set is ours when obs_window == buffer"
    attn = attention(q[:, -obs:], k, causal=True)[..., :-obs].mean(1)
    pooled = torch.stack([avg_pool(row, kernel) for row in attn])
    return pooled.view(hkv, -1, n - obs).mean(1)


def observed_snapkv(window: Window, bi: int, li: int, obs: int, kernel: int) -> Tensor:
    """SnapKV's scores by their definition, for any observation window: ``[Hkv, C]``.

    kvpress scores "all but the window" with the window's queries; here the scored keys
    are the compressible area and the observers the span's last ``obs`` tokens, which
    reach into the area when ``obs`` exceeds the buffer. So, query by query: the token
    at span position ``p`` (the last ``obs``) attends causally to keys ``0..p``; its
    weights on the area's keys add to their scores (keys after ``p`` get nothing from
    it), over the GQA group; then the zero-padded average pool along the area, as SnapKV
    pools the keys it scores. In fp64, with no shared code with the package.
    """
    q, k = window.queries[bi, li].double(), window.keys[bi, li].double()
    hq, nq, d = q.shape
    hkv, n = k.shape[:2]
    c, group = window.n_compress, hq // hkv
    scores = torch.zeros(hkv, c, dtype=torch.float64)
    for h in range(hq):
        for p in range(n - obs, n):
            query = q[h, nq - (n - p)]  # the queries are the span's last nq tokens'
            weights = (k[h // group, : p + 1] @ query / math.sqrt(d)).softmax(-1)
            scores[h // group, : min(c, p + 1)] += weights[:c]
    return torch.stack([avg_pool(row, kernel) for row in scores])


def snap_scores(window: Window, bi: int, li: int, obs: int, kernel: int) -> Tensor:
    """kvpress verbatim where its window is the buffer, the definition past it."""
    if window.keys.shape[3] - obs == window.n_compress:
        return kvpress_snapkv(window, bi, li, obs, kernel)
    return observed_snapkv(window, bi, li, obs, kernel)


# ----------------------------------------------------------------------------- Kara


def kara_scores(window: Window, bi: int, li: int, *, causal: bool) -> Tensor:
    """The spec: ``sum_g sum_j softmax(Q_g K^T / sqrt(d))[j, i]`` over all W + b queries."""
    q, k = window.queries[bi, li], window.keys[bi, li]
    attn = attention(q, k, causal=causal).sum(1)  # [Hq, N]
    return attn.view(k.shape[0], -1, k.shape[1]).sum(1)[:, : window.n_compress]


def kara_late_reference(window: Window, budget: int, params: Any) -> Tensor:
    """kara-late's spec: Kara's column sums over the last ``obs_window`` queries only."""

    def kept(bi: int, li: int) -> list[list[int]]:
        q, k = window.queries[bi, li][:, -params.obs_window :], window.keys[bi, li]
        attn = attention(q, k, causal=False).sum(1)  # bidirectional: no mask
        s = attn.view(k.shape[0], -1, k.shape[1]).sum(1)[:, : window.n_compress]
        return token2chunk(s, budget, params.rho, params.beta, params.max_gap).tolist()

    return rows_to_mask(window, kept)


def kara_far_reference(window: Window, budget: int, params: Any) -> Tensor:
    """kara-far's spec: Kara's, with each query blind to keys fewer than ``band`` tokens
    from its own (masked before the softmax; a query left with no key adds nothing)."""

    def kept(bi: int, li: int) -> list[list[int]]:
        q, k = window.queries[bi, li], window.keys[bi, li]
        hq, nq, d = q.shape
        n = k.shape[1]
        krep = k.repeat_interleave(hq // k.shape[0], dim=0)
        scores = torch.zeros(hq, n)
        for j in range(nq):
            pos = n - nq + j
            far = [i for i in range(n) if abs(i - pos) >= params.band]
            if far:
                logits = (krep[:, far] @ q[:, j].unsqueeze(-1)).squeeze(-1)  # [Hq, len(far)]
                scores[:, far] += (logits / math.sqrt(d)).softmax(-1)
        s = scores.view(k.shape[0], -1, n).sum(1)[:, : window.n_compress]
        return token2chunk(s, budget, params.rho, params.beta, params.max_gap).tolist()

    return rows_to_mask(window, kept)


def kara_twoway_reference(window: Window, budget: int, params: Any) -> Tensor:
    """kara-twoway's spec: Kara's column sum, plus what each token's own query gives to
    the later keys of the span, over the group; a token without a query gives nothing."""

    def kept(bi: int, li: int) -> list[list[int]]:
        q, k = window.queries[bi, li], window.keys[bi, li]
        hq, nq, _ = q.shape
        hkv, n = k.shape[:2]
        attn = attention(q, k, causal=False)  # [Hq, Nq, N]
        scores = attn.sum(1)  # received
        for j in range(nq):
            pos = n - nq + j  # query j is this token's
            scores[:, pos] += attn[:, j, pos + 1 :].sum(-1)
        s = scores.view(hkv, hq // hkv, n).sum(1)[:, : window.n_compress]
        return token2chunk(s, budget, params.rho, params.beta, params.max_gap).tolist()

    return rows_to_mask(window, kept)


def kara_reference(causal: bool, chunks: bool) -> Reference:
    def reference(window: Window, budget: int, params: Any) -> Tensor:
        def kept(bi: int, li: int) -> list[list[int]]:
            s = kara_scores(window, bi, li, causal=causal)
            if not chunks:
                return [top(row, min(budget, len(row))) for row in s]
            return token2chunk(s, budget, params.rho, params.beta, params.max_gap).tolist()

        return rows_to_mask(window, kept)

    return reference


# ------------------------------------------------------------------ SnapKV family


def snapkv_reference(window: Window, budget: int, params: Any) -> Tensor:
    def kept(bi: int, li: int) -> list[list[int]]:
        s = snap_scores(window, bi, li, params.obs_window, params.pool_kernel)
        return [top(row, budget) for row in s]

    return rows_to_mask(window, kept)


def pyramid_schedule(n_layers: int, m: int, beta: float, cap: int) -> list[int]:
    """PyramidKV's linear schedule (kvpress's ``get_layer_budget``), clamped, then rounded
    by largest remainder so that it sums to ``n_layers * m``."""
    if n_layers == 1:
        return [m]
    lo = m / beta
    hi = 2 * m - lo
    if hi > cap:  # kvpress: the first layer is capped, the last ones take the rest
        hi, lo = cap, 2 * m - cap
    if lo < 1:
        hi, lo = 2 * m - 1, 1
    exact = [hi - (hi - lo) * layer / (n_layers - 1) for layer in range(n_layers)]
    counts = [math.floor(x + 1e-9) for x in exact]
    remainders = sorted(range(n_layers), key=lambda layer: (counts[layer] - exact[layer], layer))
    for layer in remainders[: n_layers * m - sum(counts)]:
        counts[layer] += 1
    return counts


def pyramidkv_reference(window: Window, budget: int, params: Any) -> Tensor:
    layers = window.keys.shape[1]
    counts = pyramid_schedule(layers, budget, params.beta, window.n_compress)

    def kept(bi: int, li: int) -> list[list[int]]:
        s = snap_scores(window, bi, li, params.obs_window, params.pool_kernel)
        return [top(row, counts[li]) for row in s]

    return rows_to_mask(window, kept)


def adakv_reference(window: Window, budget: int, params: Any) -> Tensor:
    """kvpress's ``AdaKVPress.compress``: safeguard each head's top ``int(m * alpha)``,
    then prune the layer's global bottom ``H * (C - m)``."""

    def kept(bi: int, li: int) -> list[list[int]]:
        s = snap_scores(window, bi, li, params.obs_window, params.pool_kernel)
        hkv, c = s.shape
        n_safe = int(budget * params.floor)
        s = s.clone()
        for row in s:
            row[row.topk(n_safe).indices] = torch.finfo(s.dtype).max
        pruned = set((-s).flatten().topk(hkv * (c - budget)).indices.tolist())
        return [[i for i in range(c) if h * c + i not in pruned] for h in range(hkv)]

    return rows_to_mask(window, kept)


def chunk_fill(token_scores: Tensor, chunk_scores: list[float], size: int, m: int) -> list[int]:
    """Whole chunks by decreasing score (ties: earlier chunk) while they fit in m, then the
    best tokens of the first chunk that does not fit."""
    c = len(token_scores)
    kept: list[int] = []
    for chunk in sorted(range(len(chunk_scores)), key=lambda i: (-chunk_scores[i], i)):
        tokens = list(range(chunk * size, min(c, (chunk + 1) * size)))
        room = m - len(kept)
        if len(tokens) <= room:
            kept += tokens
        else:
            kept += sorted(tokens, key=lambda t: -float(token_scores[t]))[:room]
            break
    return sorted(kept)


def chunk_means(scores: Tensor, size: int) -> list[float]:
    """kvpress's chunk score: the mean of its tokens, the short last chunk included."""
    return [float(scores[lo : lo + size].mean()) for lo in range(0, len(scores), size)]


def chunkkv_reference(window: Window, budget: int, params: Any) -> Tensor:
    """kvpress's ``ChunkKVPress``: token scores summed over the layer's heads, chunk
    means, the same chunks for all heads; topped up to exactly m."""

    def kept(bi: int, li: int) -> list[list[int]]:
        s = snap_scores(window, bi, li, params.obs_window, params.pool_kernel)
        layer = s.sum(0)
        row = chunk_fill(layer, chunk_means(layer, params.chunk_size), params.chunk_size, budget)
        return [row] * s.shape[0]

    return rows_to_mask(window, kept)


def chunkkv_head_reference(window: Window, budget: int, params: Any) -> Tensor:
    """The per-head variant: each head ranks chunks by the sum of its own scores."""
    size = params.chunk_size

    def kept(bi: int, li: int) -> list[list[int]]:
        s = snap_scores(window, bi, li, params.obs_window, params.pool_kernel)
        sums = [[float(row[lo : lo + size].sum()) for lo in range(0, len(row), size)] for row in s]
        return [chunk_fill(row, chunk, size, budget) for row, chunk in zip(s, sums, strict=True)]

    return rows_to_mask(window, kept)


# ------------------------------------------------------------------------- R-KV


def rkv_reference(window: Window, budget: int, params: Any) -> Tensor:
    """R-KV's ``R1KV.update_kv`` with ``compute_attention_scores(pooling="max")`` and
    ``cal_similarity(threshold, retain_direction="last")``, per sequence and layer.

    Its candidates, ``key_states[:, :, :-window_size]``, are our compressible keys; with
    ``buffer == obs_window`` the code below is R-KV's line for line.
    """
    w, lam, kernel, threshold = params.obs_window, params.lam, params.pool_kernel, params.sim_threshold
    c = window.n_compress

    def kept(bi: int, li: int) -> list[list[int]]:
        query_states = window.queries[bi, li, :, -w:]  # R-KV's query cache: the last w queries
        key_states = window.keys[bi, li]
        hq, _, d = query_states.shape
        hkv, n = key_states.shape[:2]
        assert n - w >= c, "no observation query inside the compressible area: R-KV needs no mask"
        # compute_attention_scores: the group's logits, max-reduced before any softmax.
        grouped = query_states.view(hkv, hq // hkv, w, d) @ key_states.unsqueeze(1).transpose(2, 3)
        attn_weights = (grouped / math.sqrt(d)).max(dim=1).values  # [Hkv, w, N]
        attn_sum = attn_weights[:, :, :c].softmax(-1).mean(dim=-2)
        attn_cache = torch.stack([max_pool(row, kernel) for row in attn_sum])
        # cal_similarity
        k_norm = key_states / (key_states.norm(dim=-1, keepdim=True) + 1e-8)
        similarity = k_norm @ k_norm.transpose(-1, -2)
        for h in range(hkv):
            similarity[h].fill_diagonal_(0.0)
        indices = torch.where(similarity > threshold, torch.arange(n), torch.zeros(n, dtype=torch.long))
        retain = indices.max(dim=-1).values
        heads = torch.arange(hkv).unsqueeze(1).expand(hkv, n)
        seqs = torch.arange(n).unsqueeze(0).expand(hkv, n)
        similarity[heads, seqs, retain] = 0
        redundancy = similarity.mean(dim=1).softmax(dim=-1)[:, :c]
        final = attn_cache * lam - redundancy * (1 - lam)
        return [top(row, budget) for row in final]

    return rows_to_mask(window, kept)


# ------------------------------------------------------------------ the others


def h2o_reference(window: Window, budget: int, params: Any) -> Tensor:
    """Original H2O: causal attention summed (not averaged) over every query and head."""

    def kept(bi: int, li: int) -> list[list[int]]:
        q, k = window.queries[bi, li], window.keys[bi, li]
        s = attention(q, k, causal=True).sum(1).view(k.shape[0], -1, k.shape[1]).sum(1)
        return [top(row[: window.n_compress], budget) for row in s]

    return rows_to_mask(window, kept)


def streamingllm_reference(window: Window, budget: int, params: Any) -> Tensor:
    c = window.n_compress

    def kept(bi: int, li: int) -> list[list[int]]:
        return [list(range(c - budget, c))] * window.keys.shape[2]

    return rows_to_mask(window, kept)


# ------------------------------------------------- kvpress 0.5.5's decoding scorers


def knorm_reference(window: Window, budget: int, params: Any) -> Tensor:
    """kvpress 0.5.5's ``KnormPress.score``: ``-||k||_2``; the lowest norms stay."""

    def kept(bi: int, li: int) -> list[list[int]]:
        k = window.keys[bi, li, :, : window.n_compress]
        return [top(-torch.linalg.vector_norm(row, dim=-1), budget) for row in k]

    return rows_to_mask(window, kept)


def keydiff_reference(window: Window, budget: int, params: Any) -> Tensor:
    """kvpress 0.5.5's ``KeyDiffPress.score``: minus the cosine to the mean unit key, the
    anchor taken over the keys ranked (the compressible area)."""

    def kept(bi: int, li: int) -> list[list[int]]:
        rows = []
        for k in window.keys[bi, li, :, : window.n_compress]:
            norms = k.norm(dim=-1)
            anchor = (k / norms.unsqueeze(-1)).mean(0)
            rows.append(top(-(k @ anchor) / (norms * anchor.norm()), budget))
        return rows

    return rows_to_mask(window, kept)


def tova_reference(window: Window, budget: int, params: Any) -> Tensor:
    """kvpress 0.5.5's ``TOVAPress.score``: the last query's attention averaged over all
    query heads, the same row for every KV head."""

    def kept(bi: int, li: int) -> list[list[int]]:
        q, k = window.queries[bi, li], window.keys[bi, li]
        last = attention(q[:, -1:], k, causal=False)[:, 0]  # [Hq, N]: the last sees all
        row = top(last.mean(0)[: window.n_compress], budget)
        return [row] * k.shape[0]

    return rows_to_mask(window, kept)


def lagkv_reference(window: Window, budget: int, params: Any) -> Tensor:
    """kvpress 0.5.5's ``LagKVPress.score`` with no sinks: partitions of ``lag_size``
    from the span's first token, each scored against the next whole one, keys and
    values alike (``_get_states_score``), the two halves averaged, then ranked; the rest
    scores 1 (the tail). Top-m of the area, ties to the later token."""
    lag, c = params.lag_size, window.n_compress

    def states_score(x: Tensor, start: int) -> Tensor:
        target, ref = x[start : start + lag], x[start + lag : start + 2 * lag]
        lo, hi = ref.min(0).values, ref.max(0).values
        return ((target - lo) / (hi - lo)).std(-1).softmax(-1)

    def kept(bi: int, li: int) -> list[list[int]]:
        rows = []
        for k, v in zip(window.keys[bi, li], window.values[bi, li], strict=True):
            n = k.shape[0]
            scores = [1.0] * c
            for start in range(0, n - 2 * lag + 1, lag):
                s = (states_score(k, start) + states_score(v, start)) / 2
                if not params.cross_scoring:
                    s = s.argsort().argsort() / lag
                for offset, value in enumerate(s.tolist()):
                    if start + offset < c:
                        scores[start + offset] = value
            rows.append(sorted(sorted(range(c), key=lambda i: (-scores[i], -i))[:budget]))
        return rows

    return rows_to_mask(window, kept)


def qfilter_reference(window: Window, budget: int, params: Any) -> Tensor:
    """kvpress 0.5.5's ``QFilterPress.score``: ``-(q_filter * keys).sum(-1)`` with the
    layer's ``[Hkv, D]`` filters of the calibration file, read with safetensors itself."""
    filters = load_file(params.calibration)["q_filters"]  # [L, Hkv, D]

    def kept(bi: int, li: int) -> list[list[int]]:
        k = window.keys[bi, li, :, : window.n_compress]
        return [top(-(f * row).sum(-1), budget) for f, row in zip(filters[li], k, strict=True)]

    return rows_to_mask(window, kept)


# ------------------------------------- kvpress 0.5.5's scorers with values and RoPE


def rope_matrix(position: int) -> Tensor:
    """RoPE's rotation at ``position`` as kvpress builds it (``apply_avg_rope``), fp64:
    ``R = cos * I + sin * P`` with ``P = [[0, -I], [I, 0]]`` and the halves' angles repeated."""
    angles = position * INV_FREQ
    cos, sin = torch.cat([angles.cos()] * 2), torch.cat([angles.sin()] * 2)
    d = len(cos)
    eye, p = torch.eye(d, dtype=torch.float64), torch.zeros(d, d, dtype=torch.float64)
    p[d // 2 :, : d // 2], p[: d // 2, d // 2 :] = torch.eye(d // 2), -torch.eye(d // 2)
    return cos * eye + sin * p


def pre_rope(x: Tensor, first: int) -> Tensor:
    """``x`` ``[H, T, D]`` at positions ``first, first + 1, ...`` rotated back: ``R_p^T x``, fp64."""
    rotations = torch.stack([rope_matrix(first + t) for t in range(x.shape[1])])  # [T, D, D]
    return torch.einsum("tji,htj->hti", rotations, x.double())


def zscore(s: Tensor) -> Tensor:
    """kvpress's ``(s - s.mean()) / s.std().clamp_min(1e-6)``, over a layer's whole tensor."""
    return (s - s.mean()) / s.std().clamp_min(1e-6)


def kara_retain_reference(window: Window, budget: int, params: Any) -> Tensor:
    """kara-retain's spec (kvllm/methods/retain.py): the retaining score ``w . [R_p^T k, v, 1]``
    with the calibration file's weights, read with safetensors itself; each score z-scored
    over the window's C keys (torch's unbiased std), mixed, then top-m or Token2Chunk on the
    mix shifted to its minimum."""
    weights = load_file(params.calibration)["retain_weights"].double()  # [L, Hkv, 2D + 1]
    c = window.n_compress

    def kept(bi: int, li: int) -> list[list[int]]:
        kara = kara_scores(window, bi, li, causal=False).double()
        keys = pre_rope(window.keys[bi, li, :, :c], window.positions[bi])
        values = window.values[bi, li, :, :c].double()
        d = keys.shape[-1]
        rows = []
        for h in range(keys.shape[0]):
            w = weights[li, h]
            learned = keys[h] @ w[:d] + values[h] @ w[d : 2 * d] + w[2 * d]
            z = [(s - s.mean()) / s.std().clamp_min(1e-6) for s in (kara[h], learned)]
            rows.append((1 - params.mix) * z[0] + params.mix * z[1])
        mixed = torch.stack(rows)
        if not params.token2chunk:
            return [top(row, min(budget, c)) for row in mixed]
        mixed = mixed - mixed.min(dim=-1, keepdim=True).values
        return token2chunk(mixed.float(), budget, params.rho, params.beta, params.max_gap).tolist()

    return rows_to_mask(window, kept)


def noncausal_attn_z(window: Window, bi: int, li: int) -> Tensor:
    """``NonCausalAttnPress.score`` on one chunk, the window: ``[Hkv, C]`` z-scores.

    Unscaled logits (kvpress has no ``1 / sqrt(d)``), column sums over every query, the
    group's mean, times ``||v||``, pooled with 3 along the span, z-scored over the layer.
    """
    q, k, v = window.queries[bi, li].double(), window.keys[bi, li].double(), window.values[bi, li].double()
    hq, hkv, n = q.shape[0], k.shape[0], k.shape[1]
    krep = k.repeat_interleave(hq // hkv, dim=0)
    a = (q @ krep.transpose(1, 2)).softmax(-1).sum(1).view(hkv, hq // hkv, n).mean(1)
    scores = torch.stack([avg_pool(row, 3) for row in a * v.norm(dim=-1)])
    return zscore(scores[:, : window.n_compress])


def noncausal_attn_reference(window: Window, budget: int, params: Any) -> Tensor:
    def kept(bi: int, li: int) -> list[list[int]]:
        return [top(row, budget) for row in noncausal_attn_z(window, bi, li)]

    return rows_to_mask(window, kept)


def leverage(window: Window, bi: int, li: int, sketch_dimension: int) -> Tensor:
    """``LeverageScorePress.compute_leverage_scores`` on the span's pre-RoPE keys: ``[Hkv, N]``.

    The sketch is the one the method documents: sequence ``bi``'s ``[L, Hkv, d, k]``
    standard normals from a CPU generator seeded with its stream seed, over ``sqrt(k)``.
    The first jitter, 1e-2, makes the Gram matrix invertible, so it is inverted directly.
    """
    _, layers, hkv, _, d = window.keys.shape
    gen = torch.Generator().manual_seed(window.seeds[bi])
    phi = torch.randn((layers, hkv, d, sketch_dimension), generator=gen)[li].double() / math.sqrt(sketch_dimension)
    keys = pre_rope(window.keys[bi, li], window.positions[bi])
    x = (keys - keys.mean(dim=1, keepdim=True)) @ phi  # [Hkv, N, k]
    gram = x.transpose(1, 2) @ x + 1e-2 * torch.eye(sketch_dimension, dtype=torch.float64)
    return torch.stack([torch.diag(xh @ torch.linalg.inv(gh) @ xh.T) for xh, gh in zip(x, gram, strict=True)]).clamp(
        min=0
    )


def compactor_reference(window: Window, budget: int, params: Any) -> Tensor:
    """``CompactorPress.score`` without sinks: ``blending * z(leverage) + z(non-causal)``,
    blending ``1 - m / C`` (kvpress's compression ratio) unless set."""
    c = window.n_compress
    blending = params.blending if params.blending is not None else 1 - budget / c

    def kept(bi: int, li: int) -> list[list[int]]:
        lev = zscore(leverage(window, bi, li, params.sketch_dimension)[:, :c])
        return [top(row, budget) for row in blending * lev + noncausal_attn_z(window, bi, li)]

    return rows_to_mask(window, kept)


def expected_attention_reference(window: Window, budget: int, params: Any) -> Tensor:
    """``ExpectedAttentionPress.score`` without sinks, per query head: the pre-RoPE
    queries' mean and covariance, rotated by the mean ``R`` over the positions after the
    span that the RoPE table holds (its last row when none), the expected logits'
    softmax over the span, the group's mean, ``(a + epsilon) * ||v||``."""
    c = window.n_compress
    n_rows = window.rope.cos_sin.shape[0]

    def kept(bi: int, li: int) -> list[list[int]]:
        q, k, v = window.queries[bi, li], window.keys[bi, li].double(), window.values[bi, li].double()
        hq, nq, d = q.shape
        hkv, n = k.shape[:2]
        first = window.positions[bi]
        pre = pre_rope(q, first + n - nq)
        mu = pre.mean(1)  # [Hq, D]
        centred = pre - mu.unsqueeze(1)
        cov = centred.transpose(1, 2) @ centred / nq
        future = [t for t in range(first + n, first + n + params.n_future_positions) if t < n_rows] or [n_rows - 1]
        r = torch.stack([rope_matrix(t) for t in future]).mean(0)
        krep = k.repeat_interleave(hq // hkv, dim=0)
        logits = (mu @ r.T).unsqueeze(1) @ krep.transpose(1, 2) / math.sqrt(d)  # [Hq, 1, N]
        logits = logits.squeeze(1)
        if params.use_covariance:
            logits += torch.einsum("hni,hij,hnj->hn", krep, r @ cov @ r.T, krep) / d / 2
        s = logits.softmax(-1).view(hkv, hq // hkv, n).mean(1)[:, :c]
        if params.use_vnorm:
            s = (s + params.epsilon) * v[:, :c].norm(dim=-1)
        return [top(row, budget) for row in s]

    return rows_to_mask(window, kept)


def kara_value_reference(vnorm: bool, pooled: bool) -> Reference:
    """Kara's spec scores over the span, times ``||v||`` (kara-vnorm), then avg-pooled along
    the span (kara-pool), then the candidates' Token2Chunk (kara-vpool: both)."""

    def reference(window: Window, budget: int, params: Any) -> Tensor:
        def kept(bi: int, li: int) -> list[list[int]]:
            q, k = window.queries[bi, li], window.keys[bi, li]
            hkv, n = k.shape[:2]
            s = attention(q, k, causal=False).sum(1).view(hkv, -1, n).sum(1)  # [Hkv, N]
            if vnorm:
                s = s * window.values[bi, li].norm(dim=-1)
            if pooled:
                s = torch.stack([avg_pool(row, params.pool_kernel) for row in s])
            s = s[:, : window.n_compress]
            return token2chunk(s, budget, params.rho, params.beta, params.max_gap).tolist()

        return rows_to_mask(window, kept)

    return reference


def exact(reference: Reference) -> Check:
    def check(method: Method, window: Window, budget: int) -> None:
        ours = kept_mask(method.select(window, budget), window.n_compress)
        theirs = reference(window, budget, method.params)
        layers, hkv = window.keys.shape[1:3]
        assert theirs.sum((-1, -2, -3)).eq(layers * hkv * budget).all()  # the mean budget is m
        differ = (ours != theirs).any(-1).nonzero().tolist()
        assert not differ, f"{method.name}: kept sets differ from the reference at (b, l, h) {differ}"

    return check


def random_is_reproducible(method: Method, window: Window, budget: int) -> None:
    """Same seeds, same sets; another sequence's seed changes only that sequence's draw."""

    def draw(seeds: tuple[int, ...]) -> Tensor:
        w = Window(window.queries, window.keys, window.n_compress, seeds)
        return kept_mask(method.select(w, budget), window.n_compress)

    first = draw((11, 12))
    assert torch.equal(first, draw((11, 12)))
    other = draw((11, 13))
    assert torch.equal(first[0], other[0])
    if budget < window.n_compress:
        assert not torch.equal(first[1], other[1])
        # Rows of one draw differ from each other too: each (layer, head) draws its own.
        rows = first[1].flatten(0, 1)
        assert any(not torch.equal(rows[0], row) for row in rows[1:])


REFERENCES: dict[str, Check] = {
    "kara": exact(kara_reference(causal=False, chunks=True)),
    "kara-causal": exact(kara_reference(causal=True, chunks=True)),
    "kara-topk": exact(kara_reference(causal=False, chunks=False)),
    "kara-retain": exact(kara_retain_reference),
    "kara-far": exact(kara_far_reference),
    "kara-late": exact(kara_late_reference),
    "kara-twoway": exact(kara_twoway_reference),
    "snapkv": exact(snapkv_reference),
    "pyramidkv": exact(pyramidkv_reference),
    "adakv": exact(adakv_reference),
    "chunkkv": exact(chunkkv_reference),
    "chunkkv-head": exact(chunkkv_head_reference),
    "rkv": exact(rkv_reference),
    "h2o": exact(h2o_reference),
    "streamingllm": exact(streamingllm_reference),
    "knorm": exact(knorm_reference),
    "keydiff": exact(keydiff_reference),
    "tova": exact(tova_reference),
    "lagkv": exact(lagkv_reference),
    "qfilter": exact(qfilter_reference),
    "noncausal-attn": exact(noncausal_attn_reference),
    "compactor": exact(compactor_reference),
    "expected-attention": exact(expected_attention_reference),
    "kara-vnorm": exact(kara_value_reference(vnorm=True, pooled=False)),
    "kara-pool": exact(kara_value_reference(vnorm=False, pooled=True)),
    "kara-vpool": exact(kara_value_reference(vnorm=True, pooled=True)),
    "random": random_is_reproducible,
}

BUFFER = 16
# kvpress's set is exactly ours while the observation window is the buffer.
SNAP = {"obs_window": BUFFER}
PARAMS: Mapping[str, Mapping[str, Any]] = {
    **{name: SNAP for name in ("snapkv", "pyramidkv", "adakv", "chunkkv", "chunkkv-head")},
    # Past the buffer, so that compressible tokens' queries score too.
    "kara-late": {"obs_window": BUFFER + 9},
    # Partitions of the buffer's length: the buffer is the last one's reference.
    "lagkv": {"lag_size": BUFFER},
    "kara-retain": {"mix": 0.3},
}


def build(name: str, params: Mapping[str, Any], window: Window) -> Method:
    cls = method_class(name)
    buffer = window.keys.shape[3] - window.n_compress
    return cls(cls.resolve(params, window.n_compress, buffer))


@pytest.fixture(scope="module")
def calibration(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A calibration file of seeded random filters for :func:`make_window`'s 4 layers x
    2 KV heads x d = 8."""
    gen = torch.Generator().manual_seed(23)
    path = tmp_path_factory.mktemp("calibration") / "calibration.safetensors"
    # One file for every calibrated method: each reads its own tensor.
    save_file(
        {"q_filters": torch.randn(4, 2, 8, generator=gen), "retain_weights": torch.randn(4, 2, 17, generator=gen)},
        str(path),
    )
    return str(path)


def params_of(name: str, calibration: str) -> dict[str, Any]:
    """The test's overrides of ``name``'s parameters, the calibration file for a method that reads one."""
    return {**PARAMS.get(name, {}), **({"calibration": calibration} if calibrated(name) else {})}


def test_every_registered_method_has_a_reference() -> None:
    assert set(REFERENCES) == set(available())


@pytest.mark.parametrize("budget", [1, 5, 13, 30, 48])
@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_selection_matches_reference(name: str, budget: int, calibration: str) -> None:
    window = make_window(BUFFER, seed=budget)
    REFERENCES[name](build(name, params_of(name, calibration), window), window, budget)


@pytest.mark.parametrize("params", [{"mix": 1.0, "token2chunk": False}, {"mix": 0.0, "token2chunk": False}])
def test_kara_retain_top_m_and_its_ends(params: dict[str, Any], calibration: str) -> None:
    """Plain top-m on the mix; mix 0 is kara-topk's set, mix 1 the learned score's alone."""
    window = make_window(BUFFER, seed=7)
    method = build("kara-retain", {**params, "calibration": calibration}, window)
    REFERENCES["kara-retain"](method, window, 13)
    if params["mix"] == 0.0:
        topk = build("kara-topk", {}, window).select(window, 13).indices
        assert torch.equal(method.select(window, 13).indices, topk)


@pytest.mark.parametrize("budget", [5, 13, 30])
def test_rkv_is_r_kv_verbatim_when_the_buffer_is_its_window(budget: int) -> None:
    """``buffer == obs_window == 8``: the span is R-KV's cache, the candidates its non-window keys."""
    window = make_window(8, seed=100 + budget)
    REFERENCES["rkv"](build("rkv", {}, window), window, budget)


def test_rkv_with_its_knobs_moved() -> None:
    window = make_window(24, seed=7)
    params = {"lam": 0.5, "obs_window": 16, "pool_kernel": 3, "sim_threshold": 0.2}
    REFERENCES["rkv"](build("rkv", params, window), window, 20)


@pytest.mark.parametrize("name", ["chunkkv", "chunkkv-head"])
@pytest.mark.parametrize(("chunk_size", "budget"), [(7, 10), (16, 32), (48, 20), (1, 9)])
def test_chunk_references_at_other_chunk_sizes(name: str, chunk_size: int, budget: int) -> None:
    window = make_window(BUFFER, seed=chunk_size)
    method = build(name, {**SNAP, "chunk_size": chunk_size}, window)
    REFERENCES[name](method, window, budget)


def test_kara_late_with_every_query_is_kara() -> None:
    """Its ablation: scored by all W + b window queries, kara-late keeps Kara's set."""
    window = make_window(BUFFER, seed=3)
    span = window.keys.shape[3]
    for obs in (span, span + 40):  # more than W + b means all of them
        late = build("kara-late", {"obs_window": obs}, window).select(window, 13)
        kara = build("kara", {}, window).select(window, 13)
        assert torch.equal(late.indices, kara.indices)


# The accuracy grid runs the SnapKV family with observation windows past the buffer
# (tools/accuracy_grid.sh: 96, 128, 64 at W=128, b=32): scored in part by the
# compressible tokens' own queries, which kvpress's layout never has.
SNAP_FAMILY = ("snapkv", "pyramidkv", "adakv", "chunkkv", "chunkkv-head")


@pytest.mark.parametrize("obs_window", [40, 64, 96])
@pytest.mark.parametrize("name", SNAP_FAMILY)
def test_snapkv_family_with_an_observation_window_past_the_buffer(name: str, obs_window: int) -> None:
    """W = 64, b = 32: 40 observers reach 8 tokens into the area, 64 half of it, 96 all."""
    for budget in (5, 13, 30):
        window = make_window(32, n_compress=64, seed=obs_window + budget)
        # chunkkv at the grid's chunk_size 2; chunkkv-head at its default 20 (a short last chunk).
        params = {"obs_window": obs_window, **({"chunk_size": 2} if name == "chunkkv" else {})}
        REFERENCES[name](build(name, params, window), window, budget)


def test_observed_snapkv_is_kvpress_when_the_window_is_the_buffer() -> None:
    """The definition the tests past the buffer use agrees with kvpress where both apply."""
    window = make_window(BUFFER, seed=5)
    for li in range(window.keys.shape[1]):
        ours = observed_snapkv(window, 1, li, BUFFER, 7)
        theirs = kvpress_snapkv(window, 1, li, BUFFER, 7)
        # kvpress means over the observers and the group where the definition sums.
        torch.testing.assert_close(ours.float(), theirs * BUFFER * window.group)


@pytest.mark.parametrize("budget", [5, 13, 30])
def test_kara_twoway_with_queries_of_the_last_tokens_only(budget: int) -> None:
    """A threshold round's span: queries for its last 20 tokens only, so the area's first
    44 tokens give nothing and only receive."""
    full = make_window(BUFFER, seed=40 + budget)
    window = Window(full.queries[..., -20:, :], full.keys, full.n_compress)
    REFERENCES["kara-twoway"](build("kara-twoway", {}, window), window, budget)


@pytest.mark.parametrize("cross_scoring", [False, True])
@pytest.mark.parametrize(
    ("lag_size", "buffer"),
    # 16 | 48 with a 16-token buffer: every area token scored; 7: a partition crosses
    # into the buffer; 20 and 32: the area's last tokens are tail; 40: no partition scored.
    [(16, 16), (7, 16), (20, 16), (32, 16), (40, 16), (8, 0)],
)
def test_lagkv_with_its_knobs_moved(lag_size: int, buffer: int, cross_scoring: bool) -> None:
    for budget in (1, 13, 30):
        window = make_window(buffer, seed=lag_size + budget)
        params = {"lag_size": lag_size, "cross_scoring": cross_scoring}
        REFERENCES["lagkv"](build("lagkv", params, window), window, budget)


VALUE_AWARE = ("noncausal-attn", "compactor", "expected-attention", "kara-vnorm", "kara-pool", "kara-vpool")


@pytest.mark.parametrize("name", VALUE_AWARE)
def test_value_aware_methods_with_queries_of_the_last_tokens_only(name: str) -> None:
    """A threshold round's span: queries for its last 20 tokens, at their own positions."""
    for budget in (5, 30):
        full = make_window(BUFFER, seed=60 + budget)
        window = dataclasses.replace(full, queries=full.queries[..., -20:, :])
        REFERENCES[name](build(name, {}, window), window, budget)


@pytest.mark.parametrize("params", [{"sketch_dimension": 3}, {"sketch_dimension": 5, "blending": 2.0}])
def test_compactor_with_a_sketch_narrower_than_the_head(params: dict[str, Any]) -> None:
    """With k >= d the sketch spans the keys' space and the leverage does not depend on
    it; below d it does, so these check the draw from each sequence's seed."""
    for budget in (5, 13, 30):
        window = make_window(BUFFER, seed=70 + budget)
        REFERENCES["compactor"](build("compactor", params, window), window, budget)


def test_compactor_draws_from_the_sequences_seed() -> None:
    window = make_window(BUFFER, seed=9)
    method = build("compactor", {"sketch_dimension": 3}, window)

    def kept(seeds: tuple[int, int]) -> Tensor:
        return kept_mask(method.select(dataclasses.replace(window, seeds=seeds), 13), window.n_compress)

    first = kept((11, 12))
    assert torch.equal(first, kept((11, 12)))
    other = kept((11, 13))
    assert torch.equal(first[0], other[0]) and not torch.equal(first[1], other[1])


@pytest.mark.parametrize(
    "params",
    [
        {"use_covariance": False},
        {"use_vnorm": False},
        {"epsilon": 0.05, "n_future_positions": 7},
        {"n_future_positions": 1, "use_covariance": False, "use_vnorm": False},
    ],
)
def test_expected_attention_with_its_knobs_moved(params: dict[str, Any]) -> None:
    for budget in (5, 13, 30):
        window = make_window(BUFFER, seed=80 + budget)
        REFERENCES["expected-attention"](build("expected-attention", params, window), window, budget)


@pytest.mark.parametrize(
    "table",
    # Sequence 1's span ends at 313: 400 holds 86 of its 512 future positions (and 333 of
    # sequence 0's); 314 none of sequence 1's (the table's last row stands in).
    [400, 314],
)
def test_expected_attention_at_the_end_of_the_rope_table(table: int) -> None:
    for budget in (5, 30):
        window = make_window(BUFFER, seed=90 + budget, table=table)
        REFERENCES["expected-attention"](build("expected-attention", {}, window), window, budget)


@pytest.mark.parametrize("name", ["noncausal-attn", "compactor", "expected-attention"])
def test_a_sequence_is_selected_as_if_alone(name: str) -> None:
    """kvpress normalises and jitters a layer over its whole batch; here each sequence on
    its own, so an hf batch and a vLLM group that differ still agree per sequence."""
    window = make_window(BUFFER, seed=11)
    method = build(name, {"sketch_dimension": 3} if name == "compactor" else {}, window)
    both = method.select(window, 13).indices
    for bi in range(2):
        alone = Window(
            window.queries[bi : bi + 1],
            window.keys[bi : bi + 1],
            window.n_compress,
            window.seeds[bi : bi + 1],
            window.positions[bi : bi + 1],
            window.values[bi : bi + 1],
            window.rope,
        )
        assert torch.equal(method.select(alone, 13).indices[0], both[bi])


@pytest.mark.parametrize(("name", "params"), [("kara-vnorm", {}), ("kara-pool", {"pool_kernel": 1})])
def test_value_aware_kara_reduces_to_kara(name: str, params: dict[str, Any]) -> None:
    """The ablations: with equal value norms, or a pooling kernel of 1, the set is Kara's."""
    window = make_window(BUFFER, seed=12)
    window = dataclasses.replace(window, values=window.values / window.values.norm(dim=-1, keepdim=True))
    ours = build(name, params, window).select(window, 13)
    assert torch.equal(ours.indices, build("kara", {}, window).select(window, 13).indices)
