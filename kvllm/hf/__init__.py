"""The reference backend: compression on transformers model code (docs/design.md, "Layers")."""

from kvllm.generation import Generation, SeqStats
from kvllm.hf.cache import CompressingCache
from kvllm.hf.generate import generate
from kvllm.hf.press import Press, compress

__all__ = ["CompressingCache", "Generation", "Press", "SeqStats", "compress", "generate"]
