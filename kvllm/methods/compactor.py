"""Compactor: approximate leverage scores of the pre-RoPE keys, blended with non-causal attention.

Chari & Van Durme, "Compactor: Calibrated Query-Agnostic KV Cache Compression with
Approximate Leverage Scores", 2025, arXiv:2507.08143. Reference read: kvpress 0.5.5,
``kvpress/presses/compactor_press.py`` (``CompactorPress``) over
``leverage_press.py`` (``LeverageScorePress``) and ``non_causal_attention_press.py``
(``NonCausalAttnPress``, :mod:`kvllm.methods.noncausal_attn`). Per (sequence, layer,
KV head), with ``K`` the span's keys before RoPE (``Window.rope`` undoes the rotation)::

    X     = (K - mean_i K_i) Phi,   Phi ~ N(0, 1 / k)^{d x k}     # right Gaussian sketch
    G     = X^T X + eps I                                        # eps = 1e-2, x10 on failure
    lev_i = max(0, X_i G^{-1} X_i^T)                             # by a Cholesky solve
    score = blending * zscore(lev) + zscore(noncausal-attn)

with ``k = sketch_dimension = 48``, ``blending = 1 - m / C`` unless set, the z-scores
taken per (sequence, layer) over every KV head and candidate, and the top-m of
``score`` over the compressible keys.

Where we differ, and why:

- *blending's default.* kvpress defaults ``blending`` to its ``compression_ratio``, the
  fraction removed. A method here sees the budget m and the area C, so the default is
  ``1 - m / C``, the ratio for which kvpress keeps m of C.
- *Seeded sketch.* kvpress draws ``Phi`` from torch's global generator. Here each
  sequence draws its ``[L, Hkv, d, k]`` sketch from a CPU ``torch.Generator`` seeded
  with its ``Window.seeds`` key (the prompt's tokens and the round, docs/design.md,
  "Random draws"), so a request draws reproducibly, differently each round, and the
  same in hf and vLLM; a backend without seeds is refused (``Window.require``).
- *No sinks.* kvpress protects its first ``sink_size_start = 8`` and last
  ``sink_size_end = 4`` tokens, cutting them out before scoring. A sequence's sinks are
  in its prompt, never compressed, and a window's first tokens are nothing special, so
  there is no ``sink_size_start``; the buffer b protects the span's end in place of
  ``sink_size_end``, but it is scored with, not cut out: its keys and queries are the
  context both scorers see (the only queries we have are the window's). The sketch's
  centring and Gram matrix run over the span's N keys; the z-scores over the C
  candidates, the keys that compete, as kvpress's run over the keys it may drop.
- *Jitter per sequence and layer.* kvpress retries the Cholesky factorisation with a
  larger jitter when any head of the layer's batch fails; here any head of one
  sequence's layer, so that a sequence's selection does not depend on its batch.
- *No chunk_size*, and the rest of ``noncausal-attn``'s differences, for its half.
- *fp32 throughout* (kvpress sketches in the model's dtype); exactly ``min(m, C)`` keys
  per (layer, KV head).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from kvllm.checks import check_int, check_number
from kvllm.methods.base import FIELD, Method, MethodParams, Selection, Window, register
from kvllm.methods.noncausal_attn import layer_zscore, noncausal_scores
from kvllm.methods.scoring import topk_sorted

# LeverageScorePress.chol_with_jitter(G, jitter=1e-2, max_tries=5).
_JITTER = 1e-2
_TRIES = 5


@dataclass(frozen=True)
class CompactorParams(MethodParams):
    """kvpress 0.5.5's ``CompactorPress`` knobs that apply to a window.

    Attributes
    ----------
    sketch_dimension
        k: columns of the Gaussian sketch, >= 1; 48.
    blending
        The leverage z-scores' weight, >= 0; ``None`` (the default) means ``1 - m / C``.
    """

    sketch_dimension: int = 48
    blending: float | None = None

    def check(self, window: int, buffer: int) -> None:
        check_int(f"{FIELD}.sketch_dimension", self.sketch_dimension, 1)
        if self.blending is not None:
            check_number(f"{FIELD}.blending", self.blending, 0.0, float("inf"), "must be >= 0 or None")


def sketch(window: Window, sketch_dimension: int) -> Tensor:
    """Each sequence's ``[L, Hkv, d, k]`` Gaussian sketch, drawn from its seed: ``[B, L, Hkv, d, k]``."""
    shape = (*window.keys.shape[1:3], window.keys.shape[-1], sketch_dimension)
    # CPU generators draw the same numbers on every machine, so both backends agree.
    draws = [torch.randn(shape, generator=torch.Generator().manual_seed(seed)) for seed in window.seeds]
    return torch.stack(draws).to(window.keys.device) / math.sqrt(sketch_dimension)


def _cholesky(gram: Tensor) -> Tensor:
    """The Cholesky factor of ``gram`` ``[B, L, H, k, k]`` plus a jitter, raised tenfold
    for a (sequence, layer) while any of its heads fails, at most five times."""
    eye = torch.eye(gram.shape[-1], device=gram.device)
    jitter = torch.full((*gram.shape[:2], 1, 1, 1), _JITTER, device=gram.device)
    for _ in range(_TRIES):
        factor, info = torch.linalg.cholesky_ex(gram + jitter * eye)
        failed = (info != 0).any(dim=-1)
        if not failed.any():
            return factor
        jitter = torch.where(failed[..., None, None, None], 10 * jitter, jitter)
    raise RuntimeError(f"compactor: the keys' Gram matrix is not positive definite after {_TRIES} jitters")


def leverage_scores(window: Window, sketch_dimension: int) -> Tensor:
    """Approximate leverage of the span's pre-RoPE keys: ``[B, L, Hkv, N]`` fp32."""
    b, n = window.keys.shape[0], window.keys.shape[3]
    keys = window.rope.unrotate(window.keys, window.key_positions().view(b, 1, 1, n))
    x = (keys - keys.mean(dim=-2, keepdim=True)) @ sketch(window, sketch_dimension)  # [B, L, Hkv, N, k]
    xt = x.transpose(-1, -2)
    gram = xt @ x
    factor = _cholesky(0.5 * (gram + gram.transpose(-1, -2)))
    # diag(X G^-1 X^T) without the N x N matrix: G^-1 X^T by the Cholesky solve.
    solved = torch.cholesky_solve(xt, factor)
    return (x * solved.transpose(-1, -2)).sum(dim=-1).clamp_min(0)


@register
class Compactor(Method):
    name = "compactor"
    reads_rope = True
    Params = CompactorParams
    reads_key_positions = True

    @property
    def reads_values(self) -> bool:
        return True

    def select(self, window: Window, budget: int) -> Selection:
        window.require("values", "rope", "seeds", method=self.name)
        p = self.params
        c = window.n_compress
        m = min(budget, c)
        blending = p.blending if p.blending is not None else 1 - m / c
        leverage = layer_zscore(leverage_scores(window, p.sketch_dimension)[..., :c])
        scores = blending * leverage + noncausal_scores(window, self.name)
        return Selection(topk_sorted(scores, m))
