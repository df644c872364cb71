"""Kara: bidirectional window scoring + Token2Chunk, its two ablations, and three variants.

Kara, "Efficient Reasoning LLM Serving via Sliding-Window KV Cache Compression"
(docs/design.md, "Kara"). For every layer l and KV head h with GQA query-head group G::

    A_g     = softmax(Q_g K^T / sqrt(d))        # no causal mask, fp32, over the W + b keys
    score_i = sum_{g in G} sum_j A_g[j, i]      # i in the compressible area C (first W)

Queries are those of all W + b window tokens, so an early token's query also sees later
keys. The scores feed :func:`~kvllm.methods.token2chunk.token2chunk` with defaults
rho = 0.5, beta = 1, max_gap = 16. Ablations at the same budget:

- ``kara-causal``: the same with a causal mask (each query sees only earlier keys);
- ``kara-topk``: bidirectional scores, plain top-m (no Token2Chunk).

Variants beyond the paper, each with ``kara`` as its ablation: ``kara-far`` (a query
scores only keys at least ``band`` tokens away), ``kara-late`` (only the window's last
``obs_window`` queries score) and ``kara-twoway`` (the other reading of the paper's
score: a token also earns the attention its own query gives to later tokens).

Reference: Kara is this project's own method, so its reference is the spec above
(docs/design.md, "Kara", "Token2Chunk" and "Two readings of Kara's score"), not outside
code; there is nothing to deviate from. ``tests/methods/test_references.py`` scores the
keys independently from that spec and checks the kept sets of all six.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kvllm.checks import check_int, check_number
from kvllm.methods.base import FIELD, MethodParams, ScoredMethod, Selection, Window, register
from kvllm.methods.scoring import attention_scores, topk_sorted
from kvllm.methods.token2chunk import token2chunk


@dataclass(frozen=True)
class KaraParams(MethodParams):
    """Token2Chunk's knobs (docs/design.md, "Token2Chunk").

    Attributes
    ----------
    rho
        K = max(1, round(rho * m)) top tokens become chunk endpoints, in (0, 1].
    beta
        A chunk scores (s[c_i] + s[c_i+1]) / (g + 2) ** beta, beta >= 0.
    max_gap
        The longest gap between endpoints that may be filled whole, >= 0.
    """

    rho: float = 0.5
    beta: float = 1.0
    max_gap: int = 16

    def check(self, window: int, buffer: int) -> None:
        check_number(f"{FIELD}.rho", self.rho, 0.0, 1.0, "must be in (0, 1]", lo_open=True)
        check_number(f"{FIELD}.beta", self.beta, 0.0, float("inf"), "must be >= 0")
        check_int(f"{FIELD}.max_gap", self.max_gap, 0)


@register
class Kara(ScoredMethod):
    name = "kara"
    Params = KaraParams
    causal = False

    def scores(self, window: Window) -> Tensor:
        return attention_scores(window, causal=self.causal)[..., : window.n_compress]

    def choose(self, scores: Tensor, budget: int) -> Selection:
        p = self.params
        return Selection(token2chunk(scores, budget, p.rho, p.beta, p.max_gap))


@register
class KaraCausal(Kara):
    name = "kara-causal"
    causal = True


@register
class KaraTopK(ScoredMethod):
    name = "kara-topk"

    def scores(self, window: Window) -> Tensor:
        return attention_scores(window, causal=False)[..., : window.n_compress]

    def choose(self, scores: Tensor, budget: int) -> Selection:
        return Selection(topk_sorted(scores, min(budget, scores.shape[-1])))


@dataclass(frozen=True)
class KaraFarParams(KaraParams):
    """Kara's knobs plus the band of near tokens left out of scoring.

    Attributes
    ----------
    band
        A window query does not score keys fewer than ``band`` tokens from its own, in
        [1, W + b - 1].
    """

    band: int = 8

    def check(self, window: int, buffer: int) -> None:
        super().check(window, buffer)
        check_int(f"{FIELD}.band", self.band, 1, window + buffer - 1)


@register
class KaraFar(Kara):
    """Kara scored only by distant queries (beyond the paper; docs/design.md, "kara-far").

    Every compressible key is at least b tokens behind the first query that will read it
    after the round, yet Kara's window scores are dominated by near attention (previous
    token heads, the line being written), which no later query gives. This variant
    masks keys fewer than ``band`` tokens from each window query before the softmax,
    so the scores count only the attention that distant queries pay; the rest (the
    bidirectional window, Token2Chunk) is Kara's. Its ablation is ``kara`` (band 0).
    """

    name = "kara-far"
    Params = KaraFarParams

    def scores(self, window: Window) -> Tensor:
        return attention_scores(window, causal=False, band=self.params.band)[..., : window.n_compress]


@dataclass(frozen=True)
class KaraLateParams(KaraParams):
    """Kara's knobs plus how many of the window's last queries score it.

    Attributes
    ----------
    obs_window
        The last this many of the W + b window queries score the window, >= 1; all of
        them when W + b is shorter.
    """

    obs_window: int = 64

    def check(self, window: int, buffer: int) -> None:
        super().check(window, buffer)
        check_int(f"{FIELD}.obs_window", self.obs_window, 1)


@register
class KaraLate(Kara):
    """Kara scored by the window's later queries (beyond the paper; docs/design.md, "kara-late").

    The queries that read a compressed key come after the window. Of the window's own
    queries, the later ones are their nearest stand-ins: SnapKV's observation-window
    argument. This variant keeps Kara's bidirectional column sums and Token2Chunk, but
    sums only over the last ``obs_window`` queries. Its ablation is ``kara``
    (``obs_window = W + b``).
    """

    name = "kara-late"
    Params = KaraLateParams

    def scores(self, window: Window) -> Tensor:
        n_queries = min(self.params.obs_window, window.queries.shape[-2])
        return attention_scores(window, causal=False, last_queries=n_queries)[..., : window.n_compress]


@register
class KaraTwoWay(Kara):
    """Kara's score read both ways (docs/design.md, "Two readings of Kara's score").

    The paper keeps "tokens that allocate high attention to future tokens (and vice
    versa)". ``kara`` reads that as the attention a token's key receives, the column
    sum. This variant adds the other direction: the attention the token's own query
    gives to the window's later tokens, over the same non-causal softmax and GQA group::

        score_t = sum_{g in G} ( sum_j A_g[j, t] + sum_{i > t} A_g[t, i] )

    A token whose query is not in the window (the span's first ``N - Nq`` tokens, in a
    threshold round) gives nothing. Token2Chunk and its knobs are Kara's; its ablation
    is ``kara`` (the first term alone).
    """

    name = "kara-twoway"

    def scores(self, window: Window) -> Tensor:
        return attention_scores(window, causal=False, given_later=True)[..., : window.n_compress]
