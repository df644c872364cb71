"""The selection interface every method implements, and the registry keyed by name.

A method answers one question: given a window's post-RoPE queries and keys and a
budget, which keys of the compressible area stay? It knows nothing about blocks,
caches or engines (DESIGN.md §1), so the transformers reference backend and the vLLM
backend call the very same code.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

if TYPE_CHECKING:
    from kvllm.config import CompressionConfig


@dataclass(frozen=True)
class Window:
    """The tensors a method scores, batched over sequences and layers.

    Attributes
    ----------
    queries
        ``[B, L, Hq, Nq, D]`` post-RoPE queries of the *last* ``Nq`` tokens of the span.
    keys
        ``[B, L, Hkv, N, D]`` post-RoPE keys of the whole scoring span. ``Hq`` is a
        multiple of ``Hkv`` (GQA); query head ``h`` reads KV head ``h // (Hq // Hkv)``,
        as transformers' ``repeat_kv`` lays them out.
    n_compress
        C: the compressible area is ``keys[..., :C, :]``; the rest of the span (the
        protected buffer, or the recent tokens of a threshold round) only scores.
    """

    queries: Tensor
    keys: Tensor
    n_compress: int

    def __post_init__(self) -> None:
        q, k = self.queries, self.keys
        if q.dim() != 5 or k.dim() != 5:
            raise ValueError(f"queries and keys must be 5-D, got {tuple(q.shape)} and {tuple(k.shape)}")
        if q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1] or q.shape[2] % k.shape[2]:
            raise ValueError(f"incompatible queries {tuple(q.shape)} and keys {tuple(k.shape)}")
        if q.shape[3] > k.shape[3]:
            raise ValueError(f"{q.shape[3]} queries but only {k.shape[3]} keys in the span")
        if not 1 <= self.n_compress <= k.shape[3]:
            raise ValueError(f"n_compress={self.n_compress} must be in [1, {k.shape[3]}]")

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.queries.shape[2] // self.keys.shape[2]


@dataclass(frozen=True)
class Selection:
    """Kept indices into the compressible area.

    Attributes
    ----------
    indices
        ``[B, L, Hkv, M]`` int64. Each row's valid entries come first, sorted ascending
        and unique, all in ``[0, C)``.
    valid
        ``[B, L, Hkv, M]`` bool, or ``None`` when every row keeps exactly ``M``
        (uniform methods). Only PyramidKV and AdaKV vary counts; a paged engine cannot
        hold those, so only the reference backend accepts them, by masking.
    """

    indices: Tensor
    valid: Tensor | None = None

    @property
    def counts(self) -> Tensor:
        """``[B, L, Hkv]`` kept slots per row."""
        if self.valid is None:
            shape = self.indices.shape
            return torch.full(shape[:-1], shape[-1], dtype=torch.long, device=self.indices.device)
        return self.valid.sum(-1)


class Method(ABC):
    """A KV selection method. Subclasses set ``name`` and implement :meth:`select`."""

    name: ClassVar[str]
    #: Whether every (layer, KV head) keeps the same count, so a block table fits all.
    uniform: ClassVar[bool] = True

    def __init__(self, config: CompressionConfig) -> None:
        self.config = config

    @abstractmethod
    def select(self, window: Window, budget: int) -> Selection:
        """Choose ``budget`` keys (on average) of ``window``'s compressible area."""


_REGISTRY: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: make ``cls`` available under ``cls.name``."""
    if cls.name in _REGISTRY:
        raise ValueError(f"method {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def available() -> list[str]:
    """Registered method names, sorted."""
    return sorted(_REGISTRY)


def method_class(name: str) -> type[Method]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown method {name!r}: must be one of {', '.join(available())}")
    return _REGISTRY[name]


def build(config: CompressionConfig) -> Method:
    """The method named by ``config.method``, parameterised by ``config``."""
    return method_class(config.method)(config)
