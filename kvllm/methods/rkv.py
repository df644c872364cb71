"""R-KV: importance minus redundancy, as R-KV's reference code selects.

Cai et al., "R-KV: Redundancy-aware KV Cache Compression for Training-Free Reasoning
Models Acceleration", 2025. Reference read: Zefan-Cai/R-KV at d15c976,
``rkv/compression/r1_kv.py`` (``R1KV.update_kv``) and ``rkv/utils.py``
(``compute_attention_scores``, ``cal_similarity``). Per (sequence, layer, KV head), with
the last ``w`` queries (the observation window, ``alpha = 8``) and the compressible
keys ``i < C`` as the candidates::

    l_j,i = max_{g in G} q_{g,j} . k_i / sqrt(d)        # group max of the logits
    a_j   = softmax_{i < C}(l_j)                         # over the candidates only
    I     = maxpool_7(mean_j a_j)                        # not renormalised
    S     = cos(k_a, k_b) over all N keys of the span, diagonal 0;
            for each row a, zero S[a, last b with S[a, b] > 0.5]   # keep its most recent look-alike
    R     = softmax_b(mean_a S[a, b])[:C]               # softmax over all N, then the candidates
    z     = lambda * I - (1 - lambda) * R               # lambda = 0.07

and the top-m of ``z``. A row with no look-alike zeroes its entry for key 0, as
``torch.max`` over R-KV's zero-filled index tensor does; this is reproduced, so the
kept set is R-KV's. Defaults are the code's: ``mix_lambda = 0.07`` (``R1KV`` and
``run_math.py``; the README's table says 0.1), ``window_size = 8``, ``kernel_size = 7``,
similarity threshold 0.5 (``cal_similarity``), ``retain_direction = "last"``.

Deviations forced by our setting, each keeping R-KV's formula on what we are given:

- *Window and buffer are separate.* R-KV's ``window_size`` is both the observation
  window and the protected recent tokens (kept, never scored as candidates). Here the
  protected part is the buffer ``b`` (``CompressionConfig.buffer``) and the observation
  window is ``obs_window``; the candidates, over which the importance softmax runs and
  which pooling sees, are the compressible keys, R-KV's "non-window" keys. With
  ``buffer == obs_window`` the two coincide and the formula is R-KV's verbatim.
- *Causal mask.* When ``obs_window > buffer`` some observation queries sit inside the
  compressible area; a query does not see later keys (R-KV never needs the mask, its
  candidates all precede its window).
- *Redundancy over the span.* R-KV compares keys over its whole cache (kept and new);
  a method here sees one window's span (``W + b`` keys), so similarity runs over that.
- *Per sequence.* ``cal_similarity`` reads batch 0's keys (R-KV runs batch size 1);
  each sequence here uses its own keys.
- *fp32.* R-KV rounds the pooled attention to the model dtype (bf16); we stay in fp32.

Budget: R-KV keeps exactly ``budget - window_size`` candidates per head, uniform, as the
paged engine needs; here exactly ``min(m, C)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kvllm.checks import check_number
from kvllm.methods.base import FIELD, Method, Selection, Window, register
from kvllm.methods.scoring import topk_sorted
from kvllm.methods.snapkv import SnapKVParams

# Bound on one chunk of the N x N similarity matrices (elements), as in scoring.py.
_MAX_CHUNK_ELEMENTS = 1 << 19


@dataclass(frozen=True)
class RKVParams(SnapKVParams):
    """R-KV's knobs, with its reference defaults (R-KV at d15c976).

    Attributes
    ----------
    obs_window
        alpha: the last this many queries score the candidates, in [1, W + b]; 8.
    pool_kernel
        *Max*-pooling kernel along the candidates (R-KV's ``kernel_size``), odd >= 1; 7.
    lam
        lambda in [0, 1]: ``z = lambda * importance - (1 - lambda) * redundancy``;
        R-KV's ``mix_lambda = 0.07``.
    sim_threshold
        Cosine similarity above which two keys look alike, in [-1, 1]; 0.5.
    """

    obs_window: int = 8
    pool_kernel: int = 7
    lam: float = 0.07
    sim_threshold: float = 0.5

    def check(self, window: int, buffer: int) -> None:
        super().check(window, buffer)
        check_number(f"{FIELD}.lam", self.lam, 0.0, 1.0, "must be in [0, 1]")
        check_number(f"{FIELD}.sim_threshold", self.sim_threshold, -1.0, 1.0, "must be in [-1, 1]")


def rkv_importance(window: Window, obs_window: int, pool_kernel: int) -> Tensor:
    """R-KV's importance of the compressible keys: ``[B, L, Hkv, C]`` fp32.

    The GQA group's logits are reduced by their max *before* the softmax, which runs
    over the compressible keys only; the result is averaged over the observation
    queries and max-pooled (stride 1, ``-inf`` padding), and left unnormalised.
    """
    c = window.n_compress
    n = window.keys.shape[3]
    w = min(obs_window, window.queries.shape[3])
    q = window.queries[..., -w:, :].float()
    k = window.keys[..., :c, :].float()
    b, n_layers, hq, _, d = q.shape
    hkv = k.shape[2]
    q = q.view(b, n_layers, hkv, hq // hkv, w, d) * d**-0.5
    logits = q @ k.unsqueeze(3).transpose(-1, -2)  # [B, L, Hkv, G, w, C]
    # Observation query j is the token at span position n - w + j.
    q_pos = torch.arange(n - w, n, device=k.device).unsqueeze(1)
    logits.masked_fill_(torch.arange(c, device=k.device).unsqueeze(0) > q_pos, float("-inf"))
    attn = logits.amax(dim=3).softmax(dim=-1).mean(dim=-2)  # [B, L, Hkv, C]
    if pool_kernel > 1:
        shape = attn.shape
        attn = F.max_pool1d(attn.reshape(-1, 1, c), pool_kernel, stride=1, padding=pool_kernel // 2).view(shape)
    return attn


def rkv_redundancy(keys: Tensor, n_compress: int, threshold: float) -> Tensor:
    """R-KV's redundancy of the first ``n_compress`` of ``keys`` ``[..., N, D]``: ``[..., C]`` fp32.

    Cosine similarity over all ``N`` keys with the diagonal zeroed; each row then drops
    its entry for its most recent look-alike (similarity above ``threshold``); the
    column means go through a softmax over all ``N`` keys.
    """
    *lead, n, d = keys.shape
    kf = keys.reshape(-1, n, d).float()
    kf = kf / (kf.norm(dim=-1, keepdim=True) + 1e-8)
    positions = torch.arange(n, device=keys.device)
    out = torch.empty(kf.shape[0], n, dtype=torch.float32, device=keys.device)
    step = max(1, _MAX_CHUNK_ELEMENTS // (n * n))
    for lo in range(0, kf.shape[0], step):
        part = kf[lo : lo + step]
        sim = part @ part.transpose(1, 2)
        sim.diagonal(dim1=1, dim2=2).zero_()
        # The last look-alike of each row, or 0 when it has none.
        last = torch.where(sim > threshold, positions, 0).amax(dim=-1, keepdim=True)
        sim.scatter_(-1, last, 0.0)
        out[lo : lo + step] = sim.mean(dim=1).softmax(dim=-1)
    return out[:, :n_compress].view(*lead, n_compress)


@register
class RKV(Method):
    name = "rkv"
    Params = RKVParams

    def select(self, window: Window, budget: int) -> Selection:
        p = self.params
        c = window.n_compress
        importance = rkv_importance(window, p.obs_window, p.pool_kernel)
        redundancy = rkv_redundancy(window.keys, c, p.sim_threshold)
        z = p.lam * importance - (1 - p.lam) * redundancy
        return Selection(topk_sorted(z, min(budget, c)))
