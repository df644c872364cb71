"""The selection interface every method implements, and the registry keyed by name.

A method answers one question: given a window's post-RoPE queries and keys and a
budget, which keys of the compressible area stay? It knows nothing about blocks,
caches, engines or :class:`~kvllm.config.CompressionConfig` (docs/design.md, "Layers"),
so the transformers reference backend and the vLLM backend call the very same code.

A method's own knobs live with it, as a frozen :class:`MethodParams` dataclass named
``Params`` on its class; the config carries only the overrides a user gave
(``CompressionConfig(method="kara", params={"rho": 0.4})``) and resolves them here.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor

from kvllm.methods.rope import Rope

#: How a method parameter is named in errors: the user sets it through the config.
FIELD = "CompressionConfig.params"


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
    seeds
        One random-stream key per sequence (:func:`stream_seed`), for methods that draw
        random numbers; ``None`` when the backend has none to give.
    positions
        Per sequence, the logical position of the span's first key (counting the
        sequence's own tokens from 0; the span's keys are consecutive from there, and
        it is their RoPE position), for selectors that look tokens up elsewhere (the
        evaluation's oracle) or undo the rotation; ``None`` when the backend has none.
    values
        ``[B, L, Hkv, N, D]`` values of the span, for scorers that weigh a key by what
        it would add to the output (value norms); ``None`` when the backend has none.
    rope
        The model's RoPE table, with :attr:`positions` enough to undo or redo the
        rotation of the queries and keys (:meth:`key_positions`); ``None`` when the
        backend has none to give.
    """

    queries: Tensor
    keys: Tensor
    n_compress: int
    seeds: tuple[int, ...] | None = None
    positions: tuple[int, ...] | None = None
    values: Tensor | None = None
    rope: Rope | None = None

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
        if self.values is not None and self.values.shape != k.shape:
            raise ValueError(f"values {tuple(self.values.shape)} must have the keys' shape {tuple(k.shape)}")
        if self.rope is not None and self.positions is None:
            raise ValueError("a Window with rope needs positions")
        for name in ("seeds", "positions"):
            value = getattr(self, name)
            if value is not None and len(value) != q.shape[0]:
                raise ValueError(f"{len(value)} {name} for {q.shape[0]} sequences")

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.queries.shape[2] // self.keys.shape[2]

    def key_positions(self) -> Tensor:
        """``[B, N]`` logical positions of the span's keys; the queries are the last ``Nq``."""
        if self.positions is None:
            raise ValueError("this backend gave no Window.positions")
        first = torch.tensor(self.positions, device=self.keys.device).unsqueeze(1)
        return first + torch.arange(self.keys.shape[3], device=self.keys.device)

    def require(self, *fields: str, method: str) -> None:
        """Raise naming ``method`` when the backend left one of ``fields`` out."""
        missing = [name for name in fields if getattr(self, name) is None]
        if missing:
            raise ValueError(f"method {method!r} needs Window.{', Window.'.join(missing)}, which this backend omits")


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


def stream_seed(prompt_ids: Sequence[int], round_index: int) -> int:
    """The random-stream key of one sequence's round ``round_index`` (0-based).

    Both backends derive it from what they share, the prompt's token ids and the round,
    so a request draws reproducibly, differently each round, and the same in hf and vLLM.
    """
    digest = hashlib.blake2b(digest_size=8)
    digest.update(round_index.to_bytes(8, "little"))
    digest.update(b"".join(int(t).to_bytes(8, "little") for t in prompt_ids))
    return int.from_bytes(digest.digest(), "little") >> 1  # a non-negative int64


@dataclass(frozen=True)
class MethodParams:
    """A method's own knobs (none here). Subclasses are frozen dataclasses with defaults."""

    def check(self, window: int, buffer: int) -> None:
        """Raise ``ValueError`` naming a field outside its range, for windows of ``window``
        compressible tokens and a ``buffer`` of protected ones."""


