"""R-KV: importance minus redundancy.

Cai et al., "R-KV: Redundancy-aware KV Cache Compression for Training-Free Reasoning
Models Acceleration", 2025. Our exact form, per (layer, KV head) over the compressible
keys::

    I_i = s_i / sum_k s_k                       # s: SnapKV scores (obs window, pooled)
    R_i = softmax_i( mean_{j != i} cos(k_i, k_j) )
    z_i = lambda * I_i - (1 - lambda) * R_i      # lambda = 0.1

and the top-m of z: a token is kept when it is attended to and unlike the others.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvllm.methods.base import Method, Selection, Window, register
from kvllm.methods.scoring import snapkv_scores, topk_sorted


@register
class RKV(Method):
    name = "rkv"

    def select(self, window: Window, budget: int) -> Selection:
        cfg = self.config
        c = window.n_compress
        s = snapkv_scores(window, cfg.obs_window, cfg.pool_kernel)
        importance = s / s.sum(-1, keepdim=True).clamp_min(1e-12)
        k = F.normalize(window.keys[..., :c, :].float(), dim=-1)
        sim = k @ k.transpose(-1, -2)
        sim = sim - torch.diag_embed(sim.diagonal(dim1=-2, dim2=-1))
        redundancy = (sim.sum(-1) / max(c - 1, 1)).softmax(-1)
        z = cfg.rkv_lambda * importance - (1 - cfg.rkv_lambda) * redundancy
        return Selection(topk_sorted(z, min(budget, c)))
