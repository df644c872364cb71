"""The oracle selector: an upper bound of attention-based selection, teacher-forced only.

At each round, per (layer, KV head), it keeps the m window keys that receive the most
attention from every *later* query of the forced sequence (the queries after the
window's span), as a Full-KV pass over the whole forced sequence computes it. No
decoding-time method can see those queries, so this bounds what attention-based
selection can keep at that budget. It plugs into the same cache, policy, rounds and
compaction as every method (``kvllm.hf.generate(..., method=oracle)``); it is not in the
method registry because it needs the forced future.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kvllm.methods.base import Method, Selection, Window
from kvllm.methods.scoring import topk_sorted


class Oracle(Method):
    """Keeps the window keys that later queries attend to most.

    Parameters
    ----------
    attention
        Per sequence, ``[L, Hkv, T, T]``: Full-KV attention of query ``j`` to key ``i``
        over the forced sequence (prompt and completion, no padding), summed over each
        KV head's GQA group of query heads.
    """

    name = "oracle"

    def __init__(self, attention: Sequence[Tensor]) -> None:
        super().__init__(Method.Params())
        self.attention = list(attention)

    def select(self, window: Window, budget: int) -> Selection:
        if window.positions is None:
            raise ValueError("the oracle needs Window.positions (the teacher-forced reference backend gives them)")
        c, span = window.n_compress, window.keys.shape[3]
        rows = []
        for att, start in zip(self.attention, window.positions, strict=True):
            t = att.shape[-1]
            later = min(start + span, t)
            scores = torch.zeros(att.shape[0], att.shape[1], c)
            keys = slice(min(start, t), min(start + c, t))
            scores[..., : keys.stop - keys.start] = att[:, :, later:, keys].sum(2)
            rows.append(scores)
        return Selection(topk_sorted(torch.stack(rows).to(window.keys.device), min(budget, c)))


@torch.inference_mode()
def full_attention(model, sequences: Sequence[Sequence[int]]) -> list[Tensor]:
    """Per sequence, Full-KV attention ``[L, Hkv, T, T]`` (GQA groups summed), fp32."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    try:
        out = []
        for ids in sequences:
            att = model(torch.tensor([list(ids)]), output_attentions=True).attentions
            per_layer = [a[0].float().unflatten(0, (-1, groups)).sum(1) for a in att]  # [Hkv, T, T]
            out.append(torch.stack(per_layer))
        return out
    finally:
        model.set_attn_implementation(previous)
