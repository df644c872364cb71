"""Value-aware Kara: Kara's bidirectional scores weighed by value norms, pooled, or both.

Variants beyond the Kara paper (docs/design.md, "Value-aware Kara"), each with ``kara``
as its ablation: the scores are Kara's,
``a_i = sum_{g in G} sum_j softmax(Q_g K^T / sqrt(d))[j, i]`` over the span, and
Token2Chunk with Kara's knobs chooses from them; only the step between changes.

- ``kara-vnorm``: ``a_i * ||v_i||``. A key's attention mass says how often it is read,
  its value's norm how much it adds to the output when read; the product is the
  value-norm weighting of kvpress 0.5.5's ``NonCausalAttnPress`` and
  ``ExpectedAttentionPress`` (``non_causal_attention_press.py``,
  ``expected_attention_press.py``; arXiv:2507.08143 and arXiv:2510.00636).
- ``kara-pool``: ``avgpool_k(a)`` along the span (stride 1, zero padding counted, the
  area's last key pooled with the buffer's first), ``pool_kernel = 3`` as
  ``NonCausalAttnPress`` pools (SnapKV, arXiv:2404.14469, pools the same way). A key
  read with its neighbours scores above an isolated spike.
- ``kara-vpool``: both, in ``NonCausalAttnPress``'s order: ``avgpool_k(a_i * ||v_i||)``.

What they keep of kvpress's scorer is the weighting and the pooling only: the logits
keep Kara's ``1 / sqrt(d)`` (``NonCausalAttnPress`` has none), the group is summed, not
averaged (a constant factor), and no z-score is taken (it does not change a row's order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from kvllm.checks import fail
from kvllm.methods.base import FIELD, Window, register
from kvllm.methods.kara import Kara, KaraParams
from kvllm.methods.noncausal_attn import POOL_KERNEL
from kvllm.methods.scoring import attention_scores, avg_pool


@dataclass(frozen=True)
class KaraPoolParams(KaraParams):
    """Kara's knobs plus the pooling kernel.

    Attributes
    ----------
    pool_kernel
        Average-pooling kernel along the span's keys, an odd integer >= 1 (1: no
        pooling); 3, as kvpress's ``NonCausalAttnPress``.
    """

    pool_kernel: int = POOL_KERNEL

    def check(self, window: int, buffer: int) -> None:
        super().check(window, buffer)
        k = self.pool_kernel
        if isinstance(k, bool) or not isinstance(k, int) or k < 1 or k % 2 == 0:
            fail(f"{FIELD}.pool_kernel", k, "must be an odd integer >= 1")


class _KaraValue(Kara):
    """Kara's scores, optionally times ``||v||`` and then pooled, before Token2Chunk."""

    vnorm: ClassVar[bool]
    pooled: ClassVar[bool]

    @property
    def reads_values(self) -> bool:
        return self.vnorm

    def scores(self, window: Window) -> Tensor:
        scores = attention_scores(window, causal=False)
        if self.vnorm:
            window.require("values", method=self.name)
            scores = scores * window.values.float().norm(dim=-1)
        if self.pooled:
            scores = avg_pool(scores, self.params.pool_kernel)
        return scores[..., : window.n_compress]


@register
class KaraVNorm(_KaraValue):
    name = "kara-vnorm"
    vnorm, pooled = True, False


@register
class KaraPool(_KaraValue):
    name = "kara-pool"
    Params = KaraPoolParams
    vnorm, pooled = False, True


@register
class KaraVPool(_KaraValue):
    name = "kara-vpool"
    Params = KaraPoolParams
    vnorm, pooled = True, True
