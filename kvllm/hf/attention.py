"""The attention function the reference backend registers with transformers.

It computes transformers' eager attention, so that without compression the tokens match
``model.generate``'s (tested); GQA reads each KV head once instead of repeating it, which
can differ from eager attention in the last bits. It adds two things: it records each
token's post-RoPE query for window scoring, and it takes its mask from the cache's slot
validity, because after compaction the cache's physical layout no longer matches the
logical positions transformers would build a mask from.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import AttentionInterface

from kvllm.hf.cache import CompressingCache

NAME = "kvllm"


def kvllm_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    kvllm_cache: CompressingCache | None = None,
    **kwargs: object,
) -> tuple[Tensor, Tensor]:
    """Eager attention over a :class:`CompressingCache` layer; ``attention_mask`` is unused."""
    if kvllm_cache is None:
        raise RuntimeError("kvllm attention needs the CompressingCache passed as `kvllm_cache=`")
    layer = kvllm_cache.layers[module.layer_idx]
    layer.capture(query)
    groups = module.num_key_value_groups
    b, hq, q_len, d = query.shape
    # A KV head's group of query heads reads it as one [G * q, D] block, instead of
    # repeating the whole cache G times a step as transformers' eager attention does
    # (the same dot products; the copy was a third of a decode step).
    hkv = hq // groups
    grouped = query.reshape(b, hkv, groups * q_len, d)
    weights = torch.matmul(grouped, key.transpose(2, 3)).view(b, hkv, groups, q_len, -1) * scaling
    weights = weights + layer.attention_bias(q_len, weights.dtype).unsqueeze(2)
    weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(weights.view(b, hkv, groups * q_len, -1), value).view(b, hq, q_len, d)
    return out.transpose(1, 2).contiguous(), weights.view(b, hq, q_len, -1)


AttentionInterface.register(NAME, kvllm_attention)
