"""Every compression knob of KvLLM, validated once at construction.

The terms (window W, buffer b, retention r, period P, ...) are those of DESIGN.md §2.
A bad value raises :class:`ValueError` that names the field, the value and the valid
range, so a misconfigured engine fails at start-up instead of mid-generation.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

PolicyName = Literal["periodic", "threshold"]
POLICIES: tuple[str, ...] = ("periodic", "threshold")


def _fail(field: str, value: object, valid: str) -> None:
    raise ValueError(f"CompressionConfig.{field}={value!r} is invalid: {valid}")


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
        P: the engine runs a compression round every P decode steps (1 <= P <= W, so
        a sequence never outgrows one window per round).
    block_size
        KV block size of the paged engine (vLLM CPU needs a multiple of 32).
    policy
        ``"periodic"`` (Kara, DESIGN.md §4) or ``"threshold"`` (SnapKV/R-KV style).
    rho
        Token2Chunk: K = max(1, round(rho * m)) top tokens become chunk endpoints.
    beta
        Token2Chunk: a chunk scores (s[c_i] + s[c_i+1]) / (g + 2) ** beta.
    max_gap
        Token2Chunk: the longest gap that may be filled whole.
    obs_window
        SnapKV-family observation window w (last w queries score the keys).
    pool_kernel
        SnapKV-family average-pooling kernel (odd).
    chunk_size
        ChunkKV fixed chunk length.
    pyramid_beta
        PyramidKV: the last layer gets m / pyramid_beta, the first 2m - m / pyramid_beta.
    adakv_floor
        AdaKV safeguard: every head keeps at least this share of its uniform budget.
    rkv_lambda
        R-KV: score = lambda * importance - (1 - lambda) * redundancy.
    threshold_budget
        ThresholdPolicy: generated slots kept after a round. Must exceed ``window``
        under that policy.
    threshold_interval
        ThresholdPolicy: a round triggers at ``threshold_budget + threshold_interval``.
    seed
        Seed of the ``random`` baseline.
    """

    method: str = "kara"
    retention: float = 0.2
    window: int = 128
    buffer: int = 32
    period: int = 16
    block_size: int = 32
    policy: PolicyName = "periodic"
    rho: float = 0.5
    beta: float = 1.0
    max_gap: int = 16
    obs_window: int = 32
    pool_kernel: int = 7
    chunk_size: int = 10
    pyramid_beta: float = 20.0
    adakv_floor: float = 0.2
    rkv_lambda: float = 0.1
    threshold_budget: int = 512
    threshold_interval: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        # Imported here: the registry imports method modules, which may import this one.
        from kvllm.methods import available

        names = available()
        if self.method not in names:
            _fail("method", self.method, f"must be one of {', '.join(names)}")
        self._check_number("retention", self.retention, 0.0, 1.0, "must be in (0, 1]", lo_open=True)
        self._check_int("block_size", self.block_size, 1, None)
        if not isinstance(self.window, int) or self.window <= 0 or self.window % self.block_size:
            _fail("window", self.window, f"must be a positive multiple of block_size={self.block_size}")
        self._check_int("buffer", self.buffer, 0, self.window - 1)
        self._check_int("period", self.period, 1, self.window)
        if self.policy not in POLICIES:
            _fail("policy", self.policy, f"must be one of {', '.join(POLICIES)}")
        self._check_number("rho", self.rho, 0.0, 1.0, "must be in (0, 1]", lo_open=True)
        self._check_number("beta", self.beta, 0.0, math.inf, "must be >= 0")
        self._check_int("max_gap", self.max_gap, 0, None)
        self._check_int("obs_window", self.obs_window, 1, self.window + self.buffer)
        if not isinstance(self.pool_kernel, int) or self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            _fail("pool_kernel", self.pool_kernel, "must be an odd integer >= 1")
        self._check_int("chunk_size", self.chunk_size, 1, self.window)
        self._check_number("pyramid_beta", self.pyramid_beta, 1.0, math.inf, "must be >= 1")
        self._check_number("adakv_floor", self.adakv_floor, 0.0, 1.0, "must be in [0, 1]")
        self._check_number("rkv_lambda", self.rkv_lambda, 0.0, 1.0, "must be in [0, 1]")
        # The threshold policy keeps the last window uncompressed inside its budget.
        lo = self.window + 1 if self.policy == "threshold" else 1
        self._check_int("threshold_budget", self.threshold_budget, lo, None)
        self._check_int("threshold_interval", self.threshold_interval, 1, None)
        self._check_int("seed", self.seed, 0, None)

    @staticmethod
    def _check_int(field: str, value: Any, lo: int, hi: int | None) -> None:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= lo
        if ok and (hi is None or value <= hi):
            return
        _fail(field, value, f"must be an integer in [{lo}, {'inf' if hi is None else hi}]")

    @staticmethod
    def _check_number(field: str, value: Any, lo: float, hi: float, valid: str, lo_open: bool = False) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            _fail(field, value, valid)
        if value < lo or (lo_open and value == lo) or value > hi:
            _fail(field, value, valid)

    @property
    def budget(self) -> int:
        """m: slots kept per (layer, KV head) from one window's compressible area."""
        return max(1, round(self.retention * self.window))

    @property
    def query_buffer_len(self) -> int:
        """Queries a backend must remember per sequence: W + b + P (DESIGN.md §6)."""
        return self.window + self.buffer + self.period

    def replace(self, **changes: Any) -> CompressionConfig:
        """A validated copy with ``changes`` applied (per-request overrides)."""
        return dataclasses.replace(self, **changes)
