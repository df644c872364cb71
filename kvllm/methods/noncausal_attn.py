"""Non-causal attention: the attention a key receives from every window query, times ||v||.

Chari & Van Durme, "Compactor: Calibrated Query-Agnostic KV Cache Compression with
Approximate Leverage Scores", 2025, arXiv:2507.08143: Compactor's attention half,
standing alone. Reference read: kvpress 0.5.5,
``kvpress/presses/non_causal_attention_press.py`` (``NonCausalAttnPress``). Per
(sequence, layer), with the window's post-RoPE queries and the span's keys and values::

    A_g  = softmax(Q_g K^T)                      # no causal mask, no 1 / sqrt(d), fp32
    a_i  = mean_{g in G} sum_j A_g[j, i]         # the GQA group's mean of column sums
    s_i  = avgpool_3(a_i * ||v_i||)              # stride 1, zero padding counted
    z    = (s - mean(s)) / max(std(s), 1e-6)     # over every KV head and candidate

and the top-m of ``z`` over the compressible keys. The logits are not scaled by
``1 / sqrt(d)``: kvpress's ``non_causal_chunked_attn`` softmaxes the raw ``q . k``, and
this module keeps its formula, unlike the model's own attention.

Where we differ, and why:

- *No chunks.* kvpress tiles the sequence into ``chunk_size = 256`` blocks, each
  attending to itself only, to bound a prompt's quadratic cost. A window is one span of
  W + b keys (160 by default), a single chunk, so it is scored whole and there is no
  ``chunk_size`` knob. Spans longer than 256 (threshold rounds) are scored whole too,
  not tiled; :func:`~kvllm.methods.scoring.attention_scores` bounds their memory.
- *No padding.* kvpress pads a sequence to a multiple of ``chunk_size``; its padded keys
  are filled with ``-1e-9`` (so they stay in the softmax with a logit of about 0) and
  its padded queries attend uniformly, adding a constant to every key of the last
  chunk. A 160-key window would be padded to 256; we score only the real queries and
  keys, which is what kvpress computes when the sequence fills its chunks.
- *The window's queries.* kvpress's queries are the whole prompt's; ours are the span's
  last ``Nq`` (all W + b of them under the periodic policy). They attend over every key
  of the span, buffer included, and the pooling runs along the span before the
  candidates are cut out, so the area's last key pools with the buffer's first.
- *z-score per sequence and layer.* kvpress z-scores one layer's ``(B, H_kv, S)``
  scores at once (its comment says head-wise; the code takes the mean and std of the
  whole tensor). Here each sequence's layer is normalised over its KV heads and
  candidates, so a sequence's selection does not depend on its batch. On its own the
  z-score leaves each row's ranking unchanged; it matters inside ``compactor``.
- *fp32 throughout*; exactly ``min(m, C)`` keys per (layer, KV head).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvllm.methods.base import Method, Selection, Window, register
from kvllm.methods.scoring import attention_scores, avg_pool, topk_sorted

#: NonCausalAttnPress's pooling kernel (``F.avg_pool1d(kernel_size=3, padding=1)``).
POOL_KERNEL = 3


def layer_zscore(scores: Tensor) -> Tensor:
    """``scores`` ``[B, L, Hkv, C]`` z-scored per (sequence, layer), as kvpress does a layer."""
    if scores.shape[2] * scores.shape[3] == 1:  # a lone candidate: no spread (kvpress: NaN)
        return torch.zeros_like(scores)
    mean = scores.mean(dim=(2, 3), keepdim=True)
    std = scores.std(dim=(2, 3), keepdim=True).clamp_min(1e-6)
    return (scores - mean) / std


def noncausal_scores(window: Window, method: str) -> Tensor:
    """NonCausalAttnPress's z-scores of the compressible keys: ``[B, L, Hkv, C]`` fp32."""
    window.require("values", method=method)
    a = attention_scores(window, causal=False, scale=1.0) / window.group
    s = avg_pool(a * window.values.float().norm(dim=-1), POOL_KERNEL)
    return layer_zscore(s[..., : window.n_compress])


@register
class NonCausalAttn(Method):
    name = "noncausal-attn"

    @property
    def reads_values(self) -> bool:
        return True

    def select(self, window: Window, budget: int) -> Selection:
        scores = noncausal_scores(window, self.name)
        return Selection(topk_sorted(scores, min(budget, window.n_compress)))
