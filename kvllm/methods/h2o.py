"""H2O: heavy hitters by accumulated attention.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
Language Models", NeurIPS 2023. Decode-time form used here: the score of a key is its
causal attention summed over every query of the span and the GQA group (the
accumulated attention H2O keeps while decoding); keep the top-m. The recent tokens H2O
also keeps are the protected buffer, which no method touches.
"""

from __future__ import annotations

from kvllm.methods.base import Method, Selection, Window, register
from kvllm.methods.scoring import attention_scores, topk_sorted


@register
class H2O(Method):
    name = "h2o"

    def select(self, window: Window, budget: int) -> Selection:
        scores = attention_scores(window, causal=True)[..., : window.n_compress]
        return Selection(topk_sorted(scores, min(budget, window.n_compress)))
