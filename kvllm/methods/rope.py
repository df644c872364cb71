"""RoPE by position, for methods that undo or redo the rotation of a window's vectors.

The window holds post-RoPE queries and keys, as the attention kernels see them. A few
scorers need the vectors before the rotation: Compactor's leverage scores are taken on
pre-RoPE keys, and ExpectedAttention models pre-RoPE queries and rotates their statistics
to future positions (kvpress 0.5.5, ``leverage_press.py`` and
``expected_attention_press.py``). Both backends hand a :class:`Rope` over with the window
(``Window.rope``): vLLM its rotary layer's own ``cos_sin_cache``, the reference backend a
table built from the model's config as transformers builds it
(:func:`kvllm.hf.cache.rope_parameters`).

Only the neox layout is covered: the rotation pairs dimension ``i`` with ``i + r / 2``
(transformers' ``rotate_half``; vLLM's ``is_neox_style``), as in Qwen3 and Llama.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Rope:
    """RoPE's cos and sin for positions ``0 .. P - 1``.

    Attributes
    ----------
    cos_sin
        ``[P, r]``: row ``p`` is ``[cos(p f), sin(p f)] * s`` for the ``r / 2`` inverse
        frequencies ``f`` and the attention scaling ``s`` (1 for plain RoPE), vLLM's
        ``cos_sin_cache`` layout. The first ``r`` dimensions of a head rotate (``r`` is
        less than the head size under partial rotary), the rest pass through.
    """

    cos_sin: Tensor

    @classmethod
    def from_inv_freq(cls, inv_freq: Tensor, n_positions: int, scaling: float = 1.0) -> Rope:
        """The table of ``n_positions`` positions, computed as transformers and vLLM do (fp32)."""
        freqs = torch.arange(n_positions, dtype=torch.float32).unsqueeze(1) * inv_freq.float()
        return cls(torch.cat([freqs.cos(), freqs.sin()], dim=-1) * scaling)

    def _cos_sin(self, positions: Tensor, like: Tensor) -> tuple[Tensor, Tensor, int]:
        if int(positions.max()) >= self.cos_sin.shape[0]:
            raise ValueError(f"position {int(positions.max())} is past the RoPE table's {self.cos_sin.shape[0]}")
        rows = self.cos_sin.to(like.device)[positions].float()
        half = rows.shape[-1] // 2
        cos, sin = rows[..., :half], rows[..., half:]
        return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1), 2 * half

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """``x`` ``[..., N, D]`` rotated to ``positions`` (``[..., N]``, broadcast), in fp32."""
        cos, sin, r = self._cos_sin(positions, x)
        x = x.float()
        rot, rest = x[..., :r], x[..., r:]
        return torch.cat([rot * cos + _rotate_half(rot) * sin, rest], dim=-1)

    def unrotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """The inverse of :meth:`rotate`: the rotation by ``-p f``, divided by ``s ** 2``."""
        cos, sin, r = self._cos_sin(positions, x)
        x = x.float()
        rot, rest = x[..., :r], x[..., r:]
        norm = cos * cos + sin * sin  # s ** 2 in every dimension
        return torch.cat([(rot * cos - _rotate_half(rot) * sin) / norm, rest], dim=-1)


def _rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)
