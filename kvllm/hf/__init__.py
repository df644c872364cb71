"""The reference backend: Kara on transformers model code (DESIGN.md §1)."""

from kvllm.hf.cache import KaraCache, SeqStats
from kvllm.hf.generate import Generation, generate

__all__ = ["Generation", "KaraCache", "SeqStats", "generate"]