class Method(ABC):
    """A KV selection method. Subclasses set ``name`` and implement :meth:`select`.

    Parameters
    ----------
    params
        The method's resolved :attr:`Params` (:meth:`resolve`).
    """

    name: ClassVar[str]
    #: Whether every (layer, KV head) keeps the same count, so a block table fits all.
    uniform: ClassVar[bool] = True
    #: Whether it reads every span key's own position (to undo its RoPE rotation). A
    #: window gives one position per sequence, its keys consecutive from there, which
    #: is true only of an uncompressed span: the periodic policy's, not the threshold
    #: policy's, whose span holds compacted history.
    reads_key_positions: ClassVar[bool] = False
    #: Whether it un-rotates keys or queries with the model's RoPE table (``Window.rope``),
    #: which only a neox-style RoPE gives (kvllm/vllm/rope_support.py).
    reads_rope: ClassVar[bool] = False
    #: The method's parameter dataclass.
    Params: ClassVar[type[MethodParams]] = MethodParams

    def __init__(self, params: MethodParams) -> None:
        self.params = params

    @classmethod
    def resolve(cls, raw: Mapping[str, Any] | MethodParams | None, window: int, buffer: int) -> MethodParams:
        """``raw`` overrides on top of :attr:`Params`' defaults, checked."""
        if isinstance(raw, cls.Params):
            params = raw
        else:
            raw = dict(raw or {})
            names = [f.name for f in dataclasses.fields(cls.Params)]
            unknown = sorted(set(raw) - set(names))
            if unknown:
                valid = f"valid: {', '.join(names)}" if names else "it has none"
                raise ValueError(f"{FIELD} has unknown field(s) {unknown} for method {cls.name!r}: {valid}")
            params = cls.Params(**raw)
        params.check(window, buffer)
        return params

    @property
    def reads_values(self) -> bool:
        """Whether :meth:`select` reads ``Window.values``. A backend may leave them out
        otherwise: the vLLM runner then gathers the keys alone, which spares a round a
        fifth of its time at qwen3-0.6b-4l's shape with 16 requests
        (docs/appendix/method-notes.md, "What a round reads, and what it costs"). A
        method that reads them says so here."""
        return False

    def check_model(self, model_config: Any) -> None:  # noqa: B027 (a hook: most methods fit any model)
        """Raise ``ValueError`` when this method cannot run on the model of ``model_config``
        (a transformers ``PretrainedConfig``). Called once, before the model serves: a
        method bound to one model (a calibration file) fails there, not at its first round."""

    def observe(self, tokens: Tensor) -> None:  # noqa: B027 (a hook: no method reads the text)
        """The token each row just generated (``[B]``), from the reference backend's free
        decoding. Only the evaluation's free-running bound reads it (its roles are read
        off the text); the vLLM backend never calls it."""

    @abstractmethod
    def select(self, window: Window, budget: int) -> Selection:
        """Choose ``budget`` keys (on average) of ``window``'s compressible area."""

    def scores(self, window: Window) -> Tensor:
        """``[B, L, Hkv, C]``: the one score :meth:`select` ranks the compressible area by.

        Lazy retention (:mod:`kvllm.methods.lazy`) carries it to a round's second cut. A
        method that ranks by no single score (a random draw, per-chunk or cumulative
        scores) does not define it, and lazy retention then cannot mix it in.
        """
        raise NotImplementedError(f"method {self.name!r} ranks by no single window score")

    def select_scored(self, window: Window, budget: int) -> tuple[Selection, Tensor]:
        """:meth:`select` and the :meth:`scores` it ranked by (a :class:`ScoredMethod`
        computes them once)."""
        return self.select(window, budget), self.scores(window)

    @classmethod
    def has_scores(cls) -> bool:
        """Whether the method defines :meth:`scores`."""
        return cls.scores is not Method.scores


class ScoredMethod(Method):
    """A method that ranks the compressible area by one score, :meth:`scores`, and keeps
    what :meth:`choose` picks from it: the score is computed once, and lazy retention
    carries it (:meth:`select_scored`)."""

    @abstractmethod
    def scores(self, window: Window) -> Tensor: ...

    @abstractmethod
    def choose(self, scores: Tensor, budget: int) -> Selection:
        """Keep ``budget`` keys (on average) of the area ``scores`` ``[B, L, Hkv, C]`` rank."""

    def select(self, window: Window, budget: int) -> Selection:
        return self.select_scored(window, budget)[0]

    def select_scored(self, window: Window, budget: int) -> tuple[Selection, Tensor]:
        scores = self.scores(window)
        return self.choose(scores, budget), scores


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


def calibrated(name: str) -> bool:
    """Whether method ``name`` reads a per-model calibration file (``kvllm calibrate``).

    Such a method's ``Params`` names the file in a ``calibration`` field, with no usable
    default: the file belongs to one model, so the user must give it.
    """
    return any(f.name == "calibration" for f in dataclasses.fields(method_class(name).Params))


class Configured(Protocol):
    """What :func:`build` reads of a :class:`~kvllm.config.CompressionConfig`: named here,
    not imported, since the config imports this module and the dependency runs one way."""

    @property
    def method(self) -> str: ...

    @property
    def method_params(self) -> MethodParams: ...


@functools.lru_cache(maxsize=256)
def build(config: Configured) -> Method:
    """The method named by ``config.method``, with its resolved parameters.

    Built once per configuration and shared: methods hold no state between calls.
    """
    return method_class(config.method)(config.method_params)
