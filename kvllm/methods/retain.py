"""kara-retain: Kara's window score plus a learned retaining score of each key's future reads.

Beyond the paper. Kara scores a window by the attention its own queries pay, but a key
is worth keeping for the attention *later* queries will pay it, which no window query
shows: a result written in the window is read, if at all, hundreds of tokens on. What a
key will be worth is, on a chain of thought, much a matter of what the token is (a
value just written, an operand, a name, filler), and that is in its key and value when
they are written. Locret (Huang et al., "Locret: Enhancing Eviction in Long-Context LLM
Inference with Trained Retaining Heads", 2024, arXiv:2410.01805) trains small heads that
predict a cache unit's importance from what is known when it is cached; this is the
simplest such head, fitted per model by ``kvllm calibrate --kind kara-retain``
(:func:`kvllm.hf.calibrate.retain_weights`): per (layer l, KV head h), a ridge
regression, on ``x_i = [pre-RoPE k_i, v_i, 1]``, of whether the future-attention oracle
keeps key ``i`` (:mod:`kvllm.eval.oracle`: the top share of its window by the attention
queries W + b or more tokens later pay it, in Full-KV passes over training-seed task
texts)::

    r_i     = w_{l,h} . x_i                         # the learned retaining score
    s_i     = (1 - mix) z(kara_i) + mix z(r_i)       # z: z-scored over the window, per (l, h)

and plain top-m of ``s`` (the default), or Token2Chunk with Kara's knobs (``token2chunk``).
``mix = 0`` is Kara. Pre-RoPE keys, since a key's place in the sequence says nothing of
its worth and the rotation would make one linear map serve every position differently
(``Window.rope`` undoes it at the span's positions, so the periodic policy's
uncompressed windows only: ``reads_key_positions``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from kvllm.checks import check_number, fail
from kvllm.methods.base import FIELD, ScoredMethod, Selection, Window, register
from kvllm.methods.kara import KaraParams
from kvllm.methods.qfilter import check_signature, load_calibration
from kvllm.methods.scoring import attention_scores, topk_sorted, zscore
from kvllm.methods.token2chunk import token2chunk

#: The calibration file's tensor: ``[L, Hkv, 2 D + 1]`` fp32 weights (key, value, bias).
WEIGHTS = "retain_weights"


@dataclass(frozen=True)
class RetainParams(KaraParams):
    """Kara's knobs, the retaining score's file and how much it weighs.

    Attributes
    ----------
    calibration
        Path of the model's ``kvllm calibrate --kind kara-retain`` file; no default.
    mix
        Weight of the learned score's z-score against Kara's, in [0, 1].
    token2chunk
        Token2Chunk on the mixed score (else plain top-m).

    The defaults were chosen on 16 development seeds of ``reason`` with
    ``kara-reasoner-6l`` v2 at r=0.2, W=128, b=32 (docs/results/accuracy.md), with labels
    that gave each key its own query horizon: free-running statements right 0.452 at mix
    0.5 against 0.432 at 0.75 and 0.409 at 1.0, and, forced, top-m above Token2Chunk
    (0.928 against 0.843 lookup fidelity at mix 0.5). Labels that give a window's keys
    the window's one horizon, as the oracle scores them (the shipped file's), raised the
    forced fidelity to 0.955 and the free statements right to 0.484 at the defaults.
    """

    calibration: str = ""
    mix: float = 0.5
    token2chunk: bool = False

    def check(self, window: int, buffer: int) -> None:
        super().check(window, buffer)
        if not isinstance(self.calibration, str) or not self.calibration:
            fail(f"{FIELD}.calibration", self.calibration, "must be the path (a str) of a `kvllm calibrate` file")
        load_calibration(self.calibration, WEIGHTS)
        check_number(f"{FIELD}.mix", self.mix, 0.0, 1.0, "must be in [0, 1]")
        if not isinstance(self.token2chunk, bool):
            fail(f"{FIELD}.token2chunk", self.token2chunk, "must be true or false")


def retaining_scores(window: Window, weights: Tensor) -> Tensor:
    """The learned score of the compressible keys: ``[B, L, Hkv, C]`` fp32."""
    b, c = window.keys.shape[0], window.n_compress
    positions = window.key_positions()[:, :c].view(b, 1, 1, c)
    keys = window.rope.unrotate(window.keys[..., :c, :], positions)  # fp32
    d = keys.shape[-1]
    w = weights.to(keys.device)[None]  # [1, L, Hkv, 2D + 1]
    return (
        (keys * w[..., None, :d]).sum(-1)
        + (window.values[..., :c, :].float() * w[..., None, d : 2 * d]).sum(-1)
        + w[..., 2 * d, None]
    )


@register
class KaraRetain(ScoredMethod):
    name = "kara-retain"
    reads_rope = True
    Params = RetainParams
    reads_key_positions = True

    @property
    def reads_values(self) -> bool:
        return True

    def check_model(self, model_config: Any) -> None:
        check_signature(self.params.calibration, WEIGHTS, model_config, ("num_layers", "num_kv_heads", None))

    def scores(self, window: Window) -> Tensor:
        """The mixed score of the compressible keys, ``[B, L, Hkv, C]``: Kara's and the
        learned one, each z-scored over the window."""
        window.require("values", "rope", "positions", method=self.name)
        p = self.params
        weights = load_calibration(p.calibration, WEIGHTS).tensor
        _, layers, hkv, _, d = window.keys.shape
        if tuple(weights.shape) != (layers, hkv, 2 * d + 1):
            fail(
                f"{FIELD}.calibration",
                p.calibration,
                f"holds {WEIGHTS} of {list(weights.shape)}, but this model's windows need "
                f"[{layers}, {hkv}, {2 * d + 1}]",
            )
        kara = attention_scores(window, causal=False)[..., : window.n_compress]
        return (1 - p.mix) * zscore(kara) + p.mix * zscore(retaining_scores(window, weights))

    def choose(self, scores: Tensor, budget: int) -> Selection:
        p = self.params
        if p.token2chunk:
            # Token2Chunk sums endpoint scores over a gap's length: they must not be negative.
            scores = scores - scores.amin(dim=-1, keepdim=True)
            return Selection(token2chunk(scores, budget, p.rho, p.beta, p.max_gap))
        return Selection(topk_sorted(scores, min(budget, scores.shape[-1])))
