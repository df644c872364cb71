"""PyramidKV: SnapKV scores with a pyramid of per-layer budgets.

Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
Funneling", 2024. With L layers, mean budget m and beta = 20::

    m_min = m / beta,   m_max = 2 m - m_min,
    m_l   = m_max - (m_max - m_min) * l / (L - 1)

rounded by largest remainder so the layers sum to L * m, then clipped to [1, C].
Per-layer counts differ, so this runs on the reference backend only (masking).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvllm.methods.base import Method, Selection, Window, register
from kvllm.methods.scoring import snapkv_scores, topk_variable


def pyramid_budgets(n_layers: int, budget: int, beta: float, cap: int) -> Tensor:
    """Integer budget per layer, decreasing with depth, with mean ``budget``."""
    if n_layers == 1:
        return torch.tensor([min(budget, cap)])
    lo = budget / beta
    hi = 2 * budget - lo
    exact = hi - (hi - lo) * torch.arange(n_layers, dtype=torch.float64) / (n_layers - 1)
    base = exact.floor().long()
    short = n_layers * budget - int(base.sum())
    base[(exact - base).argsort(descending=True, stable=True)[:short]] += 1
    return base.clamp(1, cap)


@register
class PyramidKV(Method):
    name = "pyramidkv"
    uniform = False

    def select(self, window: Window, budget: int) -> Selection:
        cfg = self.config
        s = snapkv_scores(window, cfg.obs_window, cfg.pool_kernel)
        per_layer = pyramid_budgets(s.shape[1], budget, cfg.pyramid_beta, s.shape[-1])
        indices, valid = topk_variable(s, per_layer.to(s.device).view(1, -1, 1))
        return Selection(indices, valid)
