"""Rope against transformers' own rotation, and its inverse."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

from kvllm.hf.cache import rope_parameters
from kvllm.methods.rope import Rope
from kvllm.testing import model_config


@pytest.mark.parametrize("rope_type", ["default", "linear"])
def test_rotate_is_transformers_rotation(rope_type: str) -> None:
    config = model_config("qwen3", vocab_size=64, heads=4, kv_heads=2)
    if rope_type == "linear":
        config.rope_parameters = {**config.rope_parameters, "rope_type": "linear", "factor": 4.0}
    gen = torch.Generator().manual_seed(0)
    head_dim = config.head_dim
    x = torch.randn(2, 3, 7, head_dim, generator=gen)
    positions = torch.tensor([[0, 1, 2, 3, 50, 51, 52], [9, 10, 11, 12, 13, 14, 15]])
    cos, sin = Qwen3RotaryEmbedding(config)(x, positions)
    expected, _ = apply_rotary_pos_emb(x, x, cos, sin)
    inv_freq, scaling = rope_parameters(config)
    rope = Rope.from_inv_freq(inv_freq, 64, scaling)
    got = rope.rotate(x, positions.unsqueeze(1))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rope.unrotate(got, positions.unsqueeze(1)), x, rtol=1e-5, atol=1e-5)


def test_scaled_rotation_inverts_and_partial_rotary_passes_the_rest() -> None:
    gen = torch.Generator().manual_seed(1)
    inv_freq = torch.rand(3, generator=gen)  # 6 of 8 dimensions rotate
    rope = Rope.from_inv_freq(inv_freq, 32, scaling=1.3)
    x = torch.randn(5, 8, generator=gen)
    positions = torch.tensor([0, 3, 7, 30, 31])
    rotated = rope.rotate(x, positions)
    assert torch.equal(rotated[:, 6:], x[:, 6:])
    assert torch.equal(rotated[0, :6], 1.3 * x[0, :6])  # position 0: cos 1, sin 0, times s
    torch.testing.assert_close(rope.unrotate(rotated, positions), x)


def test_a_position_past_the_table_is_an_error() -> None:
    rope = Rope.from_inv_freq(torch.ones(2), 4)
    with pytest.raises(ValueError, match="position 4 is past"):
        rope.rotate(torch.zeros(1, 4), torch.tensor([4]))
