"""KNorm: keep the keys of lowest L2 norm.

Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression", EMNLP 2024, arXiv:2406.11430. Reference read: kvpress 0.5.5,
``kvpress/presses/knorm_press.py`` (``KnormPress.score``: ``-||k_i||_2``, accumulated in
at least fp32). Ours, per (sequence, layer, KV head)::

    s_i = -||k_i||_2        for i in the compressible area C (i < C)

and the top-m of ``s``: the m keys of lowest norm. No queries are read.

Where we differ, and why:

- *Candidates.* kvpress scores every key handed to the press (a prefilled prompt) and
  prunes among all of them; here only the window's compressible area is a candidate and
  the protected buffer keeps its keys, so the same score ranks the first C keys.
- *Budget.* kvpress keeps ``int(N * (1 - compression_ratio))`` keys per head; here
  exactly ``min(m, C)`` per (layer, KV head), as the paged engine needs.
- *Per window.* kvpress compresses once, after prefill; here each window of generated
  tokens is compressed once, in its own round.
"""

from __future__ import annotations

from kvllm.methods.base import Method, Selection, Window, register
from kvllm.methods.scoring import topk_sorted


@register
class KNorm(Method):
    name = "knorm"

    def select(self, window: Window, budget: int) -> Selection:
        c = window.n_compress
        # fp32, as kvpress: a bf16 norm would tie distinct keys and leave the choice to topk.
        scores = -window.keys[..., :c, :].float().norm(dim=-1)
        return Selection(topk_sorted(scores, min(budget, c)))
