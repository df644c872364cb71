"""StreamingLLM: attention sinks plus the most recent tokens.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024.
References read: mit-han-lab/streaming-llm at 2e50426, ``streaming_llm/kv_cache.py``
(``StartRecentKVCache``: ``start_size = 4`` sinks and the last ``recent_size`` tokens),
and NVIDIA/kvpress at 8bb29b9, ``kvpress/presses/streaming_llm_press.py``
(``n_sink = 4``).

Where we differ, and why: compression here runs per window of generated tokens, and
the prompt is never compressed, so the sequence's first tokens, the sinks, always stay
(the prompt keeps the sinks). Inside a window's compressible area StreamingLLM keeps
its last m tokens, the most recent ones, per window rather than once over the whole
cache.
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
