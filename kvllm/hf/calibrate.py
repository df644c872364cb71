"""Q-Filters from a transformers model's own queries (``kvllm calibrate``).

Each calibration text runs through the model alone (no padding, no cache) under an
attention function that hands every layer's post-RoPE queries to an accumulator and then
computes transformers' SDPA attention. The filters are those of ``make_filters.py``
(:mod:`kvllm.methods.qfilter`): per query head, the first right singular vector of its
queries, signed so that most of them project positively, negated, averaged over the KV
head's group. The singular vector is the top eigenvector of the queries' Gram matrix,
accumulated over every token in fp64, and the sign takes a second pass over the texts,
so no query is held in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

NAME = "kvllm-calibrate"

# Called with (layer index, post-RoPE queries [1, Hq, T, D]).
Sink = Callable[[int, Tensor], None]


def _recording_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    kvllm_queries: Sink | None = None,
    **kwargs: object,
) -> tuple[Tensor, None]:
    """SDPA attention that first hands ``query`` to ``kvllm_queries``."""
    if kvllm_queries is None:
        raise RuntimeError(f"{NAME} attention needs the query sink passed as `kvllm_queries=`")
    kvllm_queries(module.layer_idx, query)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(NAME, _recording_attention)
# The causal mask SDPA takes: transformers builds none for a name it has no mask function for.
AttentionMaskInterface.register(NAME, sdpa_mask)


def _run(model: PreTrainedModel, inputs: Sequence[Tensor], sink: Sink) -> None:
    """Feed each 1-D token-id tensor of ``inputs`` through ``model`` alone, queries to ``sink``."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    try:
        for ids in inputs:
            model(input_ids=ids.to(model.device)[None], use_cache=False, logits_to_keep=1, kvllm_queries=sink)
    finally:
        model.set_attn_implementation(previous)


@torch.inference_mode()
def q_filters(model: PreTrainedModel, inputs: Sequence[Tensor]) -> Tensor:
    """The model's Q-Filters from its queries on ``inputs``: ``[L, Hkv, D]`` fp32 on the CPU.

    Parameters
    ----------
    model
        A transformers causal LM with RoPE attention (Qwen3, Qwen2, Llama, ...).
    inputs
        Calibration texts as 1-D token-id tensors; every token's query counts.
    """
    config = model.config
    layers, hq, hkv = config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // hq
    gram = torch.zeros(layers, hq, d, d, dtype=torch.float64, device=model.device)

    def accumulate(layer: int, query: Tensor) -> None:
        q = query[0].double()  # [Hq, T, D]
        gram[layer] += q.transpose(-1, -2) @ q

    _run(model, inputs, accumulate)
    # eigh sorts eigenvalues ascending: the last eigenvector is the first singular direction.
    directions = torch.linalg.eigh(gram).eigenvectors[..., -1]  # [L, Hq, D], either sign
    positive = torch.zeros(layers, hq, dtype=torch.long, device=model.device)

    def count(layer: int, query: Tensor) -> None:
        positive[layer] += (query[0].double() @ directions[layer].unsqueeze(-1) > 0).sum(dim=(-2, -1))

    _run(model, inputs, count)
    tokens = sum(len(ids) for ids in inputs)
    # make_filters.py: +1 where more than half the queries project positively.
    sign = torch.where(2 * positive > tokens, 1.0, -1.0).to(directions.dtype)
    filters = -sign.unsqueeze(-1) * directions
    return filters.view(layers, hkv, hq // hkv, d).mean(dim=2).float().cpu()


@torch.inference_mode()
def retain_weights(
    model: PreTrainedModel,
    inputs: Sequence[Tensor],
    starts: Sequence[int],
    gap: int,
    window: int,
    keep: int,
    ridge: float = 1.0,
) -> Tensor:
    """``kara-retain``'s retaining heads: ``[L, Hkv, 2 D + 1]`` fp32 on the CPU.

    Per (layer, KV head), the ridge regression (penalty ``ridge``) of a key's label on
    ``[pre-RoPE k_i, v_i, 1]``, over the keys of every whole window of every input (the
    chain of thought from ``starts``, cut into ``window``-token windows as the periodic
    policy's rounds cut it). The label is 1 when the oracle would keep the key
    (:mod:`kvllm.eval.oracle`): among the top ``keep`` of its window by the attention
    that the queries ``gap`` (W + b) or more tokens past the window's start give it in a
    Full-KV pass, summed over the KV head's group; else 0. (Regressing the attention
    itself, in logs, ranked worse: a key's mass is dominated by what every later line
    reads, not by the values a few lines will.)
    The normal equations are accumulated in fp64, input by input, so no attention matrix
    outlives its pass.
    """
    from kvllm.hf.cache import rope_parameters
    from kvllm.methods.rope import Rope

    config = model.config
    layers, hq, hkv = config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // hq
    inv_freq, scaling = rope_parameters(config)
    rope = Rope.from_inv_freq(inv_freq, max(len(ids) for ids in inputs), scaling)
    width = 2 * d + 1
    gram = torch.zeros(layers, hkv, width, width, dtype=torch.float64)
    moment = torch.zeros(layers, hkv, width, dtype=torch.float64)
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        for ids, start in zip(inputs, starts, strict=True):
            n = len(ids)
            # Whole windows whose scoring queries (gap or more tokens past the window's start,
            # as a round's span ends there) exist: the oracle scores a window's keys by
            # the same queries, so each window shares one horizon.
            firsts = list(range(start, n - window + 1, window))
            firsts = [f for f in firsts if f + gap < n]
            if not firsts:
                continue
            rows = torch.cat([torch.arange(f, f + window) for f in firsts])
            horizon = torch.tensor(firsts).repeat_interleave(window) + gap
            out = model(input_ids=ids.to(model.device)[None], output_attentions=True, use_cache=True)
            for layer, attention in enumerate(out.attentions):
                a = attention[0].float().cpu().unflatten(0, (hkv, hq // hkv)).sum(1)  # [Hkv, T, T]
                # Mass from the window's later queries: suffix sums down the query axis.
                later = a.flip(1).cumsum(1).flip(1)[:, horizon, rows].view(hkv, len(firsts), window)
                top = later.topk(min(keep, window), dim=-1).indices
                y = torch.zeros_like(later).scatter_(-1, top, 1.0).view(hkv, -1)
                cache = out.past_key_values.layers[layer]
                keys = rope.unrotate(cache.keys[0].float().cpu()[:, rows], rows.view(1, -1))
                x = torch.cat([keys, cache.values[0].float().cpu()[:, rows], torch.ones(hkv, len(rows), 1)], -1)
                gram[layer] += x.double().transpose(-1, -2) @ x.double()
                moment[layer] += (x.double() * y.double().unsqueeze(-1)).sum(1)
    finally:
        model.set_attn_implementation(previous)
    penalty = ridge * torch.eye(width, dtype=torch.float64)
    return torch.linalg.solve(gram + penalty, moment.unsqueeze(-1)).squeeze(-1).float()
