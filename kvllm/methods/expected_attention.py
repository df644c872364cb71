"""ExpectedAttention: the attention future queries are expected to pay, from the window's query statistics.

Devoto et al., "Expected Attention: KV Cache Compression by Estimating Attention from
Future Queries Distribution", 2025, arXiv:2510.00636. Reference read: kvpress 0.5.5,
``kvpress/presses/expected_attention_press.py`` (``ExpectedAttentionPress``). Per
(sequence, layer, query head), with ``q`` the window's queries before RoPE
(``Window.rope`` undoes the rotation) and the span's post-RoPE keys ``k``::

    mu, S  = mean and covariance (divided by Nq) of the pre-RoPE queries
    R      = mean over the next n_future_positions positions p of RoPE's rotation R_p
    z_i    = (R mu) . k_i / sqrt(d) + k_i^T (R S R^T) k_i / (2 d)   # S's term if use_covariance
    a_i    = mean_{g in G} softmax_i(z)_g                           # over the span's keys
    s_i    = (a_i + epsilon) * ||v_i||                               # if use_vnorm

and the top-m of ``s`` over the compressible keys. The future positions are those after
the span's last key (the sequence's next tokens), as kvpress's start after its prompt.
kvpress's defaults: ``n_future_positions = 512``, ``use_covariance``, ``use_vnorm``,
``epsilon = 0``.

Where we differ, and why:

- *The window's queries.* kvpress's statistics are over the whole prompt's queries
  (past its sinks); ours over the span's last ``Nq`` (all W + b of them under the
  periodic policy), the only queries a window has. Their pre-RoPE form is
  ``rope.unrotate`` at their own positions; RoPE is linear in its cos and sin, so the
  mean rotation is the rotation by the mean table rows, which is how it is applied.
- *The table's end.* A future position past the RoPE table is never reached: vLLM's
  ``cos_sin_cache`` covers the model's ``max_position_embeddings`` and the reference
  backend builds the same rows (``kvllm.hf.cache``). Such positions are left out of the
  mean; a span that ends at the table's end uses its last row.
- *No sinks.* kvpress protects its first ``n_sink = 4`` tokens and leaves their queries
  out of the statistics. A sequence's sinks are in its prompt, never compressed, and a
  window's first tokens are nothing special, so there is no ``n_sink``.
- *The softmax* runs over the span's keys, buffer included (the future queries attend
  to those too); the rest of the cache is not in the window.
- *Per sequence.* kvpress runs one sequence; each sequence here has its own statistics
  and its own future positions.
- *fp32 throughout*; exactly ``min(m, C)`` keys per (layer, KV head).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from kvllm.checks import check_int, check_number, fail
from kvllm.methods.base import FIELD, Method, MethodParams, Selection, Window, register
from kvllm.methods.rope import Rope
from kvllm.methods.scoring import topk_sorted

# Bound on one chunk's largest intermediate (elements), as in scoring.py: the keys
# times the covariance, G x N x d per (sequence, layer, KV head).
_MAX_CHUNK_ELEMENTS = 1 << 19


@dataclass(frozen=True)
class ExpectedAttentionParams(MethodParams):
    """kvpress 0.5.5's ``ExpectedAttentionPress`` knobs that apply to a window.

    Attributes
    ----------
    n_future_positions
        The rotation is averaged over this many positions after the span, >= 1; 512.
    use_covariance
        Add the queries' covariance term to the expected logits; True.
    use_vnorm
        Weigh each key's expected attention by its value's norm; True.
    epsilon
        Added to the expected attention before the value-norm weighting, >= 0; 0.
    """

    n_future_positions: int = 512
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    def check(self, window: int, buffer: int) -> None:
        check_int(f"{FIELD}.n_future_positions", self.n_future_positions, 1)
        for name in ("use_covariance", "use_vnorm"):
            if not isinstance(getattr(self, name), bool):
                fail(f"{FIELD}.{name}", getattr(self, name), "must be true or false")
        check_number(f"{FIELD}.epsilon", self.epsilon, 0.0, float("inf"), "must be >= 0")


def future_rotation(rope: Rope, first: Tensor, count: int) -> Rope:
    """A table whose row ``b`` is the mean of ``rope``'s rows ``first[b] .. first[b] + count - 1``.

    Rows past the table are left out; when none is in it, row ``b`` is the table's last.
    """
    table = rope.cos_sin
    n_rows = table.shape[0]
    future = first.to(table.device).unsqueeze(1) + torch.arange(count, device=table.device)  # [B, F]
    reachable = future < n_rows
    reachable[:, 0] = True  # the clamp below makes it the last row when it is past the end
    rows = table[future.clamp(max=n_rows - 1)].float() * reachable.unsqueeze(-1)
    return Rope(rows.sum(dim=1) / reachable.sum(dim=1, keepdim=True))


def expected_attention(window: Window, n_future_positions: int, use_covariance: bool) -> Tensor:
    """The group's mean expected attention over the span's keys: ``[B, L, Hkv, N]`` fp32."""
    q, k = window.queries, window.keys
    b, n_layers, hq, nq, d = q.shape
    hkv, n = k.shape[2], k.shape[3]
    g = hq // hkv
    positions = window.key_positions()
    pre = window.rope.unrotate(q, positions[:, -nq:].view(b, 1, 1, nq))
    mean_rope = future_rotation(window.rope, positions[:, -1] + 1, n_future_positions)
    # One (sequence, layer, KV head) per row; its group's queries stacked.
    heads = b * n_layers * hkv
    pre = pre.view(heads, g, nq, d)
    keys = k.reshape(heads, n, d).float()
    sequence = torch.arange(b, device=k.device).repeat_interleave(n_layers * hkv)
    out = torch.empty(heads, n, dtype=torch.float32, device=k.device)
    step = max(1, _MAX_CHUNK_ELEMENTS // (g * (n + nq + d) * d))
    for lo in range(0, heads, step):
        qs, ks, seq = pre[lo : lo + step], keys[lo : lo + step], sequence[lo : lo + step]
        mu = qs.mean(dim=2)  # [rows, G, d]
        logits = mean_rope.rotate(mu, seq.view(-1, 1)) @ ks.transpose(1, 2) / math.sqrt(d)  # [rows, G, N]
        if use_covariance:
            centred = qs - mu.unsqueeze(2)
            cov = centred.transpose(-1, -2) @ centred / nq  # [rows, G, d, d]
            # Rotating the rows gives S R^T; rotating that's transpose gives R S R^T.
            cov = mean_rope.rotate(cov, seq.view(-1, 1, 1))
            cov = mean_rope.rotate(cov.transpose(-1, -2), seq.view(-1, 1, 1))
            kg = ks.unsqueeze(1)
            logits += ((kg @ cov) * kg).sum(dim=-1) / (2 * d)
        out[lo : lo + step] = logits.softmax(dim=-1).mean(dim=1)
    return out.view(b, n_layers, hkv, n)


@register
class ExpectedAttention(Method):
    name = "expected-attention"
    reads_rope = True
    Params = ExpectedAttentionParams

    @property
    def reads_values(self) -> bool:
        return self.params.use_vnorm

    def select(self, window: Window, budget: int) -> Selection:
        p = self.params
        window.require("positions", "rope", *(("values",) if p.use_vnorm else ()), method=self.name)
        c = window.n_compress
        scores = expected_attention(window, p.n_future_positions, p.use_covariance)[..., :c]
        if p.use_vnorm:
            scores = (scores + p.epsilon) * window.values[..., :c, :].float().norm(dim=-1)
        return Selection(topk_sorted(scores, min(budget, c)))
