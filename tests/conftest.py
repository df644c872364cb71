"""Shared fixtures: a locally trained tokenizer, and a garbage collector that skips the
heap that outlives tests."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from transformers import PreTrainedTokenizerFast

from kvllm.testing import train_tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return train_tokenizer()


@pytest.fixture(autouse=True)
def _frozen_heap() -> Iterator[None]:
    """After each test, collect, then freeze what survives (``gc.freeze``).

    vLLM runs a full collection several times at every engine start and stop; over the
    test process's heap (torch, transformers, vLLM, earlier tests) each takes from half a
    second to a second, most of an engine's start and stop here. Frozen objects are
    skipped until vLLM's next shutdown unfreezes them; collecting first means that what a
    test left behind is not frozen with them.
    """
    yield
    gc.collect()
    gc.freeze()
