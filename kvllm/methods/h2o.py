"""H2O: heavy hitters by accumulated attention, as the original H2O accumulates it.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
Language Models", NeurIPS 2023. Reference read: FMInference/H2O at ac75c2a,
``h2o_hf/utils_real_drop/modify_llama.py`` (``H2OKVCache_LayerWise._update_hh_score``):
a key's score is the causal attention it receives, *summed* over the queries that see
it, and the top ``hh_size`` scores are kept next to the recent tokens. Ours: the same
sum over every query of the span and over the GQA group, then the top-m of the
compressible keys.

This is the original H2O, not kvpress's ``ObservedAttentionPress`` (NVIDIA/kvpress at
8bb29b9, ``kvpress/presses/observed_attention_press.py``), which divides each key's sum
by the number of queries that can see it; without that division early keys, seen by
more queries, score higher.

Where we differ, and why: H2O accumulates over every query since a key was written;
a method here sees one window's span, so the sum runs over its ``W + b`` queries. The
recent tokens H2O also keeps are the protected buffer, which no method touches. H2O's
models are multi-head; for GQA the group's query heads are summed.
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
