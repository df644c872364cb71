"""KeyDiff: keep the keys least similar to the mean key direction.

Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM
Inference in Resource-Constrained Environments", 2025, arXiv:2504.15364. References
read: kvpress 0.5.5, ``kvpress/presses/keydiff_press.py`` (``KeyDiffPress.score``) and
``kvpress/presses/block_press.py`` (``BlockPress``, the paper's block-wise eviction).
Ours, per (sequence, layer, KV head), in fp32::

    a   = mean_{i < C} k_i / ||k_i||          # the anchor: the mean normalised key
    s_i = -cos(k_i, a)                        for i in the compressible area C

and the top-m of ``s``: the m keys most distinct from the anchor. No queries are read.

Where we differ, and why:

- *The anchor averages the compressible area.* kvpress averages every key handed to the
  press, which are exactly the keys it ranks for eviction; in the paper too the anchor
  is taken over the cache the next eviction chooses from. The keys ranked here are the
  area's C, so the anchor is theirs; the buffer's keys are not candidates this round
  (they open the next window, whose anchor they join), so they do not pull it.
- *Block-wise, once per token.* The paper evicts block by block, re-scoring what earlier
  blocks kept with each new block (kvpress's ``BlockPress``). Here each window is such a
  block, but what earlier rounds kept is never scored again: every token is compressed
  at most once (docs/design.md, "Kara", Rounds), and a method sees one window.
- *Budget.* Exactly ``min(m, C)`` keys per (layer, KV head), as the paged engine needs;
  kvpress keeps ``int(N * (1 - compression_ratio))`` per head.
"""

from __future__ import annotations

import torch.nn.functional as F

from kvllm.methods.base import Method, Selection, Window, register
from kvllm.methods.scoring import topk_sorted


@register
class KeyDiff(Method):
    name = "keydiff"

    def select(self, window: Window, budget: int) -> Selection:
        c = window.n_compress
        keys = window.keys[..., :c, :].float()
        anchor = F.normalize(keys, p=2, dim=-1).mean(dim=-2, keepdim=True)
        scores = -F.cosine_similarity(keys, anchor, dim=-1)
        return Selection(topk_sorted(scores, min(budget, c)))
