"""PyramidKV: SnapKV scores with a pyramid of per-layer budgets.

Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
Funneling", 2024. References read: NVIDIA/kvpress at 8bb29b9,
``kvpress/presses/pyramidkv_press.py`` (``PyramidKVPress.get_layer_budget``), which
takes its formula from Zefan-Cai/KVCache-Factory (read at c97f9d7,
``pyramidkv/pyramidkv_utils.py``, ``PyramidKVCluster``), ``beta = 20``. With L layers,
mean budget m and a compressible area of C keys::

    lo = m / beta,   hi = 2 m - lo                       # the layers average m
    if hi > C:  hi = C,  lo = 2 m - C                    # kvpress: cap the first layer,
                                                         # the last ones take the rest
    if lo < 1:  lo = 1,  hi = 2 m - 1                    # ours: every layer keeps >= 1
    m_l = hi - (hi - lo) * l / (L - 1)                   # l = 0 (first) .. L - 1

Each layer keeps its top-``m_l`` SnapKV scores, as kvpress does. The clamps move budget
between layers and keep the mean, so the schedule lies in [1, C] before rounding; the
real ``m_l`` are then rounded by largest remainder (ties to the earlier layer), in exact
rational arithmetic, so the integers sum to exactly ``L * m`` for every m in [1, C] and
stay in [1, C] and non-increasing.

Deviations, and why:

- *Exact total.* kvpress rounds each layer on its own (``round``), which can miss
  ``L * m`` by up to ``L / 2``; here the totals match, so comparisons with the
  uniform methods are at equal memory.
- *The window is outside the budget.* kvpress's per-layer count includes its
  observation window (kept through the top score it pads the window with) and falls
  back to SnapKV's uniform budget when the smallest layer could not hold that window.
  Here the window is the protected buffer, outside m, so there is nothing to fall back
  for; the ``lo < 1`` clamp keeps every layer at one token at least instead.

Per-layer counts differ, so this runs on the reference backend only (masking).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

import torch
from torch import Tensor

from kvllm.checks import check_number
from kvllm.methods.base import FIELD, Method, Selection, Window, register
from kvllm.methods.scoring import snapkv_scores, topk_variable
from kvllm.methods.snapkv import SnapKVParams


@dataclass(frozen=True)
class PyramidKVParams(SnapKVParams):
    """SnapKV's knobs plus the pyramid's steepness.

    Attributes
    ----------
    beta
        The last layer gets m / beta, the first 2m - m / beta (before the clamps);
        beta >= 1; PyramidKV's 20.
    """

    beta: float = 20.0

    def check(self, window: int, buffer: int) -> None:
        super().check(window, buffer)
        check_number(f"{FIELD}.beta", self.beta, 1.0, float("inf"), "must be >= 1")


@lru_cache(maxsize=1024)
def _schedule(n_layers: int, budget: int, beta: float, cap: int) -> tuple[int, ...]:
    if n_layers == 1:
        return (budget,)
    lo = Fraction(0) if math.isinf(beta) else Fraction(budget) / Fraction(beta)
    hi = 2 * budget - lo
    if hi > cap:
        hi = Fraction(cap)
        lo = 2 * budget - hi
    if lo < 1:
        lo = Fraction(1)
        hi = 2 * budget - lo
    exact = [hi - (hi - lo) * layer / (n_layers - 1) for layer in range(n_layers)]
    base = [math.floor(x) for x in exact]
    short = n_layers * budget - sum(base)
    by_remainder = sorted(range(n_layers), key=lambda layer: (base[layer] - exact[layer], layer))
    for layer in by_remainder[:short]:
        base[layer] += 1
    return tuple(base)


def pyramid_budgets(n_layers: int, budget: int, beta: float, cap: int) -> Tensor:
    """Integer budget per layer, non-increasing with depth, in ``[1, cap]``, summing to
    ``n_layers * min(budget, cap)``.

    Parameters
    ----------
    n_layers
        L >= 1.
    budget
        m >= 1, the mean budget (clipped to ``cap``).
    beta
        The pyramid's steepness, >= 1.
    cap
        C >= 1, the most one layer can keep.
    """
    return torch.tensor(_schedule(n_layers, min(budget, cap), float(beta), cap), dtype=torch.long)


@register
class PyramidKV(Method):
    name = "pyramidkv"
    uniform = False
    Params = PyramidKVParams

    def select(self, window: Window, budget: int) -> Selection:
        p = self.params
        s = snapkv_scores(window, p.obs_window, p.pool_kernel)
        per_layer = pyramid_budgets(s.shape[1], budget, p.beta, s.shape[-1])
        indices, valid = topk_variable(s, per_layer.to(s.device).view(1, -1, 1))
        return Selection(indices, valid)
