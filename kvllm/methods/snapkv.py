"""SnapKV: observation-window attention, pooled, top-m.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", 2024.
Our exact formula (DESIGN.md §5): with the last w = 32 queries of the span,
``s = avgpool_7(sum_{g in G} sum_{j in obs} softmax_causal(Q_g K^T / sqrt(d))[j])``
over the compressible keys, then the top-m of ``s``.
"""

from __future__ import annotations

from kvllm.methods.base import Method, Selection, Window, register
from kvllm.methods.scoring import snapkv_scores, topk_sorted


@register
class SnapKV(Method):
    name = "snapkv"

    def select(self, window: Window, budget: int) -> Selection:
        scores = snapkv_scores(window, self.config.obs_window, self.config.pool_kernel)
        return Selection(topk_sorted(scores, min(budget, window.n_compress)))
