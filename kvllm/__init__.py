"""KvLLM: serving reasoning LLMs with Kara sliding-window KV-cache compression."""

from kvllm.config import CompressionConfig

__all__ = ["CompressionConfig"]
__version__ = "0.1.0"
