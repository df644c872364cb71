"""TOVA: keep the keys the last query attends to most, averaged over the layer's heads.

Oren et al., "Transformers are Multi-State RNNs", 2024, arXiv:2401.06104 (TOVA,
Token Omission Via Attention). References read: kvpress 0.5.5,
``kvpress/presses/tova_press.py`` (``TOVAPress.score``), and schwartz-lab-NLP/TOVA at
275cf5f, ``src/tova_cache.py`` (``TOVACache.reduce``). Ours, per (sequence, layer),
in fp32, with ``q_h`` the window's last query for query head ``h`` (all Hq of them)::

    a_h = softmax(q_h K^T / sqrt(d))          # over the span's N keys
    s_i = mean_{h < Hq} a_h[i]                for i in the compressible area C

and the top-m of ``s``, the *same* for every KV head: kvpress averages over all query
heads of the layer, not over a KV head's GQA group, and repeats the result to every KV
head, as ``TOVACache.reduce`` keeps the same positions in all of a layer's heads. We do
the same.

Where we differ, and why:

- *Which query.* kvpress reads the last prompt token's query after prefill; here it is
  the query of the span's last token (the buffer's last in a periodic round), which
  sees every key of the span, so no mask is needed.
- *The softmax runs over the span.* TOVA normalises over the whole cache; a method sees
  one window, so the normaliser is the span's N keys. Since heads are averaged after
  the softmax, a different normaliser per head could reorder the average; the window's
  keys are all that is given.
- *Candidates.* kvpress pads the last token with the maximum score so it is never
  pruned; here the whole buffer is protected and only the first C keys are ranked.
- *Once per window.* TOVA evicts one token per decoding step once the cache is full;
  here a round evicts ``C - m`` of a window's keys at once, with the last query of that
  window. Exactly ``min(m, C)`` keys stay per (layer, KV head).
"""

from __future__ import annotations

from kvllm.methods.base import Method, Selection, Window, register
from kvllm.methods.scoring import attention_scores, topk_sorted


@register
class TOVA(Method):
    name = "tova"

    def select(self, window: Window, budget: int) -> Selection:
        c = window.n_compress
        hkv = window.keys.shape[2]
        # One query sees every key of the span: causal or not is the same softmax. Each
        # KV head's entry sums its group's heads; their mean over KV heads is TOVA's
        # average over all query heads, up to the constant group size.
        per_group = attention_scores(window, causal=False, last_queries=1)[..., :c]
        layer = per_group.mean(dim=2, keepdim=True)
        indices = topk_sorted(layer, min(budget, c))
        return Selection(indices.expand(-1, -1, hkv, -1).contiguous())
