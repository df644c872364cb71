"""Random: m uniformly random tokens per (layer, KV head), a floor for every method.

Seeded by ``CompressionConfig.seed``; each call draws afresh from one generator, so a
run is reproducible while windows get different draws.
"""

from __future__ import annotations

import torch

from kvllm.config import CompressionConfig
from kvllm.methods.base import Method, Selection, Window, register
from kvllm.methods.scoring import topk_sorted


@register
class Random(Method):
    name = "random"

    def __init__(self, config: CompressionConfig) -> None:
        super().__init__(config)
        self.generator = torch.Generator().manual_seed(config.seed)

    def select(self, window: Window, budget: int) -> Selection:
        shape = (*window.keys.shape[:3], window.n_compress)
        scores = torch.rand(shape, generator=self.generator).to(window.keys.device)
        return Selection(topk_sorted(scores, min(budget, window.n_compress)))
