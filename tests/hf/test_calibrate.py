"""Q-Filters computed from a model's queries against an independent SVD of the same queries."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from transformers import PreTrainedTokenizerFast
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

from kvllm.hf.calibrate import q_filters
from kvllm.testing import model_config, random_model

TEXTS = [
    "let v1 = 5 then compute the sum of v2 and v3, then the answer",
    "so let v3 = 17 and v4 = 2; compute v3 and v4 then the answer is",
    "we check step a value, then another, then the last one",
]


def post_rope_queries(model, inputs: list[Tensor]) -> list[Tensor]:
    """Per layer, ``[Hq, T, D]``: every text's queries after RoPE, in order, read off
    Qwen3's ``q_norm`` (the query before RoPE) and rotated with transformers' own RoPE,
    in a plain forward of the model's eager attention."""
    layers = model.model.layers
    pre: list[list[Tensor]] = [[] for _ in layers]
    hooks = [
        layer.self_attn.q_norm.register_forward_hook(lambda _m, _a, out, i=i: pre[i].append(out.transpose(1, 2)))
        for i, layer in enumerate(layers)
    ]
    rotated: list[list[Tensor]] = [[] for _ in layers]
    try:
        with torch.no_grad():
            for ids in inputs:
                for i in range(len(layers)):
                    pre[i].clear()
                model(input_ids=ids[None], use_cache=False)
                positions = torch.arange(len(ids))[None]
                cos, sin = model.model.rotary_emb(pre[0][0], positions)
                for i in range(len(layers)):
                    q, _ = apply_rotary_pos_emb(pre[i][0], pre[i][0], cos, sin)
                    rotated[i].append(q[0])
    finally:
        for hook in hooks:
            hook.remove()
    return [torch.cat(qs, dim=1) for qs in rotated]


def svd_filters(queries: list[Tensor], kv_heads: int) -> Tensor:
    """``make_filters.py``'s rule on every query: per head ``svd``, the sign that makes
    most of ``u[:, 0]`` positive, ``-sign * vh[0]``, the mean over each KV head's group."""
    out = []
    for q in queries:  # [Hq, T, D]
        u, _, vh = torch.linalg.svd(q.double(), full_matrices=False)
        sign = ((u[..., 0] > 0).double().mean(-1) > 0.5).double() * 2 - 1
        filters = -sign[:, None] * vh[:, 0, :]
        out.append(filters.view(kv_heads, -1, filters.shape[-1]).mean(1))
    return torch.stack(out).float()


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (4, 4), (6, 2)])
def test_filters_are_the_svd_of_the_post_rope_queries(
    tokenizer: PreTrainedTokenizerFast, heads: int, kv_heads: int
) -> None:
    model = random_model(model_config("qwen3", vocab_size=len(tokenizer), layers=3, heads=heads, kv_heads=kv_heads))
    inputs = [tokenizer(text, return_tensors="pt")["input_ids"][0] for text in TEXTS]
    ours = q_filters(model, inputs)
    assert ours.shape == (3, kv_heads, 16) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, svd_filters(post_rope_queries(model, inputs), kv_heads), atol=1e-5, rtol=0)
    # The model is left as it was.
    assert model.config._attn_implementation == "eager"


def test_most_queries_project_positively_on_the_direction(tokenizer: PreTrainedTokenizerFast) -> None:
    """With one query head per KV head the filter is ``-v``: most queries have ``q . v > 0``."""
    model = random_model(model_config("qwen3", vocab_size=len(tokenizer), layers=2, heads=2, kv_heads=2))
    inputs = [tokenizer(text, return_tensors="pt")["input_ids"][0] for text in TEXTS]
    filters = q_filters(model, inputs)
    for layer, q in enumerate(post_rope_queries(model, inputs)):
        for head in range(2):
            assert (q[head] @ -filters[layer, head] > 0).double().mean() > 0.5
