"""Kara: bidirectional window scoring + Token2Chunk, and its two ablations.

Kara, "Efficient Reasoning LLM Serving via Sliding-Window KV Cache Compression"
(DESIGN.md §3). For every layer l and KV head h with GQA query-head group G::

    A_g     = softmax(Q_g K^T / sqrt(d))        # no causal mask, fp32, over the W + b keys
    score_i = sum_{g in G} sum_j A_g[j, i]      # i in the compressible area C (first W)

Queries are those of all W + b window tokens, so an early token's query also sees later
keys. The scores feed :func:`~kvllm.methods.token2chunk.token2chunk` with defaults
rho = 0.5, beta = 1, max_gap = 16. Ablations at the same budget:

- ``kara-causal``: the same with a causal mask (each query sees only earlier keys);
- ``kara-topk``: bidirectional scores, plain top-m (no Token2Chunk).
"""

from __future__ import annotations

from kvllm.methods.base import Method, Selection, Window, register
from kvllm.methods.scoring import attention_scores, topk_sorted
from kvllm.methods.token2chunk import token2chunk


@register
class Kara(Method):
    name = "kara"
    causal = False

    def select(self, window: Window, budget: int) -> Selection:
        scores = attention_scores(window, causal=self.causal)[..., : window.n_compress]
        cfg = self.config
        return Selection(token2chunk(scores, budget, cfg.rho, cfg.beta, cfg.max_gap))


@register
class KaraCausal(Kara):
    name = "kara-causal"
    causal = True


@register
class KaraTopK(Method):
    name = "kara-topk"

    def select(self, window: Window, budget: int) -> Selection:
        scores = attention_scores(window, causal=False)[..., : window.n_compress]
        return Selection(topk_sorted(scores, min(budget, window.n_compress)))
