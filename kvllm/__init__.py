"""KvLLM: serving reasoning LLMs with Kara sliding-window KV-cache compression.

``from kvllm import LLM`` imports vLLM on first use only, so that ``import kvllm`` (the
config, the methods, the reference backend) never pays for it.
"""

from typing import Any

from kvllm.config import CompressionConfig

__all__ = ["LLM", "CompressionConfig"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from kvllm.vllm.llm import LLM

        return LLM
    raise AttributeError(f"module 'kvllm' has no attribute {name!r}")
