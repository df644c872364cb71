"""StreamingLLM: attention sinks plus the most recent tokens.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024.
The sink tokens sit in the prompt, which is never compressed, so inside a
compressible area StreamingLLM keeps its last m tokens (the most recent ones).
"""

from __future__ import annotations

import torch

from kvllm.methods.base import Method, Selection, Window, register


@register
class StreamingLLM(Method):
    name = "streamingllm"

    def select(self, window: Window, budget: int) -> Selection:
        c = window.n_compress
        m = min(budget, c)
        b, n_layers, hkv = window.keys.shape[:3]
        idx = torch.arange(c - m, c, device=window.keys.device)
        return Selection(idx.expand(b, n_layers, hkv, m).contiguous())
