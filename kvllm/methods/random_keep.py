"""Random: m uniformly random tokens per (layer, KV head), a floor for every method.

(The module is ``random_keep``, not ``random``, so that it does not shadow the standard
library's module.) Each sequence's draw is seeded by ``seed`` and the window's stream
key (:func:`~kvllm.methods.base.stream_seed`: the prompt's tokens and the round), so a
request draws reproducibly, differently each round, and the same in both backends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvllm.checks import check_int
from kvllm.methods.base import FIELD, Method, MethodParams, Selection, Window, register
from kvllm.methods.scoring import topk_sorted


@dataclass(frozen=True)
class RandomParams(MethodParams):
    """Attributes
    ----------
    seed
        Mixed into every sequence's stream key, >= 0.
    """

    seed: int = 0

    def check(self, window: int, buffer: int) -> None:
        check_int(f"{FIELD}.seed", self.seed, 0)


@register
class Random(Method):
    name = "random"
    Params = RandomParams

    def select(self, window: Window, budget: int) -> Selection:
        b = window.keys.shape[0]
        shape = (*window.keys.shape[1:3], window.n_compress)
        keys = window.seeds if window.seeds is not None else (0,) * b
        gens = [torch.Generator().manual_seed((self.params.seed * 1_000_003 + k) % 2**63) for k in keys]
        scores = torch.stack([torch.rand(shape, generator=g) for g in gens]).to(window.keys.device)
        return Selection(topk_sorted(scores, min(budget, window.n_compress)))
