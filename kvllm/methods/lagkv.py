"""LagKV: score each partition of keys and values by how they look in the range of the next one.

Liang et al., "LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are
Important", 2025, arXiv:2504.04704. Reference read: kvpress 0.5.5,
``kvpress/presses/lagkv_press.py`` (``LagKVPress.score`` and ``_get_states_score``).
Per (sequence, layer, KV head), in fp32, with partitions of ``L = lag_size`` tokens
``P_p = [p L, (p + 1) L)`` from the span's first token, and ``x`` standing for the keys
``k`` and for the values ``v`` in turn::

    r_i(x) = (x_i - min_{j in P_p+1} x_j) / (max_{j in P_p+1} x_j - min_{j in P_p+1} x_j)
    s_i(x) = softmax_{i in P_p}(std(r_i(x)))         # std over the d channels
    s_i    = (s_i(k) + s_i(v)) / 2                   # kvpress's mean of the two halves
    s_i    = rank of s_i within P_p / L               # unless cross_scoring

for every partition with a whole partition after it in the span (its reference, the
"lag"); a token of the area in no such partition scores 1, as kvpress's always-kept
tail does. Then the top-m of the compressible area, ties going to the later token.

Where we differ, and why:

- *No sinks.* kvpress keeps its first ``n_sink = 4`` tokens; a sequence's sinks are in
  its prompt, which is never compressed (as in ``streamingllm``), and a window's first
  tokens are nothing special, so partitions start at the span's first key.
- *lag_size 32, not 128.* kvpress's 128 needs ``n_sink + 2 * 128`` tokens before it
  scores anything; our span is ``W + b = 160`` by default, so every window would fall
  to kvpress's short-sequence fallback. At 32, the default buffer, the area's 128 keys
  are four partitions, each scored against the next and the last against the buffer,
  which takes the place of kvpress's tail (the last partition, reference only, kept).
- *Tail and fallback inside the area.* When ``lag_size`` exceeds the buffer or does not
  divide C, the area's last tokens have no whole reference after them; they score 1,
  above every partition score, and among themselves the later ones win, as kvpress
  keeps its tail. With no scored partition at all (``2 L > W + b``) the area keeps its
  last m tokens, kvpress's short-sequence fallback, which orders by recency.
- *Ties.* Without ``cross_scoring`` every partition scores the same ranks; kvpress
  leaves the ties to ``topk``, which promises no order. Here the later token wins, so
  the kept set is fixed, and leans to recency as kvpress's tail and fallback do.
- *A constant channel.* A channel equal across the reference partition makes kvpress
  divide by zero (NaN for the whole partition); it contributes 0 here instead.
- *Budget.* Exactly ``min(m, C)`` keys per (layer, KV head), as the paged engine needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvllm.checks import check_int, fail
from kvllm.methods.base import FIELD, Method, MethodParams, Selection, Window, register


@dataclass(frozen=True)
class LagKVParams(MethodParams):
    """Attributes
    ----------
    lag_size
        L: tokens per partition, each scored against the next, in [2, W] (a reference
        of one token has no range); 32, the default buffer (kvpress: 128, see above).
    cross_scoring
        Compare the softmax scores across partitions instead of ranking within each
        (kvpress's experimental option); False.
    """

    lag_size: int = 32
    cross_scoring: bool = False

    def check(self, window: int, buffer: int) -> None:
        check_int(f"{FIELD}.lag_size", self.lag_size, 2, window)
        if not isinstance(self.cross_scoring, bool):
            fail(f"{FIELD}.cross_scoring", self.cross_scoring, "must be true or false")


def _partition_scores(states: Tensor, n_parts: int, lag_size: int) -> Tensor:
    """kvpress's ``_get_states_score``: ``[..., n_parts, L]`` fp32 softmax shares of the
    first ``n_parts`` partitions of ``states`` ``[..., N, D]``, each against the next."""
    parts = states[..., : (n_parts + 1) * lag_size, :].float().unflatten(-2, (n_parts + 1, lag_size))
    ref, target = parts[..., 1:, :, :], parts[..., :-1, :, :]
    lo = ref.amin(dim=-2, keepdim=True)
    spread = ref.amax(dim=-2, keepdim=True) - lo
    relative = torch.where(spread > 0, (target - lo) / spread, 0.0)
    return relative.std(dim=-1).softmax(dim=-1)


def lagkv_scores(keys: Tensor, values: Tensor, n_compress: int, lag_size: int, cross_scoring: bool) -> Tensor:
    """LagKV scores of the first ``n_compress`` tokens of ``keys`` and ``values``
    ``[..., N, D]``: ``[..., C]`` fp32.

    Tokens in a partition with a whole partition after it in the span score in [0, 1)
    (ranks) or (0, 1) (the halves' mean softmax share, ``cross_scoring``); the others score 1.
    """
    *lead, n, _ = keys.shape
    scores = torch.ones(*lead, n_compress, dtype=torch.float32, device=keys.device)
    # Partition p is scored when partition p + 1 lies whole in the span; only those
    # that hold area tokens are computed.
    n_parts = min(n // lag_size - 1, -(-n_compress // lag_size))
    if n_parts <= 0:
        return scores
    # Averaged before ranking, as kvpress does: a rank of each half would lose the margins.
    s = (_partition_scores(keys, n_parts, lag_size) + _partition_scores(values, n_parts, lag_size)) / 2
    if not cross_scoring:
        s = s.argsort(dim=-1).argsort(dim=-1).float() / lag_size
    width = min(n_compress, n_parts * lag_size)
    scores[..., :width] = s.flatten(-2)[..., :width]
    return scores


def top_latest(scores: Tensor, k: int) -> Tensor:
    """Indices of the ``k`` largest entries of the last dim, ties to the later index, ascending."""
    c = scores.shape[-1]
    # A stable sort keeps equal scores in their order, which the flip makes latest first.
    order = scores.flip(-1).sort(dim=-1, descending=True, stable=True).indices[..., :k]
    return (c - 1 - order).sort(dim=-1).values


@register
class LagKV(Method):
    name = "lagkv"
    Params = LagKVParams

    @property
    def reads_values(self) -> bool:
        return True

    def select(self, window: Window, budget: int) -> Selection:
        window.require("values", method=self.name)
        p = self.params
        c = window.n_compress
        scores = lagkv_scores(window.keys, window.values, c, p.lag_size, p.cross_scoring)
        return Selection(top_latest(scores, min(budget, c)))
