"""Lazy two-stage retention: a window keeps more, and the next window's queries cut it.

Beyond the paper (docs/design.md, "Lazy retention"). A periodic round scores a
window by its own queries, yet a key is worth keeping for the attention of queries that
come after the window, which no window query shows. Lazy retention lets the next
window vote without leaving the sliding-window design:

- **stage one**: a round keeps ``first = min(W, F * m)`` candidates of its window, by the
  method's own selection;
- **stage two**: the next round, the new window's W + b queries (all later than every
  candidate) score the candidates by their softmax attention over the candidates and
  the new span, bidirectional as Kara's, and the candidates' top m stay, ranked by::

      s_i = (1 - A) z(later_i) + A z(first_i)      # z: z-scored over the candidates

  where ``first_i`` is the score stage one ranked the candidate by
  (:meth:`~kvllm.methods.base.Method.scores`, carried between the two rounds).

Every region but the newest ends at the same m slots as a single-stage round; the
newest holds ``first - m`` more. The policy lays a round out so that one compaction
does both stages (:class:`~kvllm.policy.PeriodicWindowPolicy`): the region's area is
the previous round's candidates followed by the new window, and the kept indices are
the cut candidates followed by the new window's stage-one keys.

On ``reason`` with ``kara-reasoner-6l`` at r=0.2 this raised Kara's free-running
statements right from 0.320 to 0.453 on test seeds, with F = 2 and A = 0.5 chosen on
development seeds (docs/results/accuracy.md, "Selections that try to close the gap").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from kvllm.methods.base import Method, Selection, Window
from kvllm.methods.scoring import attention_scores, topk_sorted, zscore


@dataclass(frozen=True)
class LazyRound:
    """What one lazy round keeps.

    Attributes
    ----------
    candidates
        The previous round's candidates at the start of the window's area (0 in a
        sequence's first round).
    final
        m: the candidates kept after the cut.
    first
        The new window's stage-one candidates.
    keep
        A: stage two's weight on the stage-one score, in [0, 1].
    """

    candidates: int
    final: int
    first: int
    keep: float


def lazy_select(method: Method, window: Window, plan: LazyRound, carried: Tensor | None) -> tuple[Selection, Tensor]:
    """A lazy round's kept indices, and what the next round must be given back.

    Parameters
    ----------
    method
        The round's method; its selection is stage one.
    window
        The area is ``plan.candidates`` candidates followed by the new window's W
        compressible keys, the span ends with its b protected ones, and the queries are
        the new window's W + b (so ``window.positions``, when given, is the logical
        position the span's first key would have were the candidates consecutive: the
        new window's keys are).
    plan
        The round's counts and mix.
    carried
        ``[B, L, Hkv, candidates]``: the candidates' stage-one z-scores, as this
        function returned them last round; ``None`` in a first round, or when
        ``plan.keep`` is 0.

    Returns
    -------
    tuple[Selection, Tensor]
        The kept indices into the area (the cut candidates, then the new window's
        stage-one keys), and the new candidates' stage-one z-scores ``[B, L, Hkv,
        first]`` to carry (empty when ``plan.keep`` is 0).
    """
    n = plan.candidates
    new = window
    if n:
        new = dataclasses.replace(
            window,
            keys=window.keys[..., n:, :],
            n_compress=window.n_compress - n,
            positions=None if window.positions is None else tuple(p + n for p in window.positions),
            values=None if window.values is None else window.values[..., n:, :],
        )
    if plan.keep > 0:
        selection, scores = method.select_scored(new, plan.first)
        carry = zscore(scores).gather(-1, selection.indices)
    else:
        selection = method.select(new, plan.first)
        carry = selection.indices.new_empty(*selection.indices.shape[:-1], 0, dtype=torch.float32)
    if selection.valid is not None:
        raise ValueError(f"lazy retention needs a uniform method; {method.name!r} varies its counts")
    indices = selection.indices
    if n:
        # Every query is later than every candidate, so the later reads are these columns.
        later = zscore(attention_scores(window, causal=False)[..., :n])
        if plan.keep > 0:
            later = (1 - plan.keep) * later + plan.keep * zscore(carried)
        indices = torch.cat([topk_sorted(later, plan.final), indices + n], dim=-1)
    return Selection(indices), carry
