"""AdaKV: head-adaptive budgets over SnapKV scores.

Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for
Efficient LLM Inference", 2024. References read: NVIDIA/kvpress at 8bb29b9,
``kvpress/presses/adakv_press.py`` (``AdaKVPress``, ``alpha_safeguard = 0.2``), and
FFY0/AdaKV at efe4e2e, ``adaptive_snapkv/monkeypatch/snapkv_utils.py``
(``AdaptiveSnapKVCluster``; ``--floor_alpha 0.2`` in ``experiments/LongBench/pred.py``).

Per layer the H KV heads share H * m slots. Each head first keeps its top
floor(0.2 * m) tokens (the safeguard, kvpress's ``int(n_kept * alpha_safeguard)``);
the remaining slots go to the highest SnapKV scores over all heads of the layer
together (kvpress prunes the global bottom ``H * (C - m)``, the same set).

Where we differ, and why: kvpress's budget ``n_kept`` counts its observation window,
which it pads with the top score so that it is always kept; here the window (the
protected buffer) is outside the budget, so all H * m slots go to the compressible
keys. SnapKV scores are average-pooled as in kvpress (the AdaKV repo max-pools,
w = 32, k = 7). Per-head counts differ, so this runs on the reference backend only
(masking).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvllm.checks import check_number
from kvllm.methods.base import FIELD, Method, Selection, Window, register
from kvllm.methods.scoring import snapkv_scores, topk_variable
from kvllm.methods.snapkv import SnapKVParams


@dataclass(frozen=True)
class AdaKVParams(SnapKVParams):
    """SnapKV's knobs plus the safeguard.

    Attributes
    ----------
    floor
        Every head first keeps this share of its uniform budget, in [0, 1].
    """

    floor: float = 0.2

    def check(self, window: int, buffer: int) -> None:
        super().check(window, buffer)
        check_number(f"{FIELD}.floor", self.floor, 0.0, 1.0, "must be in [0, 1]")


@register
class AdaKV(Method):
    name = "adakv"
    uniform = False
    Params = AdaKVParams

    def select(self, window: Window, budget: int) -> Selection:
        p = self.params
        s = snapkv_scores(window, p.obs_window, p.pool_kernel)
        b, n_layers, hkv, c = s.shape
        m = min(budget, c)
        floor = math.floor(p.floor * m)
        counts = torch.full((b, n_layers, hkv), floor, dtype=torch.long, device=s.device)
        extra = hkv * (m - floor)
        if extra:
            guaranteed = torch.zeros(s.shape, dtype=torch.bool, device=s.device)
            if floor:
                guaranteed.scatter_(-1, s.topk(floor, dim=-1).indices, True)
            flat = s.masked_fill(guaranteed, float("-inf")).view(b, n_layers, hkv * c)
            winners = flat.topk(extra, dim=-1).indices // c
            counts += torch.zeros_like(counts).scatter_add_(-1, winners, winners.new_ones(winners.shape))
        indices, valid = topk_variable(s, counts)
        return Selection(indices, valid)
