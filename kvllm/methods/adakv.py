"""AdaKV: head-adaptive budgets over SnapKV scores.

Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for
Efficient LLM Inference", 2024. Per layer the H KV heads share H * m slots. Each head
first keeps its top floor(0.2 * m) tokens (the safeguard); the remaining slots go to
the highest SnapKV scores over all heads of the layer together. Per-head counts
differ, so this runs on the reference backend only (masking).
"""

from __future__ import annotations

import math

import torch

from kvllm.methods.base import Method, Selection, Window, register
from kvllm.methods.scoring import snapkv_scores, topk_variable


@register
class AdaKV(Method):
    name = "adakv"
    uniform = False

    def select(self, window: Window, budget: int) -> Selection:
        cfg = self.config
        s = snapkv_scores(window, cfg.obs_window, cfg.pool_kernel)
        b, n_layers, hkv, c = s.shape
        m = min(budget, c)
        floor = math.floor(cfg.adakv_floor * m)
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
