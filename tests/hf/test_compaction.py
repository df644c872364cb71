from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvllm.hf.compaction import compact


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_kept_slots_equal_originals_and_rest_is_untouched(data: st.DataObject) -> None:
    b, h = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    n = data.draw(st.integers(1, 40))
    start = data.draw(st.integers(0, n - 1))
    c = data.draw(st.integers(1, n - start))
    m = data.draw(st.integers(1, c))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    x = torch.randn(b, h, n, 5, generator=gen)
    idx = torch.rand(b, h, c, generator=gen).topk(m).indices.sort().values
    out = compact(x, start, c, idx)
    assert out.shape == (b, h, n - c + m, 5)
    assert torch.equal(out[:, :, :start], x[:, :, :start])
    for bi in range(b):
        for hi in range(h):
            assert torch.equal(out[bi, hi, start : start + m], x[bi, hi, start + idx[bi, hi]])
    assert torch.equal(out[:, :, start + m :], x[:, :, start + c :])


def test_masks_compact_like_values() -> None:
    mask = torch.tensor([[[True, False, True, True, False, True]]])
    out = compact(mask, 1, 4, torch.tensor([[[0, 2]]]))
    assert out.tolist() == [[[True, False, True, True]]]
