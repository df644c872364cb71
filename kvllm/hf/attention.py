"""The attention function the reference backend registers with transformers.

It is transformers' eager attention, op for op (so that without compression the tokens
match ``model.generate`` exactly), with two additions: it records each token's
post-RoPE query for window scoring, and it takes its mask from the cache's slot
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
    key_states = key.repeat_interleave(groups, dim=1) if groups > 1 else key
    value_states = value.repeat_interleave(groups, dim=1) if groups > 1 else value
    weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    weights = weights + layer.attention_bias(query.shape[2], weights.dtype, groups)
    weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(weights, value_states)
    return out.transpose(1, 2).contiguous(), weights


AttentionInterface.register(NAME, kvllm_attention)
