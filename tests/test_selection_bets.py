"""tools/selection_bets.py: merging folds by key similarity, a lazy cell runs the
registered lazy retention, and a cell with neither runs the reference cache's rounds exactly."""

from __future__ import annotations

import pytest
import torch

from kvllm import CompressionConfig
from kvllm.hf import generate
from kvllm.testing import model_config, random_model
from tools.selection_bets import Cell, generate_cell, merged_values

PROMPTS = ["let v1 = 5 then compute the sum of v2", "so let v3 = 17 and v4 = 2; compute v3 and v4"]
# W=32, b=8, r=0.25: a budget of m=8 a window.
CONFIG = CompressionConfig(window=32, buffer=8, period=4, retention=0.25)


def test_merged_values_fold_the_dropped_into_the_most_similar_kept() -> None:
    torch.manual_seed(0)
    keys, values = torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4)
    kept = torch.tensor([[[1, 4]]])
    # No cosine exceeds 1: nothing is folded.
    assert torch.equal(merged_values(keys, values, kept, 1.0), values[:, :, [1, 4]])
    # Key 0 points along kept key 1 (cosine 1): folded into it at weight 1; the rest are not.
    keys[0, 0, 0] = 3 * keys[0, 0, 1]
    keys[0, 0, [2, 3, 5]] = -keys[0, 0, 1]  # cosine -1 with key 1, below the threshold with key 4 too
    keys[0, 0, 4] = torch.tensor([keys[0, 0, 1, 1], -keys[0, 0, 1, 0], 0.0, 0.0])  # orthogonal to key 1
    out = merged_values(keys, values, kept, 0.5)
    torch.testing.assert_close(out[0, 0, 0], (values[0, 0, 1] + values[0, 0, 0]) / 2)
    torch.testing.assert_close(out[0, 0, 1], values[0, 0, 4])


def test_cell_parse_round_trips() -> None:
    cell = Cell.parse("kara-retain+lazy2+keep0.75")
    assert cell == Cell("kara-retain", lazy=2, keep=0.75)
    assert Cell.parse(cell.label) == cell
    assert Cell.parse("kara+merge0.5") == Cell("kara", merge=0.5)
    with pytest.raises(SystemExit, match="lazyF, keepA or mergeTAU"):
        Cell.parse("kara+slow")
    with pytest.raises(SystemExit, match="do not combine"):
        Cell.parse("kara+lazy2+merge0.5")


@pytest.fixture(scope="module")
def model(tokenizer):
    m = random_model(model_config(vocab_size=len(tokenizer)))
    m.generation_config.eos_token_id = None
    return m


def test_a_plain_cell_is_the_reference_cache(model, tokenizer) -> None:
    # Neither lazy nor merging, or merging that folds nothing: the same rounds, the same tokens.
    plain = generate(model, tokenizer, PROMPTS, CONFIG, 160, stop_at_eos=False)
    for cell in (Cell("kara"), Cell("kara", merge=1.0)):
        out = generate_cell(cell, model, tokenizer, PROMPTS, CONFIG, 160, stop_at_eos=False)
        assert out.token_ids == plain.token_ids
        assert [s.physical_length for s in out.stats] == [s.physical_length for s in plain.stats]


def test_a_lazy_cell_is_the_registered_lazy_retention(model, tokenizer) -> None:
    lazy = CONFIG.replace(lazy=2, lazy_keep=0.5)
    expected = generate(model, tokenizer, PROMPTS, lazy, 160, stop_at_eos=False)
    out = generate_cell(Cell("kara", lazy=2, keep=0.5), model, tokenizer, PROMPTS, CONFIG, 160, stop_at_eos=False)
    assert out.token_ids == expected.token_ids
    assert [s.physical_length for s in out.stats] == [s.physical_length for s in expected.stats]
