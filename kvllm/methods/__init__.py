"""KV selection methods, one per module, behind one interface and a registry."""

from kvllm.methods import (  # noqa: F401  (importing registers each method)
    adakv,
    chunkkv,
    h2o,
    kara,
    pyramidkv,
    random,
    rkv,
    snapkv,
    streamingllm,
)
from kvllm.methods.base import Method, Selection, Window, available, build, method_class

__all__ = ["Method", "Selection", "Window", "available", "build", "method_class"]
