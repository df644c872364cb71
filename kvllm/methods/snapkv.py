"""SnapKV: observation-window attention, pooled, top-m.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", 2024.
References read: FasterDecoding/SnapKV at e216ddc, ``snapkv/monkeypatch/snapkv_utils.py``
(``SnapKVCluster.update_kv``), and NVIDIA/kvpress at 8bb29b9,
``kvpress/presses/snapkv_press.py`` (``SnapKVPress``). Our formula: with the last w
queries of the span,
``s = avgpool_k(sum_{g in G} sum_{j in obs} softmax_causal(Q_g K^T / sqrt(d))[j])``
over the compressible keys (zero padding counted in the pool), then the top-m of ``s``.

Where we differ, and why:

- *obs_window and buffer.* SnapKV's observation window is also the part it keeps
  uncompressed; here the protected part is the buffer b (``CompressionConfig.buffer``)
  and the observation window is ``obs_window``. With ``obs_window == buffer`` the
  kept set is exactly kvpress's (the pooled keys are its "all but the window").
- *Sums, not means.* We sum over the observation queries and the GQA group where
  kvpress averages (SnapKV sums over the queries): a constant factor, the same ranking.
- *Defaults* w = 32, k = 7 are the window and kernel of the configs the authors ship
  (``experiments/LongBench/config/*_w32_k7_maxpool.json``); we average-pool, as
  SnapKV's ``init_snapkv`` default (w 32, k 5, ``avgpool``) and kvpress (w 64, k 5) do.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvllm.checks import check_int, fail
from kvllm.methods.base import FIELD, Method, MethodParams, Selection, Window, register
from kvllm.methods.scoring import snapkv_scores, topk_sorted


@dataclass(frozen=True)
class SnapKVParams(MethodParams):
    """The observation window and pooling of SnapKV scores (shared by its family).

    Attributes
    ----------
    obs_window
        w: the last w queries of the span score the keys, in [1, W + b].
    pool_kernel
        Average-pooling kernel along the keys, an odd integer >= 1.
    """

    obs_window: int = 32
    pool_kernel: int = 7

    def check(self, window: int, buffer: int) -> None:
        check_int(f"{FIELD}.obs_window", self.obs_window, 1, window + buffer)
        k = self.pool_kernel
        if isinstance(k, bool) or not isinstance(k, int) or k < 1 or k % 2 == 0:
            fail(f"{FIELD}.pool_kernel", k, "must be an odd integer >= 1")


@register
class SnapKV(Method):
    name = "snapkv"
    Params = SnapKVParams

    def select(self, window: Window, budget: int) -> Selection:
        scores = snapkv_scores(window, self.params.obs_window, self.params.pool_kernel)
        return Selection(topk_sorted(scores, min(budget, window.n_compress)))
