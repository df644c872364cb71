"""The reachable bound: a selector that knows every value's tokens, not which will be read.

The oracle (:mod:`kvllm.eval.oracle`) keeps what the future queries of *this* sequence
attend to, so it knows which values will be read. No causal method can. This selector
knows everything else a causal method could learn about the task: the grammar. Each
generated token gets a *role*, its line's kind (statement, check, restatement, hedge,
other) and its place counted from the line's end (so `` = wa38`` at a statement's end is
the same roles in every line). Per (layer, KV head) it scores a role by the attention keys
of that role receive from queries at least ``W`` tokens later, in Full-KV passes over the
*other* problems of the cell (leave-one-out), and keeps the window's keys of the best
roles. Every value written in a window has the same roles, so it keeps all of them alike,
whether or not they are read again.

The gap between a method and this bound is what a causal method could still close on the
task; the gap between this bound and the oracle is what knowing the future is worth.
Teacher-forced, the roles are read off the forced sequence and the scores come from
the other problems' forced sequences. Free-running (:class:`FreeRoleBound`), the roles
are read off the text the row has generated so far, and the scores come from the other
problems' reference chains: a window's tokens are at least the protected buffer ``b``
behind the last one generated, so their lines (about 20 tokens on ``reason``) have ended
and their places from the line's end are known when the window is compressed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import Tensor

from kvllm.eval import lookup
from kvllm.methods.base import Method, Selection, Window

#: Line kinds, first match wins; a line that matches none is ``other``.
KINDS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("statement", lookup.STATEMENT),
    ("check", lookup.CHECK),
    ("restate", lookup.RESTATE),
    ("hedge", lookup.HEDGE),
)
#: Places counted from a line's end; longer lines share the last place.
PLACES = 32
#: Roles: (kind, place) pairs, and one for the prompt (never in a window).
ROLES = (len(KINDS) + 1) * PLACES + 1
PROMPT_ROLE = ROLES - 1


def token_roles(tokenizer, prompt_len: int, completion: Sequence[int]) -> Tensor:
    """Per token of ``prompt + completion`` (``prompt_len`` prompt tokens), its role id."""
    text, owner = lookup.char_to_token(tokenizer, completion)
    roles = torch.full((prompt_len + len(completion),), PROMPT_ROLE, dtype=torch.long)
    pos = 0
    for line in text.split("\n"):
        chars = range(pos, pos + len(line) + 1)  # the line and its newline
        pos += len(line) + 1
        tokens = sorted({owner[c] for c in chars if c < len(owner)})
        kind = next((k for k, (_, pattern) in enumerate(KINDS) if pattern.match(line)), len(KINDS))
        for place, t in enumerate(reversed(tokens)):
            roles[prompt_len + t] = kind * PLACES + min(place, PLACES - 1)
    return roles


def role_attention(attention: Tensor, roles: Tensor, gap: int) -> tuple[Tensor, Tensor]:
    """Per (layer, KV head, role): the summed attention keys of that role receive from
    queries ``gap`` or more tokens later, and the number of keys (``[L, Hkv, R]``, ``[R]``).

    ``attention`` is ``[L, Hkv, T, T]`` (query, key), as :func:`~kvllm.eval.oracle.full_attention`.
    """
    t = attention.shape[-1]
    # Key i gets the attention of queries j >= i + gap: a lower triangle shifted down.
    far = torch.ones(t, t, dtype=torch.bool).tril(-gap)
    received = (attention * far).sum(2)  # [L, Hkv, T]
    total = torch.zeros(*received.shape[:2], ROLES).index_add_(2, roles, received)
    count = torch.zeros(ROLES).index_add_(0, roles, torch.ones(t))
    return total, count


class RoleBound(Method):
    """Keeps the window's keys whose roles other problems' later queries attend to most.

    Parameters
    ----------
    roles
        Per sequence of the batch, its tokens' roles (:func:`token_roles`).
    scores
        Per sequence, ``[L, Hkv, R]``: each role's mean received attention over the other
        problems (:func:`leave_one_out`).
    """

    name = "bound"

    def __init__(self, roles: Sequence[Tensor], scores: Sequence[Tensor]) -> None:
        super().__init__(Method.Params())
        self.roles, self.scores = list(roles), list(scores)

    def select(self, window: Window, budget: int) -> Selection:
        if window.positions is None:
            raise ValueError("the bound needs Window.positions (the teacher-forced reference backend gives them)")
        c = window.n_compress
        rows = []
        for roles, scores, start in zip(self.roles, self.scores, window.positions, strict=True):
            keys = roles[start : start + c]
            row = torch.full((*scores.shape[:2], c), -1.0)
            row[..., : len(keys)] = scores[..., keys]
            rows.append(row)
        # Keys of one role tie: the later ones win (a stable sort of the reversed row), so
        # that the choice is the same on every machine and recency, which any causal
        # method can see, breaks the tie.
        order = torch.sort(torch.stack(rows).flip(-1), dim=-1, descending=True, stable=True).indices
        kept = (c - 1 - order[..., : min(budget, c)]).sort(-1).values
        return Selection(kept.to(window.keys.device))


class FreeRoleBound(RoleBound):
    """:class:`RoleBound` on free-running rows: each row's roles are recomputed, at each
    round, from its prompt's length and the tokens it generated so far (:meth:`observe`).

    Parameters
    ----------
    tokenizer
        The model's tokenizer (roles are read off the decoded text).
    prompt_lens
        Per row, its prompt's token count (no padding).
    scores
        Per row, ``[L, Hkv, R]``, as :class:`RoleBound`'s.
    """

    def __init__(self, tokenizer, prompt_lens: Sequence[int], scores: Sequence[Tensor]) -> None:
        super().__init__([torch.empty(0, dtype=torch.long)] * len(prompt_lens), scores)
        self.tokenizer, self.prompt_lens = tokenizer, list(prompt_lens)
        self.completions: list[list[int]] = [[] for _ in prompt_lens]

    def observe(self, tokens: Tensor) -> None:
        for row, token in zip(self.completions, tokens.tolist(), strict=True):
            row.append(token)

    def select(self, window: Window, budget: int) -> Selection:
        self.roles = [
            token_roles(self.tokenizer, n, c) for n, c in zip(self.prompt_lens, self.completions, strict=True)
        ]
        return super().select(window, budget)


def leave_one_out(stats: Sequence[tuple[Tensor, Tensor]]) -> list[Tensor]:
    """Per problem, each role's mean received attention over every *other* problem."""
    total = sum(s for s, _ in stats)
    count = sum(n for _, n in stats)
    return [(total - s) / (count - n).clamp(min=1) for s, n in stats]
